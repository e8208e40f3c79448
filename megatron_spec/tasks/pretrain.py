"""Pretrain a tiny reference model on worked arithmetic solutions, on CPU, in a few minutes (from scratch, or on from
a checkpoint of the same preset with `init`, e.g. on a corpus of another mix).

The result is a policy that is right on part of the problems (so GRPO has signal to improve) and whose outputs
have the copy-heavy structure drafters can predict. Sequences are `<bos> prompt solution <eos>`; the loss covers
the solution and eos only, because prompts are uniformly random digits that no model can (or should) predict.

Accuracy is measured at the end with a plain greedy loop written here on purpose (full forward per token, no KV
cache): it is slow but obviously right, and it keeps pretraining independent of the rollout engine.

A run is bitwise reproducible for a given seed and thread count. The dense and draft presets also came out
identical at 1 and 2 threads; the MoE preset does not (its per-expert matmuls over varying row counts reduce in a
thread-dependent order), and the shipped `checkpoints/tiny-qwen3-moe` was trained with OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_spec.models import CausalLM, ModelConfig, from_pretrained, preset, save_pretrained

from .arithmetic import ArithmeticDataset, Problem
from .pretrain_config import TASK_FILE, PretrainConfig
from .reward import reward
from .tokenizer import CharTokenizer

IGNORE = -100
"""Label of positions the loss skips (prompt and padding)."""


@dataclass
class PretrainResult:
    """What a run measured."""

    first_loss: float
    """Mean loss of the first logging window (the first `log_every` steps)."""
    final_loss: float
    """Mean loss of the last logging window."""
    accuracy: float
    """Greedy held-out accuracy in [0, 1]."""
    seconds: float
    """Wall time of the whole run, evaluation and saving included."""
    out: Path
    """Where the checkpoint was written."""


def model_config(name: str, tokenizer: CharTokenizer) -> ModelConfig:
    """The preset's config with the tokenizer's special ids; Qwen3 always has QK-norm (as HF's loader assumes)."""
    cfg = preset(name)
    if cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"preset {name} has {cfg.vocab_size} vocabulary rows, the tokenizer needs {tokenizer.vocab_size}"
        )
    return dataclasses.replace(
        cfg, qk_norm=cfg.model_type.startswith("qwen3"), bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id
    )


def training_stream(cfg: PretrainConfig, exclude: set[str]) -> Iterator[Problem]:
    """Training problems in order, skipping any whose prompt is held out, so evaluation is on unseen problems."""
    # Large enough never to wrap in a run; its size costs nothing since problems are generated on demand.
    source = ArithmeticDataset(size=10**9, seed=cfg.seed, difficulty=cfg.difficulty, split="train",
                               slip_rate=cfg.slip_rate, careful_rate=cfg.careful_rate)
    return (p for p in source.cycle() if p.prompt not in exclude)


