"""What the spawned ranks run for `test_schedule.py`: the same 2 GRPO steps through one schedule call per pass
(`one_schedule`) and through one call per micro-batch shape, on micro-batches of 8 different lengths."""

from __future__ import annotations

import torch

from megatron_spec.interfaces import Batch

from .common import tiny
from .policy_workers import SAMPLING, grpo, our_model, with_policy_old

T, PROMPT = 16, 8
BUDGET = T
"""Every row is longer than T / 2, so a 16-token budget holds one row per micro-batch (per data-parallel rank)."""


def varied_batches(cfg, rows: int, n: int = 2) -> list[Batch]:
    """`rows` rows of prompt 8 and completions of 1-8 tokens (8 lengths, 9-16; each length rows / 8 times, so with
    rows = 16 and 2 data-parallel ranks each slot pairs two rows of one length); step 1 carries old log-probs away
    from the policy's, so the clip is active."""
    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(300 + s)
        ids = torch.randint(0, cfg.vocab_size, (rows, T), generator=g)
        mask = torch.zeros(rows, T, dtype=torch.bool)
        for i, k in enumerate(torch.randperm(rows, generator=g).tolist()):
            mask[i, PROMPT : PROMPT + 1 + k % 8] = True
        old = None if s == 0 else 0.3 * torch.randn(rows, T - 1, generator=g)
        out.append(Batch(ids, mask, torch.randn(rows, generator=g), old))
    return out


def one_vs_per_shape(rank: int, world: int, kind: str, layout: dict, rows: int) -> dict:
    """Per path (`one`: one schedule call per pass; `per_shape`: the call per run of equal shapes), 2 steps'
    metrics and the exported weights after each."""
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy

    cfg = tiny(kind)
    out = {}
    for name, one in (("one", True), ("per_shape", False)):
        policy = MegatronPolicy(our_model(cfg), grpo(micro_batch_tokens=BUDGET), SAMPLING, Parallelism(**layout))
        policy.one_schedule = one
        metrics, weights = [], []
        for b in varied_batches(cfg, rows):
            metrics.append(policy.train_step(with_policy_old(b, policy.logprobs(b))))
            weights.append({n: t.clone() for n, t in policy.export_weights()})
        out[name] = {"metrics": metrics, "weights": weights, "micro_batches": len(policy._micros(b))}
    return out

