"""Numbers for the "Losslessness at the RL level" section of research/notebook/README.md, from sampled plain / spec runs.

    python research/lossless/summarize.py runs/lossless/sampled [--tail 10] [--json OUT.json]

Expects DIR/plain_s<seed> and DIR/spec_s<seed> run directories (metrics.jsonl, optional rollouts.jsonl from
record_rollouts.py). Prints:

  - per seed: mean reward over the last `tail` steps, plain and spec, and spec - plain;
  - the plain seed-to-seed min / max / std of that tail mean, and for each spec run whether it lies in [min, max];
  - a paired test at the seed level: mean over seeds of (spec - plain) against its standard error (t, 3 df);
  - a paired test at the step level: every (seed, step) gives the same prompts to plain and spec, so
    d = reward_spec - reward_plain has mean 0 if speculation is lossless; mean(d) over all steps and seeds against its
    standard error (the steps are treated as independent: each step draws new prompts and fresh sampling streams,
    and at lr 1e-5 the policies barely drift apart, so the correlation between steps is small);
  - token-level: fraction of same-seed rollouts with identical token ids, next to the number expected if the two
    were independent draws from the same policy (sum over plain rollouts of exp(sum of their logprobs), i.e.
    E[sum_y p(y)^2]): short answers where the target is near-deterministic come out the same whatever random stream
    is used, so the count is not zero, but it should be close to that expectation.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics as st
import sys
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rewards(run: Path) -> dict[int, float]:
    return {m["step"]: m["reward_mean"] for m in read_jsonl(run / "metrics.jsonl")}


def t_pvalue(t: float, df: int) -> float:
    try:
        from scipy import stats

        return float(2 * stats.t.sf(abs(t), df))
    except ImportError:  # normal approximation
        return math.erfc(abs(t) / math.sqrt(2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--tail", type=int, default=10)
    p.add_argument("--json", type=Path)
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], help="e.g. 0,1,2,3 (default: all pairs)")
    args = p.parse_args(argv)

    seeds = sorted(int(m.group(1)) for d in args.dir.iterdir() if (m := re.fullmatch(r"plain_s(\d+)", d.name))
                   and (args.dir / f"spec_s{m.group(1)}").is_dir()
                   and (args.seeds is None or int(m.group(1)) in args.seeds))
    runs = {(k, s): rewards(args.dir / f"{k}_s{s}") for s in seeds for k in ("plain", "spec")}
    tail = {key: st.mean([r[s] for s in sorted(r)[-args.tail:]]) for key, r in runs.items()}
    plain = [tail["plain", s] for s in seeds]
    lo, hi, sd = min(plain), max(plain), st.stdev(plain)
    rows = []
    for s in seeds:
        t_spec = tail["spec", s]
        gap = max(lo - t_spec, t_spec - hi, 0.0)
        rows.append({"seed": s, "plain": tail["plain", s], "spec": t_spec, "diff": t_spec - tail["plain", s],
                     "within": lo <= t_spec <= hi, "outside_by": gap,
                     "plain_mean_all": st.mean(runs["plain", s].values()),
                     "spec_mean_all": st.mean(runs["spec", s].values())})
    spec_tails = [tail["spec", s] for s in seeds]
    diffs = [r["diff"] for r in rows]
    se_seed = st.stdev(diffs) / math.sqrt(len(diffs))
    step_d = [runs["spec", s][k] - runs["plain", s][k] for s in seeds for k in sorted(runs["plain", s])
              if k in runs["spec", s]]
    se_step = st.stdev(step_d) / math.sqrt(len(step_d))
    plain_steps = [v for s in seeds for v in runs["plain", s].values()]
    out = {
        "tail": args.tail, "seeds": seeds, "rows": rows,
        "plain": {"min": lo, "max": hi, "std": sd, "mean": st.mean(plain)},
        "spec": {"min": min(spec_tails), "max": max(spec_tails), "std": st.stdev(spec_tails),
                 "mean": st.mean(spec_tails)},
        "seed_level": {"mean_diff": st.mean(diffs), "se": se_seed, "t": st.mean(diffs) / se_seed,
                       "p": t_pvalue(st.mean(diffs) / se_seed, len(diffs) - 1)},
        "step_level": {"n": len(step_d), "mean_diff": st.mean(step_d), "se": se_step, "t": st.mean(step_d) / se_step,
                       "p": t_pvalue(st.mean(step_d) / se_step, len(step_d) - 1),
                       "sd_diff": st.stdev(step_d), "sd_plain_step_reward": st.stdev(plain_steps)},
    }
    tokens = []
    for s in seeds:
        a, b = args.dir / f"plain_s{s}" / "rollouts.jsonl", args.dir / f"spec_s{s}" / "rollouts.jsonl"
        if not (a.is_file() and b.is_file()):
            continue
        same = total = same0 = total0 = 0
        indep = 0.0  # sum over plain rollouts of P(y_plain): the chance that an independent draw repeats it
        for ca, cb in zip(read_jsonl(a), read_jsonl(b)):
            if ca["kind"] != "train":
                continue
            eq = sum(x == y for x, y in zip(ca["token_ids"], cb["token_ids"]))
            indep += sum(math.exp(sum(lp)) for lp in ca["logprobs"])
            same, total = same + eq, total + len(ca["token_ids"])
            if ca["step"] == 0:
                same0, total0 = eq, len(ca["token_ids"])
        tokens.append({"seed": s, "identical": same, "total": total, "identical_step0": same0, "total_step0": total0,
                       "expected_if_independent": indep})
    out["tokens"] = tokens

    print(f"last {args.tail} steps, mean reward per run")
    print(f"{'seed':>4} {'plain':>8} {'spec':>8} {'spec-plain':>11} {'in plain band':>14}")
    for r in rows:
        print(f"{r['seed']:>4} {r['plain']:8.4f} {r['spec']:8.4f} {r['diff']:+11.4f} "
              f"{'yes' if r['within'] else 'no (by %.4f)' % r['outside_by']:>14}")
    print(f"plain seed-to-seed: min {lo:.4f} max {hi:.4f} (range {hi - lo:.4f}) std {sd:.4f} mean {st.mean(plain):.4f}")
    print(f"spec  seed-to-seed: min {min(spec_tails):.4f} max {max(spec_tails):.4f} std {st.stdev(spec_tails):.4f} "
          f"mean {st.mean(spec_tails):.4f}")
    sl, pl = out["seed_level"], out["step_level"]
    print(f"seed-level paired: mean(spec-plain) {sl['mean_diff']:+.4f} +- {sl['se']:.4f} (SE), "
          f"t={sl['t']:.2f}, p={sl['p']:.2f}")
    print(f"step-level paired: n={pl['n']} mean(spec-plain) {pl['mean_diff']:+.4f} +- {pl['se']:.4f} (SE), "
          f"t={pl['t']:.2f}, p={pl['p']:.2f}; sd of per-step diff {pl['sd_diff']:.4f}, "
          f"sd of plain per-step reward {pl['sd_plain_step_reward']:.4f}")
    for t in tokens:
        print(f"seed {t['seed']}: {t['identical']}/{t['total']} same-seed training rollouts have identical tokens "
              f"(step 0: {t['identical_step0']}/{t['total_step0']}; {t['expected_if_independent']:.0f} expected "
              f"if the two rollouts were independent draws)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
