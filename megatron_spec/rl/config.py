"""Typed configuration of an RL run. Every field has a docstring and is validated before any compute starts.

Nested dataclasses mirror the YAML files in `configs/` and the `key=value` overrides of the recipes
(`spec.num_speculative_tokens=5`, `grpo.group_size=8`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..drafters.config import SpecConfig
from ..drafters.registry import DEFAULT_METHOD
from .backend_config import BackendSection
from .data_config import DataSection


@dataclass
class ModelSection:
    policy: str = "checkpoints/tiny-qwen3"
    """Policy checkpoint directory (HF layout), a hub name (`Qwen/Qwen3-8B`, fetched where the job runs) or
    `smollm2-135m`."""
    drafter: str | None = "checkpoints/tiny-qwen3-mtp"
    """Drafter checkpoint (mtp / eagle3 drafter, or a draft model directory) or its hub name; None for ngram /
    history / no spec."""
    hub_cache: str | None = None
    """Where hub names are downloaded and looked up (huggingface_hub's `cache_dir`; None: its default). On a cluster,
    a directory every node sees."""
    task: str = "tiny"
    """Prompt format: `tiny` (character-level arithmetic) or `natural` (chat prompts for SmolLM2)."""
    terms_weights: tuple[float, ...] = ()
    """Relative chance of each chain length the policy's task holds, shortest first (`Difficulty.terms_weights`:
    for a checkpoint pretrained on 2-8 terms, seven weights); empty: every length alike. Falling weights give the
    rollouts RL's long tail, a few long answers that hold the batch open after the rest have ended."""


@dataclass
class RolloutCorrection:
    """How the loss corrects rollouts that an older policy version generated (`backend.async_lag` > 0): each token's
    surrogate is weighted by the importance ratio pi_old / mu of the trained policy before the update to the
    behaviour policy that sampled it (`grpo.truncated_is_weights`), and rollouts whose ratio leaves a band can be
    rejected from the update (`grpo.rejection_mask`). On-policy rollouts are not touched."""

    level: str = "token"
    """Whose ratio weighs a token: its own (`token`), its sequence's, the product over the sequence's tokens
    (`sequence`: the trajectory's exact ratio, whose variance grows with the length; needs `truncate`), or the
    geometric mean of its sequence's token ratios (`geometric`). Rejection acts at the same level."""
    truncate: float | None = 2.0
    """Upper bound on the importance weight (truncated importance sampling: bounded variance for a small bias),
    at least 1; None: untruncated."""
    reject_low: float | None = None
    """Tokens (at `level=token`) or whole sequences whose ratio is below this leave the update, as if they were not
    in the batch (the loss's means count what is left); None: no lower bound. Needs `grpo.fold_logprob=false`:
    the decision is taken on the old log-probs before the update."""
    reject_high: float | None = None
    """The same above this ratio; None: no upper bound."""

    def __post_init__(self) -> None:
        if self.level not in ("token", "sequence", "geometric"):
            raise ValueError(f"grpo.rollout_correction.level must be one of token, sequence, geometric, "
                             f"got {self.level!r}")
        if self.truncate is not None and self.truncate < 1:
            raise ValueError(f"grpo.rollout_correction.truncate must be >= 1 (or null: untruncated), "
                             f"got {self.truncate}")
        if self.level == "sequence" and self.truncate is None:
            raise ValueError("grpo.rollout_correction.level=sequence needs a truncate (a product of token ratios "
                             "over a long rollout overflows): set grpo.rollout_correction.truncate, e.g. 2")
        if self.reject_low is not None and not 0 < self.reject_low <= 1:
            raise ValueError(f"grpo.rollout_correction.reject_low must be in (0, 1] (or null), got {self.reject_low}")
        if self.reject_high is not None and self.reject_high < 1:
            raise ValueError(f"grpo.rollout_correction.reject_high must be >= 1 (or null), got {self.reject_high}")

    @property
    def rejects(self) -> bool:
        """Whether a band is set."""
        return self.reject_low is not None or self.reject_high is not None


