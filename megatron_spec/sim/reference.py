"""Validation case (a): the reference paper's Qwen3-8B GRPO runs on 32 GB200 (arXiv 2604.26779).

Inputs are what the paper reports for its autoregressive runs -- the five stage times -- plus the acceptance length
of each speculative run and its k. Outputs are the speculative columns. The paper does not state its rollout
batch or response lengths, so the setup below fixes what it does state (model, GPUs, drafter kind) and makes
explicit, shared assumptions for the rest; the one unknown that the AR gen time pins down -- the mean response
length -- is solved for per workload (RL-Think, RL-Zero) from that AR time, then reused unchanged for every k.

Non-gen stages of the speculative run: `data`, `logprob` and `train` are unchanged (the drafter was trained
offline, so `train` has no drafter term); `prepare` refits the drafter too, so it grows by the drafter's share of
the refit bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..drafters.registry import DEFAULT_SIM_DRAFTER
from .acceptance import per_position_from_taus
from .config import GenParallel, LengthDist, SimConfig, Speculation, TrainParallel, Workload
from .generation import GenResult
from .memory import memory_report
from .pipeline import build, generation
from .stages import refit_bytes

# What the paper reports (arXiv 2604.26779, its stage-time and acceptance tables). AR stage times are inputs; the
# speculative figures are only compared with.
PAPER_AR_STAGES = {
    "think": {"data": 0.3, "prepare": 2.1, "gen": 133.6, "logprob": 17.9, "train": 31.4},
    "zero": {"data": 0.2, "prepare": 1.9, "gen": 100.0, "logprob": 17.8, "train": 31.3},
}
PAPER_SPEC_K3 = {"think": {"gen": 87.0, "total": 137.4}, "zero": {"gen": 56.6, "total": 107.5}}
PAPER_TAU = {"think": {3: 2.77, 5: 3.23, 7: 3.48}, "zero": {3: 3.32, 5: 4.35, 7: 5.06}}
PAPER_GEN_SPEEDUP = {"think": {3: 1.53, 5: 0.84, 7: 0.71}, "zero": {3: 1.77, 5: 1.44, 7: 1.21}}

# Facts of vLLM used to test candidate explanations of the paper's k sweep (docs/design/simulator.md, "(a)").
# - The largest CUDA graph vLLM captures by default, in tokens: `VllmConfig._set_cudagraph_sizes` sets
#   min(max_num_seqs * (1 + num_speculative_tokens) * 2, 512), capped by max_num_batched_tokens; a forward over
#   more tokens runs without a graph (vllm/config/vllm.py; docs.vllm.ai/en/latest/design/cuda_graphs/), and so does
#   the EAGLE proposer's first draft pass over the same tokens (vllm/v1/spec_decode/eagle.py).
VLLM_MAX_CUDAGRAPH_TOKENS = 512
# - What running an 8B dense model without CUDA graphs costs per forward: Llama-3-8B decode at batch 1 took
#   9.28 ms without and 7.06 ms with graphs (triton attention; 8.23 vs 7.35 ms with FlashInfer), sglang PR #1401;
#   at large batch the difference is not visible (vllm PR #1440), since kernel launches overlap long kernels.
#   The largest of these differences, per forward that falls out of the graphs:
EAGER_PENALTY_8B_S = 2.2e-3


@dataclass(frozen=True)
class ReferenceSetup:
    """The paper's 8B setup: stated facts, then our assumptions for what it leaves out."""

    model: str = "qwen3-8b"
    """Stated: Qwen3-8B policy."""
    hardware: str = "gb200"
    """Stated: GB200."""
    gpus: int = 32
    """Stated: 32 GPUs, synchronous, colocated (NeMo-RL's default placement)."""
    drafter: str = DEFAULT_SIM_DRAFTER
    """Stated: an EAGLE-3 head (one layer, 32k draft vocabulary as in public heads)."""
    rollouts: int = 4096
    """Assumed: 256 prompts x 16 responses -- the rollout batch the paper states for its simulated runs."""
    prompt_len: int = 200
    """Assumed: DAPO-Math prompts with the chat template, ~200 tokens."""
    max_tokens: int = 16384
    """Assumed: a 16k response cap, DAPO's budget without its overlong buffer."""
    sigma: float = 0.8
    """Assumed: log-normal spread of response lengths (a long tail; 1-5 % of responses reach the cap)."""
    gen_tp: int = 1
    """Assumed: one vLLM engine per GPU (an 8B model fits a GB200 with room for KV)."""
    gpu_memory_utilization: float = 0.6
    """Assumed: NeMo-RL's colocated default for vLLM's share of memory."""

    def config(self, mean_len: float, spec: Speculation | None = None) -> SimConfig:
        workload = Workload(prompts_per_step=self.rollouts // 16, group_size=16, prompt_len=self.prompt_len,
                            response=LengthDist(mean=mean_len, max_tokens=self.max_tokens, sigma=self.sigma))
        return SimConfig(model=self.model, hardware=self.hardware, gpus=self.gpus, workload=workload,
                         train=TrainParallel(dp=self.gpus), gen=GenParallel(tp=self.gen_tp), spec=spec,
                         gpu_memory_utilization=self.gpu_memory_utilization)


def gen_result(setup: ReferenceSetup, mean_len: float, spec: Speculation | None = None) -> tuple[GenResult, float]:
    """One engine's simulated generation in the reference setup, and its KV-cache capacity in tokens."""
    cfg = setup.config(mean_len, spec)
    hw, cal, target, drafter = build(cfg)
    mem = memory_report(cfg, hw, target, drafter)
    return generation(cfg, hw, cal, target, drafter, mem), mem.kv_capacity_tokens


