"""Count the operators our eager engine and trainer launch: what `counts.py` derives the CPU model's counts from.

On the CPU a tiny model's step is dominated by what every operator costs to launch (Python, the dispatcher,
allocation), so the simulator needs to know how many operators a forward, a verify step, a draft step, a training
pass and an optimizer step launch; this module measures them on the real code (`LLMEngine`, the proposers,
`EmbeddedPolicy`) by counting every ATen operator that reaches the dispatcher (`TorchDispatchMode`), views and
in-place updates included, backward included. Models are built with random weights from a `ModelConfig`, so any
shape can be counted without a checkpoint. Counting never times anything: the counts are deterministic for a given
torch build and our code.

Like `cpu_profile.measure`, everything here imports torch inside the functions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_spec.models.config import ModelConfig

PROMPT = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13]  # any ten in-vocabulary ids: counts do not depend on the values


def count_ops(fn) -> int:
    """ATen operators dispatched while `fn()` runs (forward, backward and optimizer alike)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.n += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.n


def with_layers(cfg: ModelConfig, layers: int) -> ModelConfig:
    """The same architecture with another depth (differences between depths give the per-layer counts)."""
    return dataclasses.replace(cfg, num_hidden_layers=layers)


@dataclass(frozen=True)
class StepCensus:
    step: int
    """Operators of one whole engine step (decode or verify, drafting included)."""
    forward: int
    """Of which the target forward (embedding to logits, through the KV cache)."""
    propose: int
    """Of which the proposer (all k draft forwards and the draft choice); 0 without speculation."""

    @property
    def sample(self) -> int:
        """What is left: sampling, verification, acceptance and bookkeeping after the target forward."""
        return self.step - self.forward - self.propose


def make_drafter(cfg: ModelConfig, method: str | None):
    """A random-weight drafter for a target of `cfg`: an MTP module, an EAGLE-3 head, the `tiny-draft` preset with
    `cfg`'s vocabulary for draft_model; None for lookup drafters and plain decoding."""
    from megatron_spec.drafters.mtp.model import MTP
    from megatron_spec.models import CausalLM, preset
    from megatron_spec.drafters.eagle3.model import Eagle3Config, Eagle3Head

    if method == "mtp":
        return MTP(cfg)
    if method == "eagle3":
        return Eagle3Head(cfg, Eagle3Config(target_num_layers=cfg.num_hidden_layers))
    if method == "draft_model":
        return CausalLM(dataclasses.replace(preset("tiny-draft"), vocab_size=cfg.vocab_size))
    return None


def build_engine(cfg: ModelConfig, method: str | None, k: int = 3, max_num_seqs: int = 256):
    """An `LLMEngine` over a random-weight model of `cfg`, speculating with `method` (mtp, eagle3, draft_model,
    ngram) or plain; the draft model for draft_model is the `tiny-draft` preset with `cfg`'s vocabulary."""
    import torch

    from megatron_spec.engine import LLMEngine
    from megatron_spec.models import CausalLM
    from megatron_spec.drafters.config import SpecConfig

    torch.manual_seed(0)
    model = CausalLM(cfg)
    drafter = make_drafter(cfg, method)
    spec = SpecConfig(method, k) if method else None
    return LLMEngine(model, max_num_seqs=max_num_seqs, spec=spec, drafter=drafter)


def engine_step(cfg: ModelConfig, batch: int, method: str | None = None, k: int = 3, warm_steps: int = 3,
                engine=None) -> StepCensus:
    """Count one steady-state engine step of `batch` sequences (after the prefill and `warm_steps` steps), with
    sampling at temperature 1 as RL rollouts use.

    Counted with torch's ops in place of the fused CPU kernels (`megatron_spec.kernels`): every measurement and
    CPU profile this harness is validated on was taken before the kernels existed, and the harness prices an
    operator as a fixed launch cost plus the bytes the roofline sees, which a kernel doing a layer's attention in
    one call is not. Predicting the engine with its kernels needs a new profile and new measurements."""
    import torch

    from megatron_spec import kernels
    from megatron_spec.engine import SamplingParams

    eng = engine or build_engine(cfg, method, k, max_num_seqs=max(batch, 1))
    with torch.inference_mode(), kernels.disabled():
        eng.start([list(PROMPT) for _ in range(batch)], SamplingParams(max_tokens=200, ignore_eos=True, seed=0))
        for _ in range(1 + warm_steps):
            eng.step()
        counts = {"forward": 0, "propose": 0}

        def counted(name: str, fn):
            def wrapper(*args, **kwargs):
                result = []
                counts[name] += count_ops(lambda: result.append(fn(*args, **kwargs)))
                return result[0]
            return wrapper

        verify, propose = eng.runner.verify, eng.proposer.propose
        eng.runner.verify = counted("forward", verify)
        eng.proposer.propose = counted("propose", propose)
        try:
            total = count_ops(eng.step)
        finally:
            eng.runner.verify, eng.proposer.propose = verify, propose
    return StepCensus(step=total, forward=counts["forward"], propose=counts["propose"])


@dataclass(frozen=True)
class TrainCensus:
    logprob: int
    """Operators of the policy's `logprobs` (the recompute forward, no autograd), logits to token log-probs."""
    train: int
    """Operators of one `train_step`: forward with autograd, loss, backward, clipping and the AdamW step."""
    optimizer: int
    """Of which the optimizer step alone."""
    param_tensors: int
    """Parameter tensors the optimizer updates."""
    micro_batches: int
    """Micro-batches both passes ran over."""