@dataclass
class GRPOSection:
    prompts_per_step: int = 8
    """Distinct prompts per RL step."""
    group_size: int = 8
    """Rollouts per prompt (the GRPO group); advantages are relative within a group, so at least 2."""
    max_tokens: int = 96
    """Longest rollout in tokens."""
    temperature: float = 1.0
    """Rollout sampling temperature (the trainer's behaviour logprobs use the same processing)."""
    top_p: float = 1.0
    """Rollout nucleus mass."""
    top_k: int = 0
    """Rollout top-k (0: off)."""
    lr: float = 1e-5
    """Policy learning rate (AdamW). On the tiny model 1e-4 lowered held-out greedy accuracy from 0.59 to 0.35 in
    10 steps of 8x8 rollouts; 1e-5 held it (0.61 -> 0.59 over 30 steps)."""
    clip_low: float = 0.2
    """PPO clip below 1 (ratio >= 1 - clip_low)."""
    clip_high: float = 0.2
    """PPO clip above 1 (ratio <= 1 + clip_high); larger than clip_low gives DAPO's asymmetric clip."""
    baseline: str = "mean"
    """What a rollout's reward is compared with: `mean` (its group's mean, GRPO) or `leave_one_out` (the mean of the
    group's other rollouts, RLOO; NeMo-RL's default), which scales the advantages by G / (G - 1)."""
    std: str = "population"
    """Divide the advantages by the group's reward std over G (`population`), over G - 1 (`sample`, NeMo-RL's: at
    G = 8 advantages 0.935x the population's) or not at all (`none`, Dr. GRPO)."""
    loss_agg: str = "token"
    """`token`: mean over all generated tokens of the batch; `sequence`: mean per sequence, then over sequences."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) policy; 0 disables and skips the reference."""
    kl_estimator: str = "k3"
    """Per-token KL estimator (`grpo.kl_penalty`): `k3` (GRPO's; value estimates KL(pi || ref), gradient that of
    KL(ref || pi)), `k2` (gradient that of KL(pi || ref)) or `k1` (unbiased value, zero expected gradient)."""
    dual_clip_c: float | None = None
    """Dual-clip PPO: for negative advantages cap each token's loss at -c * A (c > 1, typically 3); None: off."""
    ratio_level: str = "token"
    """Importance ratio per `token` (PPO / GRPO) or per `sequence` (GSPO: exp of the mean per-token log-ratio,
    clipped per sequence; use it with `loss_agg=sequence`, GSPO's objective, and tighter clips such as 3e-4/4e-4)."""
    overlong_buffer: int = 0
    """DAPO's overlong reward shaping: responses longer than `max_tokens - overlong_buffer` lose reward linearly,
    up to `overlong_penalty` at `max_tokens`; 0: off."""
    overlong_penalty: float = 1.0
    """Reward lost by a response of `max_tokens` tokens when `overlong_buffer` > 0."""
    drop_uniform_groups: bool = False
    """DAPO's dynamic sampling, without refilling: groups whose rewards are all equal (zero advantage) are left out of
    the update, so they do not dilute the token mean (logged as `groups_dropped`). A step whose groups are all
    uniform keeps them (zero policy gradient; the drafter still trains). The Megatron trainer, which splits a fixed
    row count over its data-parallel ranks, keeps the left-out rows with nothing of them counted (the same update;
    their forward and backward are still spent)."""
    train_groups: int = 0
    """At most this many groups enter a step's update: the first, in draw order, whose rewards differ (with an
    advantage), every uniform group left out as `drop_uniform_groups` leaves it; 0: no cap. DAPO's dynamic sampling
    fills its training batch so, from more prompts than it trains: with `prompts_per_step` above this, a step draws
    more rollouts than it trains on, as RL post-training's long reasoning rollouts outweigh their update. A step with
    no group carrying an advantage keeps its first `train_groups` groups (zero policy gradient; the drafter still
    trains). With the Megatron trainer as `drop_uniform_groups`."""
    rollout_correction: RolloutCorrection = field(default_factory=RolloutCorrection)
    """Importance weighting and rejection of rollouts from an older policy version."""
    max_trajectory_age: int | None = None
    """Bounded staleness: GRPO groups any of whose rollouts an older policy version than the trained one minus
    this generated are dropped before the update, whole (`groups_dropped_stale`); at least `backend.async_lag`,
    which every step's rollouts reach. Set, groups with a signal that a step leaves out (`train_groups`) wait in a
    replay and are offered to the next steps first while young enough (`rl/replay.py`). None: no bound, no
    replay."""
    max_grad_norm: float = 1.0
    """Gradient clipping of the policy."""
    max_nan_steps: int = 3
    """Stop the run after this many consecutive steps whose loss is NaN (each such update is skipped)."""
    micro_batch_tokens: int = 1024
    """Padded-token budget of one trainer micro-batch (logprob and train forwards); 0: the whole batch at once.
    Rollout lengths are long-tailed, so a batch padded to its longest rollout is largely padding; sorted by length
    and cut into micro-batches each padded only to its own longest, the forwards skip it. Each micro-batch is
    aggregated with the whole batch's denominators and the gradients accumulate into one optimizer step, so the
    update equals the one-big-batch update up to fp32 summation order (except an MoE router's load-balancing loss,
    taken per micro-batch as Megatron does). A row longer than the budget is a micro-batch of its own.
    Measured on the tiny recipe's batches (64 rows, 25-30 % padding; 2 CPU threads), median train step: 0.189 s at
    0, 0.172 at 512, 0.160 at 1024, 0.163 at 2048; smaller budgets pay a fixed cost per micro-batch, larger ones
    padding. Where that fixed cost is larger relative to the compute (a GPU), a larger budget is the better start."""
    fold_logprob: bool = True
    """Take the ratio's "old" log-probs from the train forward itself (detached) instead of a separate forward in the
    `logprob` stage, as TRL does for a single iteration. Exact here: a step makes one optimizer update on its batch,
    so before it the trained policy is the one whose weights were refit into the generator, and a recompute would
    return the very numbers the train forward computes. The `logprob` stage then only assembles the batch and the
    engine-vs-trainer `logprob_mismatch` (from the train forward's log-probs), ~0 s. False: the separate recompute,
    which several updates per batch, or a behaviour policy other than the trained one, would need."""
    share_prompt: bool = True
    """Compute each distinct prompt once per step in the trainer's forwards (logprob and train) instead of once per
    rollout: the prompts run through the trunk first, keeping their keys/values, and each completion attends to its
    prompt's (megatron_spec/rl/prefix.py). Causal attention makes that exact: the update equals the unshared one up
    to fp32 summation order, and online drafter training reads the same states. Gradients reach the shared prompt
    once, summed over its rollouts. Micro-batches are cut as without it (`micro_batch_tokens` on full row lengths).
    Off for MoE models whatever this says: the router's load-balancing loss is a statistic of the tokens a forward
    routes, and counting a prompt once instead of once per rollout would change it. Skipped when no prompt repeats
    in a batch (nothing to save). Measured on the tiny recipe's batch shape (8 prompts x 8 rollouts, ~10-token
    prompts, responses mean ~21 and longest ~86; 2 CPU threads, interleaved, 40 batches): the trunk computes 19 %
    fewer positions (padding included) and the train step takes 0.89 of the unshared time (paired median; medians
    163 vs 186 ms)."""
    routing_replay: bool = False
    """MoE policies: the generator records the experts each token was routed to (per MoE layer, prompt and generated
    tokens, from the policy's own forwards; under speculation the verification forward's rows of the accepted
    tokens) and the trainer's forwards (log-prob and train) route each token to those experts, with its own router
    probabilities of them as the weights. Training then uses the rollout's experts where a near tie in the router
    would otherwise flip between the engine's and the trainer's numerics. Refused for a dense policy and with
    `backend.generator=vllm` (its routed-experts output is not wired here)."""

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"grpo.group_size must be >= 2 (advantages compare rollouts of one prompt), got {self.group_size}")
        if self.prompts_per_step < 1:
            raise ValueError(f"grpo.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.loss_agg not in ("token", "sequence"):
            raise ValueError(f"grpo.loss_agg must be 'token' or 'sequence', got {self.loss_agg!r}")
        for name, allowed in (("baseline", ("mean", "leave_one_out")), ("std", ("population", "sample", "none")),
                              ("kl_estimator", ("k1", "k2", "k3")), ("ratio_level", ("token", "sequence"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"grpo.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ValueError(f"grpo.dual_clip_c must be > 1 (or null: off), got {self.dual_clip_c}")
        if not 0 <= self.overlong_buffer <= self.max_tokens:
            raise ValueError(f"grpo.overlong_buffer must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.overlong_buffer}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("grpo.clip_low and grpo.clip_high must be >= 0")
        if self.train_groups < 0:
            raise ValueError(f"grpo.train_groups must be >= 0 (0: every group), got {self.train_groups}")
        if self.max_trajectory_age is not None and self.max_trajectory_age < 0:
            raise ValueError(f"grpo.max_trajectory_age must be >= 0 (or null: no bound), got {self.max_trajectory_age}")
        if self.rollout_correction.rejects and self.fold_logprob:
            raise ValueError("grpo.rollout_correction.reject_low / reject_high decide from the old log-probs before "
                             "the update, which the folded train forward computes only during it: set "
                             "grpo.fold_logprob=false")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"grpo.micro_batch_tokens must be >= 0 (0: no micro-batching), "
                             f"got {self.micro_batch_tokens}")


@dataclass
class DrafterTrainSection:
    online: bool = True
    """Train the drafter during RL on the policy's own forward (False: frozen drafter, for comparison)."""
    loss_weight: float = 1.0
    """Scale of the drafter's soft cross-entropy (its gradient never reaches the policy)."""
    lr: float = 3e-4
    """Drafter learning rate (AdamW). Where `train-drafter`'s schedule ends (3e-3 decayed to a tenth): a fresh AdamW
    at 1e-3 knocked the tiny recipe's offline-trained MTP head back from acceptance length 3.37 to 3.10 over the
    first 10 steps (frozen: 3.37); at 3e-4, 3.32 (50-step runs, MTP k=3)."""
    drafts: int = 1
    """Drafts per position the online update (and the agreement) covers, each as drafting makes it: an MTP head's
    depths and its last depth chained past them, EAGLE-3's unrolled steps (`train-drafter` trains
    `drafter_loss.TRAINED_DRAFTS` = 3 offline). Each is one more pass of the drafter's layer (and, for MTP, the
    shared head), forward and backward: ~10 % of the trunk's work per draft for one MTP layer on Qwen3-8B, 25 % on
    the tiny model. 1 keeps the update at one pass; the chained drafts share its weights and keep their offline
    training. Tiny recipe, 50 steps, MTP k=3 every step: acceptance length steps 0-9 -> 40-49 was 3.30 -> 3.29 with
    1 and 3.32 -> 3.28 with 3, whose train stage took 0.23 s against 0.18 s. The Megatron trainer unrolls an
    EAGLE-3 head so (each of `num_speculative_tokens` drafts trained: EAGLE-3's training-time test); its MTP layers
    train the first draft only."""
    updates: int = 1
    """Drafter optimizer steps per RL step, each a pass over the batch's detached states (no extra trunk forward).
    More than one lets the drafter keep up where RL changes what the policy writes within a few steps."""
    replay: int = 1
    """RL steps whose detached states each online update pass reads: this step's and the `replay - 1` before it,
    oldest first (`updates` passes in all). The drafter then learns from `replay` times as many problems per step
    at `replay` times the update's work, with no extra trunk forward; the states are held in memory (`replay`
    steps' hidden states and logits) and in checkpoints, for exact resume. Embedded trainer only."""
    minibatches: int = 1
    """Optimizer steps per step's batch in each pass: its sequences dealt into this many minibatches (row i of each
    micro-batch to minibatch i mod `minibatches`). More, smaller steps for the same work; the split is by rows, so it
    does not depend on `grpo.micro_batch_tokens`. Embedded trainer only."""
    extra_groups: int = 0
    """Groups the policy does not train on this step (uniform rewards, or past `grpo.train_groups`) whose rollouts
    the online drafter learns from as well, the first this many of them: their states come from a forward without
    gradient after the policy's update (the policy that drafts next). The trained groups are those whose rewards
    differ; the drafter drafts for every group. Costs that forward and the drafter's work on these rows. Embedded
    trainer only (in one process or in Ray trainer groups)."""
    ema: float = 0.0
    """Draft with an exponential moving average of the online drafter's weights, updated after each of its
    optimizer steps with this decay (0: draft with the trained weights). Averaging lets a higher `lr` track the
    policy while the drafts keep little of its minibatches' noise. Embedded trainer only."""
    agreement: bool = True
    """Measure every step, per draft depth, the chance that the drafter's greedy draft is accepted at the train
    batch's positions (`drafter_agreement`), so its freshness shows while the adaptive controller keeps speculation
    off. Free when online (the drafter's training forward gives it); a frozen drafter runs one extra forward without
    gradient."""
    max_tokens: int = 0
    """The Megatron trainer's online EAGLE-3 head: the most tokens (prompt and completion positions) of a step it
    trains on, as whole rows spread over the batch (`microbatch.spread_rows`); only those rows' fused states and
    logits are kept during the forward and sent to the head's rank, so its memory is bounded by this (or one row,
    if longer), not by the step's batch. Without
    `agreement` the logits kept are the head's draft vocabulary only. 0: every row (the embedded trainer always
    reads every row)."""
    gate: bool = True
    """With `spec.adaptive` and online training on the embedded trainer and generator: let the whole-step gate
    (`spec.adaptive.WholeStepGate`) run a step plainly, without drafting and without this training, wherever
    speculation does not pay for the whole step once this training is counted, and stop a speculative step's
    training once it has taken what the step's generation saved (logged per step: `speculate`, `gate_pays`,
    `drafter_cut`). False: every step speculates under the engine's controller and trains the drafter whole."""

    def __post_init__(self) -> None:
        if self.drafts < 1:
            raise ValueError(f"drafter_train.drafts must be >= 1 (the first draft at least), got {self.drafts}")
        if self.updates < 1:
            raise ValueError(f"drafter_train.updates must be >= 1, got {self.updates}")
        if self.replay < 1:
            raise ValueError(f"drafter_train.replay must be >= 1 (this step's states at least), got {self.replay}")
        if self.minibatches < 1:
            raise ValueError(f"drafter_train.minibatches must be >= 1, got {self.minibatches}")
        if self.extra_groups < 0:
            raise ValueError(f"drafter_train.extra_groups must be >= 0, got {self.extra_groups}")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"drafter_train.ema is a decay in [0, 1) (0: no average), got {self.ema}")
        if self.max_tokens < 0:
            raise ValueError(f"drafter_train.max_tokens must be >= 0 (0: every row), got {self.max_tokens}")


ASYNC_SAVE_WRITERS = ("process", "thread")
"""What may write the Megatron trainer's background shards (`RunSection.async_save_writer`)."""


@dataclass
class RunSection:
    steps: int = 50
    """RL steps to run."""
    seed: int = 0
    """Seed of data order, rollouts and initialisation."""
    out_dir: str = "runs/tiny"
    """Run directory: metrics, TensorBoard events, checkpoints, report."""
    save_every: int = 10
    """Checkpoint every N steps (and at the end); 0: no step cadence (saves at the end, on a signal and by
    `save_every_s` only)."""
    save_every_s: float | None = None
    """Also checkpoint, at the next step boundary, once this many seconds have passed since the last save (or the
    run's start); None: no time cadence. Whichever of the two cadences comes first saves, and each save restarts
    this clock. On a cluster it bounds the work lost to a node failure whatever a step takes."""
    async_save: bool = True
    """Write periodic checkpoints in the background while the next steps run: the state is copied to host memory at
    the step boundary (`save_blocking_s`), written by a thread (`save_background_s`) and given its name only once
    complete, so a save interrupted at any point leaves the previous checkpoint to resume from. One save is in
    flight at a time; the save at the end and on a signal are complete before the run returns. It holds a second
    copy of the trainer's state in host memory while writing; false: every save on the critical path, no copy."""
    signal_before_s: int = 300
    """SLURM jobs: the sbatch templates ask for SIGUSR1 this many seconds before the job's time limit
    (`--signal=B:USR1@N`) and forward it to the loop, which saves at the next step boundary and exits 0 (SIGTERM
    the same); 0: ask for no signal. Long enough for the step in flight plus one save."""
    resume: bool = True
    """Continue from the last checkpoint in out_dir if there is one (its config must match). A run that starts
    from step 0 (false, or no checkpoint yet) moves whatever an earlier run left in out_dir to out_dir/previous/<n>
    first, so its metrics and checkpoints are its own and nothing is lost."""
    dataset_size: int = 4096
    """Training prompts (the data position wraps around)."""
    eval_prompts: int = 64
    """Held-out prompts for greedy accuracy, every `eval_every` steps."""
    eval_every: int = 10
    """Evaluate greedy accuracy every N steps (0: never)."""
    threads: int = 2
    """torch CPU threads."""
    report: bool = True
    """Write `report.html` (plots of reward, accuracy, stage times, acceptance) into out_dir when the run ends."""
    loggers: tuple[str, ...] = ("tensorboard",)
    """Where step metrics go besides metrics.jsonl: any of `tensorboard`, `wandb`, `mlflow` (the last two are the
    `wandb` / `mlflow` extras and follow their own environment: WANDB_MODE, MLFLOW_TRACKING_URI, credentials)."""
    logger_project: str = "megatron-spec"
    """The wandb project and the MLflow experiment the run is logged under (its name: out_dir's last part)."""
    device: str = "cpu"
    """Where the embedded trainer and generator compute (`backend.placement=inline`): `cpu`, `cuda` or `cuda:N`. The
    policy, drafter, reference, optimizer state, KV caches and every tensor the engine, verifier, sampler and
    trainer make live there; batches cross the Policy interface on the host. The rollouts' random streams stay per
    sequence on the host, so a seed draws the same uniforms on any device. Not part of a checkpoint's identity: a
    run saved on one device resumes on another (a valid continuation, equal to the uninterrupted run up to the
    devices' floating-point differences). The spelling is checked here; that torch sees the GPU is checked when a
    run starts (`torch_device`), so a launcher on a GPU-less login node can still submit a CUDA job. The at-scale
    backends place their own work (Megatron: one GPU per rank; vLLM: its engine's devices) and ignore it."""
    async_save_writer: str = "process"
    """What writes the Megatron trainer's background shards (`async_save`): `process` (a spawned process per rank,
    the copy handed over in shared memory, so the writer never takes the step's GIL; `benchmarks/async_save.py`
    times both) or `thread` (a thread of each rank's process). The process needs /dev/shm room for a rank's whole
    state, which containers often cap: a save that does not fit is written by a thread, with a line saying so. The
    embedded trainer's state is always written by a thread."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"run.steps must be >= 1 (a run of no steps trains nothing), got {self.steps}")
        if self.save_every < 0:
            raise ValueError(f"run.save_every must be >= 0 (0: no step cadence, a save at the end and on a signal), "
                             f"got {self.save_every}")
        if self.save_every_s is not None and not self.save_every_s > 0:
            raise ValueError(f"run.save_every_s must be > 0 seconds (or null: no time cadence), got {self.save_every_s}")
        if self.signal_before_s < 0:
            raise ValueError(f"run.signal_before_s must be >= 0 (0: no signal before the time limit), "
                             f"got {self.signal_before_s}")
        if self.eval_every < 0:
            raise ValueError(f"run.eval_every must be >= 0 (0: never), got {self.eval_every}")
        unknown = [name for name in self.loggers if name not in ("tensorboard", "wandb", "mlflow")]
        if unknown:
            raise ValueError(f"run.loggers: unknown {unknown}; use any of tensorboard, wandb, mlflow")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"run.device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.async_save_writer not in ASYNC_SAVE_WRITERS:
            raise ValueError(f"run.async_save_writer must be {' or '.join(ASYNC_SAVE_WRITERS)}, "
                             f"got {self.async_save_writer!r}")

    def torch_device(self):
        """`device` as a torch.device, or a ValueError when torch cannot reach it (before any model is loaded)."""
        import torch  # here, not at the top: torch-free tools (the simulator's tuner, launchers) read this config

        device = torch.device(self.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"run.device={self.device} but torch sees no CUDA device (torch {torch.__version__});"
                                 f" use run.device=cpu, or a CUDA build of torch on a GPU machine")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ValueError(f"run.device={self.device} but torch sees {torch.cuda.device_count()} CUDA device(s)")
        return device


@dataclass
class RLConfig:
    model: ModelSection = field(default_factory=ModelSection)
    """Which policy, drafter and prompt format."""
    data: DataSection = field(default_factory=DataSection)
    """The prompts from a dataset and their reward function (default: the built-in task of `model.task`)."""
    grpo: GRPOSection = field(default_factory=GRPOSection)
    """The algorithm."""
    spec: SpecConfig | None = field(default_factory=lambda: SpecConfig(DEFAULT_METHOD, 3, adaptive=True))
    """Speculative rollouts (vLLM's speculative_config fields); None means plain decoding."""
    drafter_train: DrafterTrainSection = field(default_factory=DrafterTrainSection)
    """Online drafter training."""
    run: RunSection = field(default_factory=RunSection)
    """Steps, seeds, output."""
    backend: BackendSection = field(default_factory=BackendSection)
    """Which trainer and generator the loop drives, and where they run (default: both embedded, in-process)."""