def make_batch(problems: list[Problem], tok: CharTokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded inputs and labels: labels are the next token on the solution and eos, IGNORE elsewhere."""
    seqs, labels = [], []
    for p in problems:
        prompt = tok.encode(p.prompt, bos=True)
        full = prompt + tok.encode(p.solution, eos=True)
        seqs.append(full[:-1])
        labels.append([IGNORE] * (len(prompt) - 1) + full[len(prompt) :])
    width = max(map(len, seqs))
    inputs = torch.tensor([s + [tok.pad_id] * (width - len(s)) for s in seqs])
    targets = torch.tensor([y + [IGNORE] * (width - len(y)) for y in labels])
    return inputs, targets


def lr_factor(step: int, cfg: PretrainConfig) -> float:
    """Linear warm-up then cosine decay to 10 % of the peak; `step` counts from 0."""
    warmup = min(cfg.warmup_steps, cfg.steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: CausalLM, cfg: PretrainConfig) -> torch.optim.Optimizer:
    # Weight decay on matrices only: decaying norm gains or embedding rows of rare characters only hurts.
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


@torch.no_grad()
def greedy_complete(
    model: CausalLM, prompts: list[list[int]], eos_id: int, pad_id: int, max_new_tokens: int
) -> list[list[int]]:
    """Greedy completions (without eos) of token-id prompts: full forward per step, argmax, stop at eos.

    Unfinished sequences run as one right-padded batch: with causal attention, positions after a sequence's end
    never influence it, so each sequence reads its logits at its own last position.
    """
    model.eval()
    seqs = [list(p) for p in prompts]
    active = list(range(len(seqs)))
    for _ in range(max_new_tokens):
        if not active:
            break
        width = max(len(seqs[i]) for i in active)
        ids = torch.tensor([seqs[i] + [pad_id] * (width - len(seqs[i])) for i in active], device=model.device)
        last = torch.tensor([len(seqs[i]) - 1 for i in active], device=model.device)
        next_ids = model(ids)[torch.arange(len(active)), last].argmax(-1).tolist()
        for i, t in zip(active, next_ids):
            if t != eos_id:
                seqs[i].append(t)
        active = [i for i, t in zip(active, next_ids) if t != eos_id]
    return [s[len(p) :] for s, p in zip(seqs, prompts)]


def greedy_accuracy(model: CausalLM, problems: list[Problem], tok: CharTokenizer) -> float:
    """Share of `problems` whose greedy completion earns reward 1."""
    if not problems:
        raise ValueError("greedy_accuracy needs at least one problem")
    prompts = [tok.encode(p.prompt, bos=True) for p in problems]
    # Room for twice the longest reference solution: a rambling model is cut off and scored, never waited on.
    budget = 2 * max(len(p.solution) for p in problems) + 2
    completions = greedy_complete(model, prompts, tok.eos_id, tok.pad_id, budget)
    return sum(reward(tok.decode(c), p.answer) for c, p in zip(completions, problems)) / len(problems)


def train_step(model: CausalLM, optimizer: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """One AdamW step on the next-token loss (plus the MoE load-balancing loss); returns the next-token loss."""
    model.train()
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    total = loss
    if model.aux_loss is not None:  # MoE: keep the router from collapsing onto a few experts
        total = loss + model.config.router_aux_loss_coef * model.aux_loss
    optimizer.zero_grad(set_to_none=True)
    total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def task_card(cfg: PretrainConfig, tok: CharTokenizer, accuracy: float) -> dict:
    """Contents of `task.json`: how to prompt the checkpoint and what it was trained on."""
    return {
        "task": "arithmetic",
        "prompt_format": "<bos> + prompt (e.g. '12+7-30\\n'); the model writes the worked solution and stops at <eos>",
        "special_ids": {"pad": tok.pad_id, "bos": tok.bos_id, "eos": tok.eos_id},
        "alphabet": tok.alphabet,
        "difficulty": dataclasses.asdict(cfg.difficulty),
        "pretrain": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("out", "difficulty")},
        "heldout_greedy_accuracy": accuracy,
    }


def initial_model(cfg: PretrainConfig, model_cfg: ModelConfig) -> CausalLM:
    """Random weights of the preset, or the weights of `cfg.init`, which must be that preset's model."""
    if cfg.init is None:
        torch.manual_seed(cfg.seed)
        return CausalLM(model_cfg)
    model = from_pretrained(cfg.init, dtype=torch.float32)
    if model.config != model_cfg:
        raise ValueError(f"--init {cfg.init} is not a {cfg.preset} checkpoint of this tokenizer")
    return model


def pretrain(cfg: PretrainConfig, log: Callable[[str], None] = print) -> PretrainResult:
    """Train `cfg.preset` (from scratch or from `cfg.init`), evaluate it greedily on held-out problems, save it."""
    start = time.perf_counter()
    tok = CharTokenizer()
    model_cfg = model_config(cfg.preset, tok)
    held_out = list(ArithmeticDataset(cfg.eval_problems, cfg.seed, cfg.difficulty, split="eval"))
    stream = training_stream(cfg, {p.prompt for p in held_out})

    model = initial_model(cfg, model_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"pretrain {cfg.preset}: {n_params / 1e6:.2f}M parameters, {cfg.steps} steps x {cfg.batch_size} sequences, "
        f"{torch.get_num_threads()} threads")
    optimizer = make_optimizer(model, cfg)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))

    window: list[float] = []
    first_loss = final_loss = float("nan")
    for step in range(cfg.steps):
        inputs, targets = make_batch([next(stream) for _ in range(cfg.batch_size)], tok)
        window.append(train_step(model, optimizer, inputs, targets))
        schedule.step()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            final_loss, window = sum(window) / len(window), []
            first_loss = final_loss if math.isnan(first_loss) else first_loss
            log(f"step {step + 1:>5}/{cfg.steps}  loss {final_loss:.4f}  lr {schedule.get_last_lr()[0]:.2e}  "
                f"{time.perf_counter() - start:6.1f}s")

    accuracy = greedy_accuracy(model, held_out, tok)
    out = save_pretrained(model, cfg.out)
    (out / TASK_FILE).write_text(json.dumps(task_card(cfg, tok, accuracy), indent=2) + "\n")
    seconds = time.perf_counter() - start
    log(f"held-out greedy accuracy {accuracy:.1%} on {len(held_out)} problems; saved {out} ({seconds:.0f}s)")
    return PretrainResult(first_loss, final_loss, accuracy, seconds, out)
