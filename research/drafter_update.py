"""The online drafter update with a minibatch's rows joined (`trainers.embedded.pack`) against one pass per micro-batch
slice (how it ran before), side by side in one process.

The main job's policy and MTP head (`checkpoints/tiny-qwen3-deep-careful`, drafts 3, 4 minibatches): one RL step's
64 rows (20-token prompts; responses of random lengths in a range, as the main job writes early and late in its
run) are cut into the policy's micro-batches (`grpo.micro_batch_tokens` 1024), their trunk states computed, and
one update's 4 minibatches (an optimizer step each) timed both ways, alternating which goes first; the main job
ran 8 of these per RL step when they were measured (`drafter_train.replay=8`, `minibatches=4`; it now replays 4
steps in 8 minibatches each). Prints and writes the median time of each and their ratio.

    python research/drafter_update.py --out research/records/drafter_update_packing.json

`--compare attention` times the same update (rows joined) with the chained drafts' attention as it is now
(`layers.attend_unrolled`: a later step's keys scored on the diagonal only) against `attend` over every step's
keys under the full mask (how it ran before), alternating likewise:

    python research/drafter_update.py --compare attention --out research/records/drafter_update_unrolled.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from megatron_spec.bench.common import machine, main_job_models, write_json
from megatron_spec.models.layers import attend
from megatron_spec.models.masks import causal_mask
from megatron_spec.rl.config import DrafterTrainSection, GRPOSection
from megatron_spec.microbatch import micro_batches
from megatron_spec.drafters.trainer import minibatches
from megatron_spec.interfaces import DrafterInputs
from megatron_spec.trainers.embedded import EmbeddedPolicy
from megatron_spec.drafters import loss as drafter_loss

BUDGET = 1024
"""The main job's `grpo.micro_batch_tokens`; a budget of 1 makes `pack` join nothing (the path before it)."""


def step_inputs(model, lengths: list[int], prompt: int, budget: int = BUDGET) -> list[DrafterInputs]:
    """One step's micro-batches (`budget` tokens each) as the policy's forward leaves them for the drafter: random
    ids, the response positions after `prompt` masked in, the trunk's states and logits."""
    out = []
    for group in micro_batches(lengths, budget):
        T = max(lengths[i] for i in group)
        ids = torch.randint(3, model.config.vocab_size, (len(group), T))
        mask = torch.zeros(len(group), T, dtype=torch.bool)
        for row, i in enumerate(group):
            mask[row, prompt : lengths[i]] = True
        with torch.no_grad():
            trunk = model.trunk(ids, capture=())
            out.append(DrafterInputs(ids, mask, trunk, model.lm_head(trunk.hidden)))
    return out


class MaskedUnrolled(drafter_loss.UnrolledAttention):
    """The chained drafts' attention before `attend_unrolled`: every step's keys, the mask [causal | eye ...]."""

    def attention(self, layer, q, k, v):
        self.keys.append(k)
        self.values.append(v)
        n = q.shape[2]
        eye = torch.eye(n, dtype=torch.bool)
        mask = torch.cat([causal_mask(n)[0, 0]] + [eye] * (len(self.keys) - 1), 1)[None, None]
        return attend(q, torch.cat([x[:, :, :n] for x in self.keys], 2),
                      torch.cat([x[:, :, :n] for x in self.values], 2), mask)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranges", nargs="+", default=["30-80", "30-160", "120-160"], help="response lengths, lo-hi")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compare", choices=["packing", "attention"], default="packing")
    p.add_argument("--out", default="research/records/drafter_update_packing.json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model, drafter = main_job_models(args.threads)
    policy = EmbeddedPolicy(model, GRPOSection(lr=1e-4), dict(temperature=1.0, top_k=0, top_p=1.0), drafter, "mtp",
                            DrafterTrainSection(drafts=3, replay=8, minibatches=4))
    unrolled = drafter_loss.UnrolledAttention
    # Per variant: the packing budget and the chained drafts' attention.
    variants = {"before": (1, unrolled) if args.compare == "packing" else (BUDGET, MaskedUnrolled),
                "after": (BUDGET, unrolled)}
    rng, rows = random.Random(0), []
    for spec in args.ranges:
        lo, hi = map(int, spec.split("-"))
        forwards = step_inputs(model, [20 + rng.randint(lo, hi) for _ in range(64)], prompt=20)
        tokens = float(sum(f.mask.sum() for f in forwards))
        times: dict[str, list[float]] = {"before": [], "after": []}
        for rep in range(args.repeats + 1):
            for variant in ("before", "after") if rep % 2 else ("after", "before"):
                budget, drafter_loss.UnrolledAttention = variants[variant]
                batches = minibatches(forwards, tokens, 4, budget)
                start = time.perf_counter()
                for parts, count in batches:
                    policy.drafter_trainer.run_pass(model, parts, count, learn=True, measure=False)
                if rep:  # the first round warms both up
                    times[variant].append(time.perf_counter() - start)
        drafter_loss.UnrolledAttention = unrolled
        passes = {v: sum(len(parts) for parts, _ in minibatches(forwards, tokens, 4, budget))
                  for v, (budget, _) in variants.items()}
        row = {"responses": spec, "micro_batches": len(forwards), "passes_before": passes["before"],
               "passes_after": passes["after"], "before_s": statistics.median(times["before"]),
               "after_s": statistics.median(times["after"])}
        row["speedup"] = row["before_s"] / row["after_s"]
        rows.append(row)
        print(f"responses {spec}: {row['micro_batches']} micro-batches, passes {passes['before']} -> "
              f"{passes['after']}, one update {row['before_s']:.3f} s -> {row['after_s']:.3f} s "
              f"({row['speedup']:.2f}x)")
    record = {"benchmark": f"drafter_update_{args.compare}", "machine": machine(), "repeats": args.repeats, "rows": rows}
    print(f"wrote {write_json(args.out, record)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
