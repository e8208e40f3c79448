"""Inputs of the simulator: workload, speculation, parallel layouts and the cluster, as validated dataclasses.

Every check that can run before any arithmetic runs here, in `__post_init__`, and names the constraint it
enforces (a layout that does not divide the model, an acceptance length above k+1, an async run on colocated
GPUs). The memory-fit check needs the hardware and lives in `memory.py`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

from dataclasses import replace

from megatron_spec.drafters.registry import DEFAULT_SIM_DRAFTER, sim_drafter
from megatron_spec.layout import Layout, suggest_split
from megatron_spec.models.config import ModelConfig
from megatron_spec.models.presets import PRESETS, preset

from .acceptance import check_tau, rate_from_tau, tau_from_positions, tau_from_rate
from .hardware import CPU_PROFILES, GPU_PROFILES, Hardware


def resolve_model(model: str | dict | ModelConfig) -> ModelConfig:
    """A preset name, a path to an HF `config.json`, an HF dict or a `ModelConfig`."""
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, dict):
        return ModelConfig.from_hf(model)
    if model in PRESETS:
        return preset(model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelConfig.from_hf(json.loads(path.read_text()))
    raise ValueError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor an HF config.json path")


@dataclass
class LengthDist:
    mean: float
    """Mean response length in tokens before the cap (log-normal body)."""
    max_tokens: int
    """Cap on new tokens: longer responses are truncated onto it, which is what makes RL's long tail."""
    sigma: float = 0.8
    """Log-normal shape of the body; larger means a longer tail (0.8 puts ~4 % of responses above 3x the mean)."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"LengthDist.max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 < self.mean <= self.max_tokens * 4:
            raise ValueError(f"LengthDist.mean must be in (0, 4 * max_tokens], got {self.mean}")
        if not 0 <= self.sigma <= 3:
            raise ValueError(f"LengthDist.sigma must be in [0, 3], got {self.sigma}")

    def quantiles(self, n: int = 64) -> list[float]:
        """`n` equally likely response lengths (mid-quantiles), deterministic, ascending."""
        mu = math.log(self.mean) - self.sigma ** 2 / 2
        normal = NormalDist()
        return [min(math.exp(mu + self.sigma * normal.inv_cdf((i + 0.5) / n)), self.max_tokens) for i in range(n)]

    @property
    def expected(self) -> float:
        """Mean length after truncation."""
        q = self.quantiles()
        return sum(q) / len(q)

    @classmethod
    def fit(cls, mean: float, longest: float, n: int, max_tokens: int) -> "LengthDist":
        """The distribution whose `n` quantiles (`quantiles(n)`, what the simulator gives a batch of `n` rollouts)
        have mean `mean` and longest `longest`: what a step's mean and longest response length (each averaged over
        steps) pin down when the per-rollout lengths are not kept.

        Below the cap every quantile is the body's mean times a factor of sigma alone, so the longest-to-mean ratio
        of the quantiles fixes sigma (it grows with sigma: solved by bisection) and then `mean` fixes the body's
        mean; both are matched exactly. The largest of `n` mid-quantiles sits at the normal's (n - 1/2) / n quantile,
        within 1 % of the expected largest of `n` normal draws from n = 16 up, so it stands for a measured maximum.
        A longest response at the cap is censored: the fit then takes the cap as the longest, i.e. the smallest
        sigma whose longest quantile reaches it (a lower bound on the tail), and the quantiles' mean falls a little
        below `mean` (their capped share is shorter than the body would be)."""
        if n < 1:
            raise ValueError(f"LengthDist.fit needs n >= 1 rollouts, got {n}")
        if mean <= 0:
            raise ValueError(f"LengthDist.fit needs a positive mean length, got {mean}")
        normal = NormalDist()
        zs = [normal.inv_cdf((i + 0.5) / n) for i in range(n)]
        target = math.log(min(longest, max_tokens) / mean) if longest > mean else 0.0

        def log_ratio(sigma: float) -> float:  # log(longest quantile / mean of the quantiles), uncapped
            return -math.log(sum(math.exp(sigma * (z - zs[-1])) for z in zs) / n)

        lo, hi = 0.0, 3.0
        if log_ratio(hi) <= target:
            lo = hi
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if log_ratio(mid) < target else (lo, mid)
        sigma = lo
        # The quantiles are exp(mu + sigma z): pick the body's mean so that their (uncapped) mean is `mean`.
        scale = sum(math.exp(sigma * z - sigma ** 2 / 2) for z in zs) / n
        return cls(mean=min(mean / scale, 4 * max_tokens), max_tokens=max_tokens, sigma=sigma)


@dataclass
class Workload:
    prompts_per_step: int
    """Prompts drawn per RL step."""
    group_size: int
    """Responses sampled per prompt (GRPO group)."""
    prompt_len: int
    """Prompt tokens (mean)."""
    response: LengthDist
    """Response-length distribution with its long tail."""

    def __post_init__(self) -> None:
        if isinstance(self.response, dict):
            self.response = LengthDist(**self.response)
        for name in ("prompts_per_step", "group_size", "prompt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"Workload.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def rollouts(self) -> int:
        """Sequences generated per step."""
        return self.prompts_per_step * self.group_size

    @property
    def tokens_per_rollout(self) -> float:
        """Prompt plus expected response tokens: what training processes per sequence."""
        return self.prompt_len + self.response.expected


@dataclass
class Speculation:
    k: int = 3
    """Draft tokens proposed per verify pass."""
    acceptance_length: float = 0.0
    """Mean tokens emitted per verify pass at this k, bonus token included (tau, in [1, k+1]); 0 means use
    `per_position`."""
    per_position: tuple[float, ...] = ()
    """Conditional acceptance probability of each draft position (k values); used when acceptance_length is 0."""
    drafter: str = DEFAULT_SIM_DRAFTER
    """Drafter: its simulator name in the drafter registry (`registry.sim_names()`: a method's name, `model` for a
    draft-model preset); lookup drafters cost no accelerator time."""
    draft_model: str = ""
    """Preset of the draft model when drafter == 'model'."""
    drafter_layers: int = 1
    """Decoder layers of an eagle3 head, or MTP modules."""
    draft_vocab: int = 0
    """Rows of an eagle3 head's LM head; 0 means 32000 (public heads) or the target's, whichever is smaller."""
    adaptive: bool = False
    """Let a controller change k during generation (the shrinking batch changes what speculation is worth)."""
    adaptive_threshold: int = 0
    """With adaptive on: sequences in flight per engine above which speculation is switched off; 0 lets the
    controller pick, at each point of the run, the k' <= k the cost model says emits tokens fastest."""
    online_drafter_training: bool = False
    """Train the drafter every step (adds its forward, backward and optimizer steps to `train`)."""
    drafter_passes: float = 1.0
    """Online training: forward + backward passes of the drafter over one step's tokens per RL step, each at the
    drafter's own size (the embedded trainer: drafts x replay x updates; an MTP head trained in the policy's
    backward: its depths)."""
    drafter_optimizer_steps: int = 1
    """Online training: the drafter's AdamW steps per RL step (the embedded trainer: updates x replay x
    minibatches)."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"Speculation.k must be >= 1 (k=0 is plain decoding: pass spec=None), got {self.k}")
        sim_drafter(self.drafter)  # an unknown name raises, listing the known ones
        self.per_position = tuple(float(a) for a in self.per_position)
        if self.acceptance_length:
            if self.per_position:
                raise ValueError("give either Speculation.acceptance_length or per_position, not both")
            check_tau(self.acceptance_length, self.k)
        elif self.per_position:
            if len(self.per_position) != self.k:
                raise ValueError(f"per_position needs k={self.k} values, got {len(self.per_position)}")
            if not all(0.0 <= a <= 1.0 for a in self.per_position):
                raise ValueError(f"per_position acceptance values must be in [0, 1], got {self.per_position}")
        else:
            raise ValueError("Speculation needs acceptance_length (tau) or per_position acceptance probabilities")
        if self.adaptive_threshold < 0:
            raise ValueError(f"adaptive_threshold must be >= 0, got {self.adaptive_threshold}")
        if self.drafter_passes <= 0:
            raise ValueError(f"Speculation.drafter_passes must be > 0, got {self.drafter_passes}")
        if self.drafter_optimizer_steps < 1:
            raise ValueError(f"Speculation.drafter_optimizer_steps must be >= 1, got {self.drafter_optimizer_steps}")

    @property
    def rate(self) -> float:
        """Constant per-token acceptance equivalent to the given acceptance length (geometric model)."""
        return rate_from_tau(self.tau(self.k), self.k)

    def tau(self, k: int) -> float:
        """Acceptance length when speculating `k` <= self.k tokens (positions beyond k are never drafted)."""
        if not 0 <= k <= self.k:
            raise ValueError(f"k={k} is outside 0..{self.k}")
        if self.per_position:
            return tau_from_positions(self.per_position, k)
        if k == self.k:
            return self.acceptance_length
        return tau_from_rate(rate_from_tau(self.acceptance_length, self.k), k)


def TrainParallel(tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, dp: int = 1, vpp: int = 1) -> Layout:
    """The simulator's trainer layout, a `Layout`: experts carved out of dp x cp x tp (expert tensor parallel 1),
    `dp` replicas and `vpp` virtual pipeline stages (interleaved 1F1B divides the pipeline's fill and drain by
    vpp; `bubble.bubble_factor`). Its fit to the model is checked by `SimConfig` (`Layout.problems`)."""
    try:
        return Layout(tp=tp, pp=pp, ep=ep, etp=1, cp=cp, dp=dp, vp=vpp)
    except ValueError as err:  # Layout's names, in the simulator's
        raise ValueError(f"TrainParallel.{err}".replace("virtual_pipeline", "vpp")) from None


def GenParallel(tp: int = 1, ep: int = 1) -> Layout:
    """One generation engine's split, a `Layout`: `tp` GPUs, of which `ep` hold the experts (expert tensor
    parallel 1). Checked with vLLM's rules by `SimConfig` (`layout.engine_problems`)."""
    return Layout(tp=tp, ep=ep, etp=1)


