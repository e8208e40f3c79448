"""`megatron-spec train-drafter`: initialise an MTP, EAGLE-3 or draft-model drafter offline on the target's own
generations for the task's prompts (in-domain initialisation: the reference paper measured 1.77x with it vs
1.51x from generic chat data), with the soft cross-entropy of `drafter_loss`. Saves a checkpoint the engine loads.

The target is frozen, so its features (the final hidden state and, for EAGLE-3, the captured layers' outputs) are
recorded while it generates the rollouts (`proposers.hidden.FeatureRecorder`, a proposer that only observes: the
forwards that produce the tokens also produce the features, so there is no second pass over the rollouts), and
every training step reads its batch from that cache: a step costs the drafter's forward and backward only, not a
pass of the target's trunk (on SmolLM2-135M that trunk is ~20x the head). These are also exactly the states the
head reads when it drafts in the engine. Memory: (1 + captured layers) x H floats per position, ~0.6 GB for 384
SmolLM2 rollouts of up to 164 tokens. `target_features` recomputes them by teacher forcing for other token ids.

`--draft-vocab N` gives an EAGLE-3 head a reduced vocabulary: the N target ids generated most often in the
target's own rollouts (the ids the head will be asked to draft), EOS always included, sorted.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def task_prompts(target_path: str, n: int, seed: int, split: str = "train") -> list[list[int]]:
    """Token ids of n task prompts for the target: character-level for the tiny models, the natural-language
    chat prompt through the model's own tokenizer for SmolLM2."""
    from ..models.hf_io import read_config
    from ..models.presets import TINY_VOCAB
    from .task import PromptTask

    tiny = str(target_path) != "smollm2-135m" and read_config(target_path).vocab_size == TINY_VOCAB
    task = PromptTask.build("tiny" if tiny else "natural", target_path, n, seed, split)
    return [task.encode(p) for p in task.problems(0, n)]


def new_drafter(method: str, target, draft_preset: str | None, d2t=None):
    """A fresh drafter from the method's registry entry; `d2t` (target ids) is the head's draft vocabulary, for a
    method that has one."""
    from ..drafters.registry import drafter_method, method_names

    entry = drafter_method(method)
    if d2t is not None and not entry.draft_vocab:
        raise ValueError(f"method {method!r} drafts in the target's vocabulary; it takes no draft vocabulary")
    if entry.new is None:
        raise ValueError(f"method {method!r} has no trainable drafter: choose {', '.join(method_names(trainable=True))}")
    return entry.new(target, draft_preset, d2t)


def rollouts(target, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int,
             capture: tuple[int, ...] = ()):
    """(padded token ids [N, T], mask of generated positions [N, T], the target's features for them: a
    `TrunkOutput` with the final hidden states and the `capture` layers) from the target's own sampled generations."""
    from ..engine import LLMEngine, SamplingParams
    from .loop import make_batch
    from ..drafters.hidden import FeatureRecorder

    engine = LLMEngine(target, max_num_seqs=64)
    engine.proposer = recorder = FeatureRecorder(target, capture)  # before generate: it builds the runner from it
    outs = engine.generate(prompts, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed))
    batch, _ = make_batch(prompts, outs)
    return batch.input_ids, batch.mask, recorder.features(batch.input_ids.shape[1])


def draft_vocab(ids, mask, size: int, vocab_size: int, always: tuple[int, ...] = ()):
    """The `size` target ids generated most often (positions in `mask`), the ids in `always` (EOS) included
    whatever their count, ties broken by the smaller id; sorted ascending, int64 [size]."""
    import torch

    if not 0 < size < vocab_size:
        raise ValueError(f"--draft-vocab must be in 1..{vocab_size - 1} (the target has {vocab_size} ids), got {size}")
    if len(set(always)) > size:
        raise ValueError(f"--draft-vocab {size} cannot hold the {len(set(always))} ids that must be in it {always}")
    counts = torch.bincount(ids[mask], minlength=vocab_size).double()
    counts[list(always)] = float("inf")
    order = torch.argsort(-counts, stable=True)  # stable: equal counts keep id order
    return order[:size].sort().values