def trainer_pass(cfg: ModelConfig, batch: int = 4, tokens: int = 16, budget: int = 0,
                 fold: bool = False, shared: bool = False, drafter: str | None = None,
                 ends: list[int] | None = None) -> TrainCensus:
    """Count the embedded trainer's `logprobs` and `train_step` on a random batch of `batch` x `tokens` ids whose
    odd rows end 4 tokens early, cut into micro-batches with the padded-token budget `budget` (0: one micro-batch;
    `2 * tokens` gives two of two rows each, the second cropped), the behaviour log-probs recomputed or, with
    `fold`, taken from the train forward. With `shared`, rows come in pairs that hold the same prompt (the first
    half of the row), which the trainer computes once (`grpo.share_prompt`: a prefix pass, then suffix passes);
    without it every prompt differs, so nothing is shared. `drafter` (mtp, eagle3, draft_model) trains online in
    the step, on the micro-batches' detached states. The counts depend on the architecture and the number of
    micro-batches (and on how many are cropped or hold a single row), not on the sizes. `ends` sets each row's
    used length instead (from half the row up to `tokens`)."""
    import torch

    from megatron_spec.models import CausalLM
    from megatron_spec.rl.config import DrafterTrainSection, GRPOSection
    from megatron_spec.interfaces import Batch
    from megatron_spec.trainers.embedded import EmbeddedPolicy

    torch.manual_seed(0)
    model = CausalLM(cfg)
    grpo = GRPOSection(micro_batch_tokens=budget, fold_logprob=fold, share_prompt=shared)
    policy = EmbeddedPolicy(model, grpo, dict(temperature=1.0, top_k=0, top_p=1.0), drafter=make_drafter(cfg, drafter),
                            drafter_method=drafter, drafter_cfg=DrafterTrainSection() if drafter else None)
    ids = torch.randint(3, cfg.vocab_size, (batch, tokens))
    if shared:
        ids[1::2, : tokens // 2] = ids[0::2, : tokens // 2]
    mask = torch.zeros(batch, tokens, dtype=torch.bool)
    mask[:, tokens // 2:] = True
    mask[1::2, tokens - 4:] = False
    if ends is not None:
        for row, end in enumerate(ends):
            mask[row, tokens // 2:] = True
            mask[row, end:] = False
    data = Batch(ids, mask, advantages=torch.randn(batch))
    old = policy.logprobs(data)
    logprob = count_ops(lambda: policy.logprobs(data))

    def step():
        data.old_logprobs = None if fold else old  # folded: train_step fills them in, so reset before each step
        policy.train_step(data)

    step()  # the first step creates the optimizer states; count a steady-state one
    train = count_ops(step)
    optimizer = count_ops(policy.opt.step)
    return TrainCensus(logprob=logprob, train=train, optimizer=optimizer,
                       param_tensors=sum(1 for _ in model.parameters()), micro_batches=len(policy.split(data)))


def batch_assembly(rows: int, prompt: int = 10) -> int:
    """Operators of the logprob stage's own work on `rows` rollouts of distinct lengths (`loop.make_batch` and the
    `logprob_mismatch` metric), what is left of the stage when the recompute is folded into the train forward."""
    from megatron_spec.engine import Completion
    from megatron_spec.rl.loop import logprob_mismatch, make_batch

    prompts = [list(PROMPT[:prompt]) for _ in range(rows)]
    outs = [Completion(token_ids=[5] * (i + 1), logprobs=[-1.0] * (i + 1), finish_reason="stop")
            for i in range(rows)]

    def stage():
        batch, behaviour = make_batch(prompts, outs)
        logprob_mismatch(behaviour, behaviour, batch.mask[:, 1:])

    return count_ops(stage)


# Products, fused attention and pure views move no activation bytes of their own (products are costed by FLOPs,
# attention per score); every other operator's tensors are read or written once.
NOT_ELEMENTWISE = ("mm", "addmm", "bmm", "embedding", "_scaled_dot_product_flash_attention_for_cpu", "detach",
                   "t", "transpose", "view", "_unsafe_view", "expand", "slice", "select", "as_strided",
                   "_local_scalar_dense", "lift_fresh", "unsqueeze", "squeeze", "permute", "alias")


def activation_elements(cfg: ModelConfig, batch: int = 4, tokens: int = 16) -> float:
    """Floats elementwise operators read plus write per token per decoder layer in the trainer's forward: the
    difference between a 2-layer and a 1-layer model of `cfg`, over the batch's tokens."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from megatron_spec.models import CausalLM

    class Elements(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ not in NOT_ELEMENTWISE:
                Elements.n += sum(x.numel() for x in tree_flatten((args, kwargs, out))[0]
                                  if isinstance(x, torch.Tensor))
            return out

    def run(layers: int) -> int:
        torch.manual_seed(0)
        model = CausalLM(with_layers(cfg, layers))
        ids = torch.randint(3, cfg.vocab_size, (batch, tokens))
        Elements.n = 0
        with torch.no_grad(), Elements():
            model(ids)
        return Elements.n

    return (run(2) - run(1)) / (batch * tokens)
