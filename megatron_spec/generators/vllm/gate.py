"""The whole-step gate on a vLLM engine: a `generate` call that runs as if the engine had no speculative config.

vLLM 0.32 fixes speculation at engine start (its only variable k is a batch-size table, and at k = 0 a model
drafter still runs its prefill forward, suffix decoding refuses it). Two hooks make a plain step a plain engine's:

- The scheduler (`gated_scheduler`, passed as `scheduler_cls`, built in the engine core's process): while any
  unfinished request is marked plain (`PLAIN_ARG` in its sampling params' `extra_args`, which travel with the
  request to whatever process schedules it), it schedules with no speculative or lookahead tokens, so it never
  pads a request with draft placeholders, and hands the workers `num_spec_tokens_to_schedule = 0`.
- The workers (`gate_runner`, installed by the worker extension): a step with nothing to speculate runs with the
  model runner's speculative config unset, as a runner built without one does: no drafter forward, no proposal,
  no rejection sampling.

The generator never mixes plain and speculative requests in one engine (a `generate` call is one mode, and an
in-flight refit continues its requests in the same mode), so the mode is the engine's for the whole step.
"""

from __future__ import annotations

PLAIN_ARG = "megatron_spec_plain"
"""`SamplingParams.extra_args` key of a request generated without speculation."""


def is_plain(request) -> bool:
    params = getattr(request, "sampling_params", None)
    return bool(params is not None and (params.extra_args or {}).get(PLAIN_ARG))


class _PlainSteps:
    """Mixed into vLLM's scheduler: each `schedule()` speculates with the configured k unless a request is
    plain."""

    def megatron_spec_keep(self) -> None:
        self.megatron_spec_k = self.num_spec_tokens, self.num_lookahead_tokens

    def schedule(self, *args, **kwargs):
        plain = any(is_plain(r) for r in self.requests.values())
        self.num_spec_tokens, self.num_lookahead_tokens = (0, 0) if plain else self.megatron_spec_k
        return super().schedule(*args, **kwargs)


_CLASSES: dict[type, type] = {}


def gated_scheduler(*args, vllm_config, **kwargs):
    """vLLM's scheduler for this config (the asynchronous one where vLLM turned async scheduling on), with the
    plain-step switch: what `scheduler_cls` names, called as vLLM calls a scheduler class."""
    if vllm_config.scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as base
    cls = _CLASSES.setdefault(base, type(f"Gated{base.__name__}", (_PlainSteps, base), {}))
    scheduler = cls(*args, vllm_config=vllm_config, **kwargs)
    scheduler.megatron_spec_keep()
    return scheduler


def gate_runner(runner) -> None:
    """Wrap the model runner's `execute_model` so that a step the scheduler gave no speculative tokens (a plain
    step) runs with `speculative_config` unset, up to the next step; the drafter and its state stay as they are."""
    spec, execute = runner.speculative_config, runner.execute_model
    if spec is None or getattr(runner, "megatron_spec_gated", False):
        return

    def execute_model(scheduler_output, *args, **kwargs):
        plain = scheduler_output.num_spec_tokens_to_schedule == 0 and not scheduler_output.scheduled_spec_decode_tokens
        runner.speculative_config = None if plain else spec
        return execute(scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model
    runner.megatron_spec_gated = True
