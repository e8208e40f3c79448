"""Settings of one `megatron-spec pretrain` run, kept free of torch so bad arguments fail before it is imported."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .arithmetic import Difficulty, check_rate

TASK_FILE = "task.json"
"""Written next to the weights: the task, tokenizer and training run the checkpoint belongs to."""

TINY_PRESETS = ("tiny-qwen3", "tiny-qwen3-deep", "tiny-qwen3-narrow", "tiny-qwen3-moe", "tiny-draft")
"""Presets this command trains: the ones whose vocabulary is the character tokenizer's."""


@dataclass
class PretrainConfig:
    """One pretraining run; every field is checked before any model is built."""

    preset: str
    """Which tiny model: one of `TINY_PRESETS`."""
    out: str
    """Checkpoint directory to write (HF layout: config.json + model.safetensors, plus task.json)."""
    steps: int = 1000
    """Optimizer steps; the default lands the dense model between 15 and 70 % held-out greedy accuracy."""
    seed: int = 0
    """Seeds the initial weights, the training stream and the held-out set."""
    batch_size: int = 64
    """Sequences per step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (tiny models take a large one); linear warm-up, cosine decay to 10 %."""
    warmup_steps: int = 100
    """Linear warm-up length, capped at a tenth of `steps`."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matrices (norms and embeddings are left alone)."""
    log_every: int = 100
    """Print a progress line every this many steps (and after the last)."""
    eval_problems: int = 100
    """Held-out problems for the final greedy accuracy; never seen in training."""
    difficulty: Difficulty = field(default_factory=Difficulty)
    """Problem generator knob shared by training and evaluation."""
    slip_rate: float = 0.0
    """Share of carrying lines in the training corpus whose carry its teacher drops (`arithmetic.solve`). Above
    0.5 the model learns the slip as its most likely step, so its greedy answers are mostly wrong while its
    samples are often right: the situation RL is known to fix. Held-out problems are always right."""
    careful_rate: float = 0.0
    """Share of the corpus written by the careful writer, who works each units column before the result and never
    slips (`arithmetic.solve(careful=True)`): a rare, longer style that RL can discover."""
    init: str | None = None
    """Checkpoint directory (of the same preset) to continue from; None starts from random weights."""

    def __post_init__(self) -> None:
        if self.preset not in TINY_PRESETS:
            raise ValueError(f"pretrain trains the tiny presets only ({', '.join(TINY_PRESETS)}), got {self.preset!r}")
        if not str(self.out).strip():
            raise ValueError("pretrain needs an output directory (--out)")
        if Path(self.out).is_file():
            raise ValueError(f"--out {self.out} is a file, expected a directory")
        for name in ("steps", "batch_size", "log_every", "eval_problems"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        check_rate("slip_rate", self.slip_rate)
        check_rate("careful_rate", self.careful_rate)
        if self.init is not None and not (Path(self.init) / "config.json").is_file():
            raise ValueError(f"--init {self.init} is not a checkpoint directory (no config.json)")
        if self.init is not None and Path(self.init).resolve() == Path(self.out).resolve():
            raise ValueError("--init and --out are the same directory: the run would overwrite what it continues")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("warmup_steps and weight_decay must be >= 0")