RECOMPUTE = ("none", "selective", "full")
GPU_MICRO_BATCH_TOKENS = 16384
"""Default micro-batch of a GPU trainer: tokens packed per micro-batch per data-parallel rank."""


@dataclass
class SimConfig:
    model: str | dict | ModelConfig
    """Policy architecture: preset name, HF config.json path or dict, or a ModelConfig."""
    hardware: str | Hardware
    """GPU profile name (h100, h200, b200, gb200), or a `Hardware` built elsewhere (a what-if copy, or the CPU
    validation harness's measured profile in `research/sim_cpu`)."""
    gpus: int
    """Devices in the job."""
    workload: Workload
    """Prompts, group size, lengths."""
    train: Layout = field(default_factory=TrainParallel)
    """Trainer layout (`TrainParallel`); its gpus must equal the training share."""
    gen: Layout = field(default_factory=GenParallel)
    """Layout of one generation engine (`GenParallel`); engines = generation GPUs / gen.tp."""
    colocated: bool = True
    """Generation and training time-share all GPUs (engines sleep during training)."""
    gen_gpus: int = 0
    """Disaggregated only: GPUs given to generation; the rest train."""
    spec: Speculation | None = None
    """Speculative decoding; None is plain autoregressive decoding."""
    policy_lag: int = 0
    """0 = synchronous; L >= 1 = generation of step t+L overlaps training of step t (needs disaggregation)."""
    gen_dtype_bytes: int = 2
    """Bytes per weight in the engines (2 = BF16, 1 = FP8 rollouts)."""
    gpu_memory_utilization: float = 0.85
    """Fraction of device memory an engine may use for weights, KV cache and workspace."""
    max_num_seqs: int = 1024
    """Most sequences one engine runs at once (vLLM's max_num_seqs)."""
    micro_batch_tokens: int | None = None
    """Token budget of one training micro-batch per data-parallel rank; 0: the whole batch at once. A GPU trainer
    (Megatron) packs sequences up to it, which sets the pipeline bubble and the activation memory. (The CPU harness,
    `research/sim_cpu`, reads it as the embedded trainer's `grpo.micro_batch_tokens` padded budget.) None: 16384."""
    fold_logprob: bool | None = None
    """The behaviour log-probs come from the train forward itself (`grpo.fold_logprob`: exact with one update per
    step), so the `logprob` stage runs no forward and costs 0. False: a separate recompute forward, the norm of
    Megatron-based RL frameworks and what several updates per batch need. None: False."""
    share_prompt: bool | None = None
    """Each distinct prompt runs through the trainer's forwards once per step instead of once per rollout
    (`grpo.share_prompt`): a prefix pass over the prompts, then the completions attending to their prompt's keys
    and values (`rl/prefix.py`). Only the CPU harness's model of the embedded trainer describes it; a GPU trainer
    packs whole sequences, so with a GPU profile name it must stay off. None: False."""
    reference_logprob: bool = False
    """A second forward per step for the frozen reference policy (the KL penalty's log-probs), as NeMo-RL runs
    whenever `reference_policy_kl_penalty` is non-zero. The reference weights wait in host memory and are swapped
    in and out around that pass, which costs their bytes twice over the host link."""
    recompute: str = "selective"
    """Activation recomputation of the trainer: 'none' (every activation kept: backward = 2 forwards), 'selective'
    (Megatron's default: the attention core is recomputed), 'full' (each layer's forward runs again in backward:
    4 forwards per update, only layer inputs kept)."""
    train_global_batch: int = 0
    """Sequences per optimizer step; 0: all the step's rollouts in one update. Smaller (NeMo-RL: 512 of 2048)
    means rollouts / train_global_batch optimizer steps per RL step, each with its own pipeline fill and drain
    and its own gradient reduce-scatter and all-gather."""
    offload: bool | None = None
    """Colocated only: each step the trainer's weights, gradients and optimizer states go to host memory before
    generation and come back after, and the engine's weights do the reverse (vLLM sleep level 1), at the host
    link's bandwidth (`Hardware.host_bw`) times `Calibration.offload_eff`. None: on when colocated."""
    train_fp8: bool = False
    """FP8 training (Transformer Engine): the train and logprob passes gain `Calibration.fp8_train_gain` of the
    device's extra FP8 throughput (1.3x by default, well under the spec sheet's 2x)."""
    in_flight_updates: bool = False
    """Asynchronous only: the engines keep generating through each refit (NeMo-RL's `in_flight_weight_updates`),
    so the next step's prompts take the slots the current step's finished sequences free and the batch never
    drains; the gen side is simulated over lag + 1 steps' rollouts in one stream. False: each step's generation
    starts when the refit lands (lag 1 drains every step; lag L >= 2 streams L steps)."""
    moe_dispatcher: str = "alltoall"
    """How the trainer's MoE layers move tokens to their experts' ranks (`backend.megatron.moe_token_dispatcher`):
    `alltoall` sends each token to the EP ranks of its top-k experts ((ep - 1) / ep x top_k copies), `allgather`
    gives every EP rank every token (ep - 1 copies), so it moves ep / top_k times the bytes."""
    decode_eff: float | None = None
    """Share of the kernel roofline the serving engine reaches in decode, prefill and verify (scheduling gaps,
    unfused small kernels, MoE routing imbalance); None: the calibration's value for the GPU."""

    def __post_init__(self) -> None:
        if isinstance(self.workload, dict):
            self.workload = Workload(**self.workload)
        self.model_config = resolve_model(self.model)
        named = not isinstance(self.hardware, Hardware)
        if named and str(self.hardware).lower() not in {**GPU_PROFILES, **CPU_PROFILES}:
            raise ValueError(f"unknown hardware {self.hardware!r}: known are {', '.join(GPU_PROFILES)} and cpu (the "
                             "operator-level CPU model of the embedded engine is the validation harness in "
                             "research/sim_cpu)")
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        if self.gen_dtype_bytes not in (1, 2, 4):
            raise ValueError(f"gen_dtype_bytes must be 1 (FP8), 2 (BF16) or 4 (FP32), got {self.gen_dtype_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.micro_batch_tokens is None:
            self.micro_batch_tokens = GPU_MICRO_BATCH_TOKENS
        if self.fold_logprob is None:
            self.fold_logprob = False
        if self.share_prompt is None:
            self.share_prompt = False
        if self.share_prompt and named:
            raise ValueError("share_prompt describes the embedded trainer (modelled by research/sim_cpu); a GPU "
                             "trainer packs whole sequences, so set share_prompt=False (or leave it None) there")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"micro_batch_tokens must be >= 0 (0: the whole batch in one micro-batch), "
                             f"got {self.micro_batch_tokens}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.moe_dispatcher not in ("alltoall", "allgather"):
            raise ValueError(f"moe_dispatcher must be alltoall or allgather, got {self.moe_dispatcher!r}")
        if self.train_global_batch < 0:
            raise ValueError(f"train_global_batch must be >= 0 (0: one update per step), got {self.train_global_batch}")
        if self.train_global_batch and self.workload.rollouts % self.train_global_batch:
            raise ValueError(f"train_global_batch={self.train_global_batch} must divide the step's "
                             f"{self.workload.rollouts} rollouts (each optimizer step takes an equal share)")
        if self.decode_eff is not None and not 0 < self.decode_eff <= 1:
            raise ValueError(f"decode_eff must be in (0, 1], got {self.decode_eff}")
        if self.policy_lag < 0:
            raise ValueError(f"policy_lag must be >= 0, got {self.policy_lag}")
        if self.colocated:
            if self.policy_lag:
                raise ValueError("policy_lag > 0 needs a disaggregated placement (colocated=False, gen_gpus=...): "
                                 "colocated generation and training take turns on the same GPUs")
            if self.gen_gpus not in (0, self.gpus):
                raise ValueError("gen_gpus is only for disaggregated placements (colocated=False)")
            self.gen_gpus = self.gpus
        elif not 0 < self.gen_gpus < self.gpus:
            raise ValueError(f"disaggregated placement needs 0 < gen_gpus < gpus={self.gpus}, got {self.gen_gpus}")
        if self.in_flight_updates and not self.policy_lag:
            raise ValueError("in_flight_updates needs an asynchronous run (policy_lag >= 1)")
        if self.offload and not self.colocated:
            raise ValueError("offload describes colocated placements (trainer and engine swap the GPUs' memory); "
                             "a disaggregated run keeps both resident")
        if self.gen_gpus % self.gen.tp:
            raise ValueError(f"generation GPUs ({self.gen_gpus}) are not a multiple of gen tp={self.gen.tp}")
        if self.train.gpus != self.train_gpus:
            raise ValueError(f"train layout tp*pp*cp*dp = {self.train.gpus} GPUs, but the placement gives training "
                             f"{self.train_gpus}")
        # Interleaving is priced as a divisor of the pipeline bubble, with no layers placed into chunks: the
        # split is checked as one run of layers per stage.
        if problems := replace(self.layout, vp=1).problems(self.model_config, self.train_gpus, who="train"):
            raise ValueError(f"cannot split {self.model_config.model_type} with {self.model_config.num_hidden_layers} "
                             f"layers as {self.layout.describe()}: " + "; ".join(problems))

    @property
    def layout(self) -> Layout:
        """The whole job's layout: the trainer's split with Megatron-Core's uneven first / last stages where pp does
        not divide the layers (`layout.suggest_split`; the slowest stage sets the pace, `stages.stage_imbalance`),
        and the engines. Checked against Megatron-Core's and vLLM's rules, not against what this project's trainer
        runs: the simulator may predict a layout the trainer refuses (context parallelism)."""
        m, t = self.model_config, self.train
        first, last = suggest_split(m.num_hidden_layers, t.pp) if t.pp <= m.num_hidden_layers else (None, None)
        return replace(t, first_stage_layers=first, last_stage_layers=last, engine=self.gen, engines=self.engines,
                       colocated=self.colocated)

    @property
    def packed_micro_batches(self) -> int:
        """Micro-batches one data-parallel rank of a packing (GPU) trainer runs per optimizer step (1 with
        budget 0)."""
        tokens = self.workload.rollouts * self.workload.tokens_per_rollout / self.train.dp / self.optimizer_steps
        return max(1, math.ceil(tokens / self.micro_batch_tokens)) if self.micro_batch_tokens else 1

    @property
    def steps_in_flight(self) -> int:
        """Steps' worth of rollouts one engine streams in the simulation of the gen side."""
        return self.policy_lag + 1 if self.in_flight_updates else max(self.policy_lag, 1)

    @property
    def offloads(self) -> bool:
        """Whether trainer states and engine weights cross the host link each step (`offload`, None: colocated)."""
        return self.colocated if self.offload is None else self.offload

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per RL step."""
        return self.workload.rollouts // self.train_global_batch if self.train_global_batch else 1

    @property
    def train_gpus(self) -> int:
        return self.gpus if self.colocated else self.gpus - self.gen_gpus

    @property
    def engines(self) -> int:
        return self.gen_gpus // self.gen.tp