def capture_layers(method: str, target, drafter=None, draft_preset: str | None = None) -> tuple[int, ...]:
    """Target layers whose outputs the drafter fuses (an EAGLE-3 head's; none for the others): `drafter`'s, or a
    fresh drafter's of `method` when None."""
    from ..drafters.eagle3.model import captured_layers

    return captured_layers(drafter if drafter is not None else new_drafter(method, target, draft_preset))


def target_features(target, drafter, ids, chunk: int = 16) -> TrunkOutput:
    """The frozen target's `TrunkOutput` for `ids` by teacher forcing ([N, T, H] final hidden state, plus the layers
    an EAGLE-3 head fuses), `chunk` rows at a time: for token ids that were not recorded by `rollouts`."""
    import torch

    from ..drafters.eagle3.model import captured_layers
    from ..models.decoder import TrunkOutput

    capture = captured_layers(drafter)
    hidden, layers = [], {i: [] for i in capture}
    with torch.no_grad():
        for start in range(0, ids.shape[0], chunk):
            out = target.trunk(ids[start : start + chunk], capture=capture)
            hidden.append(out.hidden)
            for i in capture:
                layers[i].append(out.layers[i])
    return TrunkOutput(torch.cat(hidden), {i: torch.cat(t) for i, t in layers.items()})


def train(target, drafter, method: str, ids, mask, steps: int, batch_size: int, lr: float, seed: int,
          log_every: int = 50, feats: TrunkOutput | None = None) -> list[float]:
    """AdamW on the drafter only, the online drafter trainer's optimizer steps (`DrafterTrainer.optimizer_step`) on
    rows drawn at random, under a learning-rate schedule; the frozen target's features are `feats` (from `rollouts`)
    or computed here once. Returns the loss per step."""
    import torch

    from ..models.decoder import TrunkOutput
    from .config import DrafterTrainSection
    from ..drafters.loss import drafter_loss
    from ..drafters.registry import drafter_method
    from ..drafters.trainer import DrafterTrainer

    online_loss = drafter_method(method).online_loss
    target.eval().requires_grad_(False)
    if feats is None:
        feats = target_features(target, drafter, ids)
    drafter.train()
    trainer = DrafterTrainer(drafter, method, DrafterTrainSection(lr=lr, ema=0.0), sampling={}, pack_tokens=0)
    opt = trainer.opt
    # Short warm-up, then linear decay to 10 %: small batches of rollouts are noisy (SmolLM2, 8 rollouts: the loss
    # swings by +-0.4 from step to step), and a decaying rate lets the last steps average that noise out.
    warmup = max(1, min(20, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / steps))
    g = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        # Drawn on the host (the same rows on any device for a seed), used where the rollouts are.
        rows = torch.randint(0, ids.shape[0], (batch_size,), generator=g).to(ids.device)
        length = int(mask[rows].nonzero()[:, 1].max()) + 1  # trim padding columns of this batch
        out = TrunkOutput(feats.hidden[rows, :length], {i: h[rows, :length] for i, h in feats.layers.items()})
        loss = drafter_loss(online_loss, target, drafter, ids[rows, :length], mask[rows, :length], out=out)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        trainer.optimizer_step()
        sched.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"  step {step:4d}  soft-CE {loss.item():.4f}")
    drafter.eval()
    return losses


