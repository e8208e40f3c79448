"""The simulator's step for the layout an at-scale plan runs (`plan["projected"]`), computed before launch so that
checks can use its length: the first checkpoint against the job's `--time` (`launchers/cadence.py`) and the
collective timeout against the longest a trainer rank waits inside a collective.

The projection is deliberately the slow case: plain decoding (speculation can be gated off, or accept less than
assumed), the projection's response-length distribution (`megatron_spec.sim.projection.projection_workload`: the
reference's RL-Think lengths) under the run's `grpo.max_tokens`, and the run's own prompts, group size, split,
engines, placement, policy lag and recompute. A plan without a known architecture, with the embedded trainer, or
with a layout the simulator refuses (which the layout and memory checks then name) has no projection.
"""

from __future__ import annotations

from functools import lru_cache

TIMEOUT_FACTOR = 2.0
"""How many projected steps `backend.init_timeout_s` must cover. Megatron's followers wait inside a collective for
rank 0's next call through a whole step of its work (the first one with the first evaluation and generation), so
a timeout shorter than a step kills a healthy job; twice the projection leaves room for a slow step."""


def project(cfg, layout: dict, gpu: str = "h100") -> dict | None:
    """`{"gpu", "assumes", "stage_s", "step_s"}` of the plain-decoding step of `cfg` on `layout`
    (`Scale.layout`), or None where there is nothing to project."""
    from .checks import policy_config, prompt_budget

    if cfg.backend.trainer != "megatron" or policy_config(cfg.model.policy, cfg.model.hub_cache) is None:
        return None
    g, b, m = cfg.grpo, cfg.backend, cfg.backend.megatron
    v = layout["vllm"]
    colocated = layout["ray"]["placement"] != "disaggregated"
    key = (cfg.model.policy, cfg.model.hub_cache, gpu, layout["gpus"], g.prompts_per_step, g.group_size,
           g.max_tokens, prompt_budget(cfg), m.tp, m.pp, m.ep, m.cp, layout["megatron"]["dp"], v["tensor_parallel_size"],
           v["engines"], colocated, b.async_lag, m.recompute, b.vllm.gpu_memory_utilization)
    try:
        stages = _simulate(key)
    except ValueError:  # a split the model cannot take, or one the simulator finds out of memory: the layout and
        return None     # memory checks report it in their own words
    return {"gpu": gpu, "assumes": "plain decoding, the reference's RL-Think response lengths",
            "stage_s": {k: round(s, 1) for k, s in stages.items() if k != "step"}, "step_s": round(stages["step"], 1)}


@lru_cache(maxsize=32)
def _simulate(key: tuple) -> dict[str, float]:
    from megatron_spec.sim.config import GenParallel, LengthDist, SimConfig, TrainParallel, Workload
    from megatron_spec.sim.pipeline import simulate
    from megatron_spec.sim.projection import projection_workload

    from .checks import policy_config

    (policy, cache, gpu, gpus, prompts, group, max_tokens, prompt_cap, tp, pp, ep, cp, dp, gen_tp, engines,
     colocated, lag, recompute, utilization) = key
    model = policy_config(policy, cache)
    ref = projection_workload()
    workload = Workload(prompts, group, min(ref.prompt_len, prompt_cap),
                        LengthDist(mean=ref.response.mean, max_tokens=max_tokens, sigma=ref.response.sigma))
    sim = SimConfig(model=model, hardware=gpu, gpus=gpus, workload=workload,
                    train=TrainParallel(tp=tp, pp=pp, ep=ep, cp=cp, dp=dp),
                    gen=GenParallel(tp=gen_tp, ep=gen_tp if model.num_experts else 1), colocated=colocated,
                    gen_gpus=0 if colocated else engines * gen_tp, policy_lag=lag, recompute=recompute,
                    gpu_memory_utilization=utilization)
    result = simulate(sim)
    return {**result.stages, "step": result.step_s}


def timeout_problems(cfg, projected: dict | None) -> list[str]:
    """`backend.init_timeout_s` (start-up and every later collective of the trainer's group) must cover
    `TIMEOUT_FACTOR` projected steps."""
    if projected is None:
        return []
    need = TIMEOUT_FACTOR * projected["step_s"]
    if cfg.backend.init_timeout_s >= need:
        return []
    return [f"backend.init_timeout_s={cfg.backend.init_timeout_s:g} s is below {TIMEOUT_FACTOR:g} x the projected "
            f"step ({projected['step_s']:.0f} s on {projected['gpu']}, {projected['assumes']}): Megatron's ranks "
            f"wait inside a collective for rank 0 through a whole step, so the job would time out; set "
            f"backend.init_timeout_s={_round_up(need)}"]


def _round_up(seconds: float) -> int:
    """Up to the next 10 minutes."""
    return int(-(-seconds // 600) * 600)
