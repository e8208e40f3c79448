"""What a k = 3 step costs in plain steps on this CPU, per batch size, as the policy widens: does a policy whose
weights leave the cache make plain decoding weight-bound, so that a verify of 4 tokens a sequence costs about what
one token does (as on a GPU), and speculation pays at the main job's 64 rollouts?

Issue 19 proposed such a policy. This measures it before anyone pretrains one: the main job's shape (8 layers, head
dim 32, one KV head for 3 query heads, MLP 3x hidden) at hidden sizes 96 (the main job's, 3.5 MB in fp32), 192,
256 and 384 (55 MB, past this host's 16 MB L3), with random weights and a random one-layer MTP head: only step
times are read, and a verify step's width is k + 1 whatever the drafts. Per width and batch size B (1, 4, 16, 64
sequences of 20 prompt tokens, 120 new tokens each, EOS ignored, so the batch stays at B), a plain engine and one
drafting k = 3 on every step run the same prompts, the order alternating over `--rounds` timed rounds after one
untimed; a step's time is the median of its decode steps.

Printed and written per width and B: plain and k = 3 step ms; `rho`, their quotient; `ceiling`, what k = 3 would
gain at the main job's measured 3.6 tokens a sequence a step (`octave_parts` at 33-64 sequences), 3.6 / rho; and
the plain step's fp32 GFLOP/s in its linear layers (2 x the weights' multiply-adds a row, the LM head included, x
B / time): near the CPU's arithmetic peak a step is compute-bound, and widening cannot make it weight-bound.

    python research/verify_width.py --out research/records/verify_width.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from megatron_spec.bench.common import machine, set_threads, time_step_parts
from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.drafters.mtp.model import MTP
from megatron_spec.models import CausalLM, preset
from megatron_spec.drafters.config import SpecConfig

WIDTHS = {96: 3, 192: 6, 256: 8, 384: 12}  # hidden size -> query heads (head dim 32, 3 per KV head)
BATCHES = (1, 4, 16, 64)
TOKENS_PER_STEP = 3.6  # k = 3 on the main job's policy at 33-64 sequences (`research/octave_parts.py`)


def shape(hidden: int):
    heads = WIDTHS[hidden]
    return dataclasses.replace(preset("tiny-qwen3-deep"), hidden_size=hidden, num_attention_heads=heads,
                               num_key_value_heads=heads // 3, intermediate_size=3 * hidden)


def step_ms(engines: dict, prompts: list, rounds: int, new_tokens: int = 120) -> dict:
    """Median decode step (ms) of each engine over `rounds` generate calls of `new_tokens` each (EOS ignored), the
    order alternating, after one untimed call each (kernels, plans and the cache for these shapes)."""
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0, ignore_eos=True)
    steps: dict = {name: [] for name in engines}
    for r in range(rounds + 1):
        for name in engines if r % 2 else list(engines)[::-1]:
            engines[name].generate(prompts, params)
            if r == 0:
                time_step_parts(engines[name], steps[name])
    return {name: 1e3 * statistics.median(s for b, s, _, _ in steps[name] if b == len(prompts)) for name in engines}


def k3_row(policy, head, prompts: list, rounds: int, new_tokens: int = 120) -> dict:
    """A plain engine and one drafting k = 3 with `head` on every step, timed on `prompts` (`step_ms`): their step
    ms, rho (the quotient) and its ceiling at TOKENS_PER_STEP; the row fields this benchmark, `verify_context` and
    `verify_shape` share."""
    ms = step_ms({"plain": LLMEngine(policy, max_num_seqs=64),
                  "k3": LLMEngine(policy, max_num_seqs=64, spec=SpecConfig("mtp", 3, adaptive=False), drafter=head)},
                 prompts, rounds, new_tokens)
    rho = ms["k3"] / ms["plain"]
    return {"plain_step_ms": round(ms["plain"], 3), "k3_step_ms": round(ms["k3"], 3), "rho": round(rho, 3),
            "ceiling": round(TOKENS_PER_STEP / rho, 3)}


def synthetic_prompts(batch: int, length: int = 20) -> list[list[int]]:
    """`batch` distinct token sequences of `length` (step times do not depend on what the tokens say)."""
    return [[1 + (7 * b + j) % 20 for j in range(length)] for b in range(batch)]


def add_row(rows: list, row: dict) -> None:
    """Keep `row` for the record and print it as it comes (a run takes minutes)."""
    rows.append(row)
    print(json.dumps(row), flush=True)


def write_record(args: argparse.Namespace, benchmark: str, rows: list, **fields) -> None:
    """The record of one of these benchmarks, to `--out` if given."""
    result = {"benchmark": benchmark, "machine": machine(), **fields, "rounds": args.rounds,
              "tokens_per_step": TOKENS_PER_STEP, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def parse_args(description: str) -> argparse.Namespace:
    """`--rounds`, `--threads` (set before returning) and `--out`, for this benchmark, `verify_context` and
    `verify_shape`."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    set_threads(args.threads)
    return args


def main() -> int:
    args = parse_args(__doc__.split("\n")[0])
    rows = []
    for hidden in WIDTHS:
        cfg = shape(hidden)
        torch.manual_seed(0)
        policy, head = CausalLM(cfg).eval(), MTP(cfg).eval()
        params = sum(t.numel() for t in policy.parameters())
        macs = params - cfg.vocab_size * hidden  # a row's multiply-adds: every weight but the embedding table
        for batch in BATCHES:
            row = {"hidden": hidden, "params": params, "fp32_mb": round(4 * params / 2**20, 1), "batch": batch,
                   **k3_row(policy, head, synthetic_prompts(batch), args.rounds)}
            row["plain_linear_gflops"] = round(2 * macs * batch / row["plain_step_ms"] / 1e6, 1)
            add_row(rows, row)
    write_record(args, "verify_width", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