def cached_rollouts(args: argparse.Namespace, target, capture: tuple[int, ...]):
    """`rollouts` for the command's settings, or those saved at `--rollouts FILE` by an earlier run with the same
    settings (written there otherwise): tuning the drafter then skips the target's generation."""
    import torch

    from ..models.decoder import TrunkOutput

    key = {"target": str(args.target), "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
           "temperature": args.temperature, "seed": args.seed, "capture": list(dict.fromkeys(capture))}
    if args.rollouts and Path(args.rollouts).is_file():
        saved = torch.load(args.rollouts)
        if saved["key"] != key:
            raise ValueError(f"--rollouts {args.rollouts} holds rollouts for {saved['key']}, this run needs {key}")
        return saved["ids"], saved["mask"], TrunkOutput(saved["hidden"], saved["layers"])
    prompts = task_prompts(args.target, args.num_prompts, args.seed)
    ids, mask, feats = rollouts(target, prompts, args.max_tokens, args.temperature, args.seed, capture)
    if args.rollouts:
        torch.save({"key": key, "ids": ids, "mask": mask, "hidden": feats.hidden.contiguous(),
                    "layers": {i: t.contiguous() for i, t in feats.layers.items()}}, args.rollouts)
    return ids, mask, feats


def main(args: argparse.Namespace) -> int:
    import torch

    from ..models import from_pretrained
    from ..models.config import token_id_tuple
    from ..drafters.registry import drafter_method

    entry = drafter_method(args.method)
    if args.draft_vocab and (not entry.draft_vocab or args.init is not None):
        raise ValueError("--draft-vocab builds a fresh EAGLE-3 head's map (a head from --init keeps its own)")
    torch.manual_seed(args.seed)
    target = from_pretrained(args.target)
    drafter = None
    if args.init is not None:
        drafter = entry.load(args.init, target, "cpu")
    t0 = time.perf_counter()
    ids, mask, feats = cached_rollouts(args, target, capture_layers(args.method, target, drafter, args.draft_preset))
    print(f"train-drafter: {ids.shape[0]} target rollouts ({int(mask.sum())} tokens) "
          f"in {time.perf_counter() - t0:.1f}s")
    d2t = None
    if args.draft_vocab:
        d2t = draft_vocab(ids, mask, args.draft_vocab, target.config.vocab_size,
                          token_id_tuple(target.config.eos_token_id))
        covered = torch.isin(ids[mask], d2t).float().mean().item()
        print(f"train-drafter: draft vocabulary of {args.draft_vocab} ids covers {covered:.2%} of generated tokens")
    if drafter is None:
        drafter = new_drafter(args.method, target, args.draft_preset, d2t)
    t0 = time.perf_counter()
    losses = train(target, drafter, args.method, ids, mask, args.steps, args.batch_size, args.lr, args.seed,
                   feats=feats)
    print(f"train-drafter: {args.steps} steps in {time.perf_counter() - t0:.1f}s, soft-CE {losses[0]:.3f} -> {losses[-1]:.3f}")
    drafter = drafter.to(getattr(torch, args.save_dtype))  # loaders cast to the target's dtype
    out = entry.save(drafter, args.out, target)
    print(f"train-drafter: saved {args.method} drafter to {out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from ..drafters.registry import method_names

    p = sub.add_parser("train-drafter", help="train a drafter offline on the target's own generations")
    p.add_argument("--target", required=True, help="target checkpoint directory (or smollm2-135m)")
    p.add_argument("--method", required=True, choices=method_names(trainable=True))
    p.add_argument("--out", required=True, help="where to save the drafter checkpoint")
    p.add_argument("--draft-preset", default=None, help="architecture of a new draft model (draft_model only)")
    p.add_argument("--init", default=None, help="continue from this drafter checkpoint instead of a fresh one")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="EAGLE-3 only: draft over the N most frequent target ids of the rollouts (0 = full vocabulary)")
    p.add_argument("--rollouts", default=None, metavar="FILE",
                   help="reuse the target's rollouts and features saved in FILE by a run with the same settings "
                        "(written there when missing)")
    p.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the saved weights (bfloat16 halves the checkpoint; loading casts to the target's)")
    p.set_defaults(func=main)