def gen_seconds(setup: ReferenceSetup, mean_len: float, spec: Speculation | None = None) -> float:
    """Simulated gen stage of the reference setup."""
    return gen_result(setup, mean_len, spec)[0].time_s


def infer_mean_length(setup: ReferenceSetup, ar_gen_s: float) -> float:
    """The mean response length at which the simulated autoregressive gen takes `ar_gen_s` (bisection: gen time
    grows with every token generated)."""
    lo, hi = 16.0, 4.0 * setup.max_tokens
    if gen_seconds(setup, hi) < ar_gen_s:
        raise ValueError(f"AR gen time {ar_gen_s} s is longer than the setup can produce even at the length cap")
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        if gen_seconds(setup, mid) < ar_gen_s:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


@dataclass(frozen=True)
class SpecPrediction:
    stages: dict[str, float]
    """Predicted speculative stage times, seconds."""
    mean_len: float
    """Mean response length inferred from the AR gen time (before the cap)."""
    gen_speedup: float
    """AR gen / speculative gen."""
    e2e_speedup: float
    """AR step / speculative step."""

    @property
    def total(self) -> float:
        return sum(self.stages.values())


def drafter_profile(workload: str) -> tuple[float, ...]:
    """Per-position acceptance of the paper's EAGLE-3 drafter on `workload`, as its measured acceptance lengths at
    k = 3 / 5 / 7 imply (`acceptance.per_position_from_taus`): it reproduces each of them and prices every shorter
    draft with the drafter's own decay with depth."""
    return per_position_from_taus(PAPER_TAU[workload])


def predict_spec_run(ar_stages: dict[str, float], tau: float, k: int,
                     setup: ReferenceSetup = ReferenceSetup(), mean_len: float | None = None,
                     per_position: tuple[float, ...] = ()) -> SpecPrediction:
    """Predict the speculative run's stage times from the AR run's and the acceptance length at k (or a drafter's
    per-position acceptance, whose first k positions must give that length)."""
    mean_len = mean_len or infer_mean_length(setup, ar_stages["gen"])
    if per_position:
        spec = Speculation(k=k, per_position=per_position[:k], drafter=setup.drafter)
        if abs(spec.tau(k) - tau) > 1e-6:
            raise ValueError(f"per-position acceptance gives tau {spec.tau(k):.4f} at k={k}, not {tau}")
    else:
        spec = Speculation(k=k, acceptance_length=tau, drafter=setup.drafter)
    cfg = setup.config(mean_len, spec)
    _, _, target, drafter = build(cfg)
    refit_growth = refit_bytes(cfg, target, drafter) / refit_bytes(cfg, target, None)
    gen = gen_seconds(setup, mean_len, spec)
    stages = dict(ar_stages, gen=gen, prepare=ar_stages["prepare"] * refit_growth)
    return SpecPrediction(stages=stages, mean_len=mean_len, gen_speedup=ar_stages["gen"] / gen,
                          e2e_speedup=sum(ar_stages.values()) / sum(stages.values()))


def k_sweep(workload: str, setup: ReferenceSetup = ReferenceSetup()) -> dict[int, float]:
    """Predicted gen speedup at each k of the paper's sweep: one drafter profile (`drafter_profile`), which gives
    the paper's acceptance length at each k."""
    ar = PAPER_AR_STAGES[workload]
    mean_len = infer_mean_length(setup, ar["gen"])
    profile = drafter_profile(workload)
    return {k: predict_spec_run(ar, tau, k, setup, mean_len, profile).gen_speedup
            for k, tau in PAPER_TAU[workload].items()}


@dataclass(frozen=True)
class GraphLimitCheck:
    """How much a verify step that exceeds the CUDA-graph capture limit would have to cost to close the gap between
    the simulated and the paper's speculative gen time at one k (docs/design/simulator.md, "(a)")."""

    k: int
    """Speculative tokens."""
    steps: float
    """Engine steps of the simulated run."""
    steps_over: float
    """Of which steps whose verify forward (sequences x (k+1) tokens) exceeds `VLLM_MAX_CUDAGRAPH_TOKENS`."""
    model_gen_s: float
    """Simulated gen time (no penalty for running without a graph)."""
    paper_gen_s: float
    """The paper's gen time at this k (its AR gen time / its gen speedup)."""
    peak_kv_share: float
    """Largest share of the engine's KV cache the simulated run fills."""

    @property
    def needed_s_per_step_over(self) -> float:
        """Extra seconds each step over the limit would need to cost for the model to match the paper."""
        return (self.paper_gen_s - self.model_gen_s) / self.steps_over if self.steps_over else float("inf")


def graph_limit_check(workload: str, k: int, setup: ReferenceSetup = ReferenceSetup(),
                      capture_tokens: int = VLLM_MAX_CUDAGRAPH_TOKENS, mean_len: float | None = None
                      ) -> GraphLimitCheck:
    """Count the simulated run's steps past the capture limit and the paper's time it leaves unexplained."""
    mean_len = mean_len or infer_mean_length(setup, PAPER_AR_STAGES[workload]["gen"])
    spec = Speculation(k=k, acceptance_length=PAPER_TAU[workload][k], drafter=setup.drafter)
    res, capacity = gen_result(setup, mean_len, spec)
    over = sum(steps for batch, steps, kk in res.batch_steps if batch * (kk + 1) > capture_tokens + 1e-9)
    paper = PAPER_AR_STAGES[workload]["gen"] / PAPER_GEN_SPEEDUP[workload][k]
    return GraphLimitCheck(k=k, steps=res.steps, steps_over=over, model_gen_s=res.time_s, paper_gen_s=paper,
                           peak_kv_share=res.peak_kv_tokens / capacity)
