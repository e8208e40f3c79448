"""The main job's three claims, measured: RL learns, the online drafter matters, speculation pays.

Runs the README's main command (`recipes/tiny_grpo_spec.py`) once per variant and seed, one run at a time on an
otherwise idle machine, and reads each run's `metrics.jsonl`:

- `spec`: the main job as shipped (MTP head, adaptive controller, online drafter training);
- `plain`: the same job with `spec=null`, run next to `spec` with the same seed (paired; which runs first
  alternates between seeds), which is both the
  losslessness check at the RL level (it must learn as much) and the baseline of the gen-stage speed-up;
- `frozen`: the main job with `drafter_train.online=false` (the drafter as `train-drafter` left it).

Printed and written to the JSON:
1. held-out greedy accuracy before the first update and after the last, per seed and as the mean over seeds;
2. the acceptance length of the first and last `window` steps, online and frozen (their ratio), measured in the
   rollouts with speculation forced on every step (`spec.adaptive=false`, so no step is left out by the
   controller), and the drafter's agreement with the policy on the train batch in the shipped (adaptive) runs;
3. the gen stage's total time, plain over spec, per seed (paired) and pooled; the same per generated token; and
   both over the steps where the spec run drafted nothing;
4. the whole step's (every stage, the online drafter's training included), plain over spec, per seed and pooled,
   beside the plain step's generation share, the steps the whole-step gate ran plainly, and the whole-step ratio
   of the k = 3 runs against the plain run of their seed. Each run records the host's load average before and after.

    python benchmarks/main_job.py --seeds 0 1 2 --out research/records/main_job.json [--check main_job_avx2]

`--check GROUP` then checks the published claims (`benchmarks/claims.py`) on the new record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "spec": [],
    "plain": ["spec=null"],
    "frozen": ["drafter_train.online=false", "spec.adaptive=false"],
    "online": ["spec.adaptive=false"],
}
"""Overrides of the main command per variant; `online` is `frozen`'s pair (same fixed k, drafter trained)."""


def run(variant: str, seed: int, runs_dir: Path, extra: list[str], reuse: bool = False) -> dict:
    """One run of the plan; with `reuse`, a run directory that already holds every step of the run is read instead
    (its wall time is then unknown: None)."""
    return run_together([(variant, seed)], runs_dir, extra, reuse)[0]


def run_together(plan: list[tuple[str, int]], runs_dir: Path, extra: list[str], reuse: bool = False,
                 cores: list[int] | None = None) -> list[dict]:
    """The runs of `plan` as processes started together (one: a run alone), each result as `run` gives it; with
    `cores`, run i pinned to CPU cores[i] (its directory named for the core)."""
    import yaml

    from megatron_spec.rl.logging import read_metrics

    done, procs = {}, []
    start, load = time.perf_counter(), os.getloadavg()[0]
    for i, (variant, seed) in enumerate(plan):
        core = None if cores is None else cores[i]
        out = runs_dir / (f"{variant}-s{seed}" + ("" if core is None else f"-c{core}"))
        if reuse and (out / "config.yaml").exists():
            rows = read_metrics(out)
            if len(rows) == yaml.safe_load((out / "config.yaml").read_text())["run"]["steps"]:
                done[variant, seed] = {"variant": variant, "seed": seed, "wall_s": None, "dir": str(out), "rows": rows,
                                       "core": core}
                continue
        argv = [sys.executable, str(ROOT / "recipes" / "tiny_grpo_spec.py"), f"run.seed={seed}", f"run.out_dir={out}",
                "run.resume=false", "run.report=false", *VARIANTS[variant], *extra]
        pin = None if core is None else (lambda c=core: os.sched_setaffinity(0, {c}))
        procs.append(((variant, seed), out, subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                                                             preexec_fn=pin)))
    for key, out, proc in procs:
        if proc.wait():
            raise subprocess.CalledProcessError(proc.returncode, f"{key[0]} seed {key[1]}")
        # read_metrics: the last record of a step wins (a run resumed after a crash logs its last steps again)
        done[key] = {"variant": key[0], "seed": key[1], "wall_s": time.perf_counter() - start, "dir": str(out),
                     "rows": read_metrics(out), "load": [load, os.getloadavg()[0]]}
        if cores is not None:
            done[key]["core"] = cores[plan.index(key)]
    return [done[key] for key in plan]


def run_settings(runs_dir: Path, first: tuple[str, int]) -> dict:
    """What the simulator's comparison needs of the runs' config (`megatron-spec simulate --main-job`): prompts per
    step and the online drafter's training, read from the first run's resolved config."""
    import yaml

    cfg = yaml.safe_load(sorted(runs_dir.glob(f"{first[0]}-s{first[1]}*/config.yaml"))[0].read_text())
    d = cfg["drafter_train"]
    return {"prompts_per_step": cfg["grpo"]["prompts_per_step"],
            "drafter_train": {k: d[k] for k in ("drafts", "replay", "minibatches", "extra_groups")}}


ADDED = ("wall_s", "gen_s", "train_s", "step_s", "drafter_s", "steps", "steps_gated_plain", "steps_drafter_trained",
         "steps_drafter_cut", "gen_tokens")


def merge_rounds(a: dict, b: dict) -> dict:
    """One variant's two rounds (`--swap-cores`: pinned to one core, then the other) as one run: seconds, steps and
    tokens added (per-step and per-token figures are then the mean over both cores), curves of seconds and tokens
    added step by step; what the gate and the drafter did as in the first round; each round's own times kept under
    `rounds`."""
    out = {**a, **{key: None if a[key] is None or b[key] is None else a[key] + b[key] for key in ADDED}}
    for key in ("gen_curve", "gen_tokens_curve"):
        out[key] = [x + y for x, y in zip(a[key], b[key])]
    out["gate_cost_in_run"] = mean([a["gate_cost_in_run"], b["gate_cost_in_run"]])
    out["rounds"] = [{key: r.get(key) for key in ("core", "step_s", "gen_s", "train_s", "steps_gated_plain",
                                                  "gate_cost_in_run", "tau_first", "tau_last", "step_curve",
                                                  "speculate_curve", "drafter_curve")} for r in (a, b)]
    for key in ("step_curve", "speculate_curve", "drafter_curve"):  # per round only (`step_matched`)
        out.pop(key)
    out["same_rollouts_in_both_rounds"] = same_rollouts(a, b)
    return out


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def summarize(result: dict, window: int) -> dict:
    rows = result["rows"]
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None]
    taus = [r.get("acceptance_length") for r in rows]
    agree = [(r.get("drafter_agreement") or [None])[0] for r in rows]
    return {
        "variant": result["variant"], "seed": result["seed"], "wall_s": result["wall_s"],
        "eval_before": rows[0].get("eval_accuracy_before"), "eval_curve": evals, "eval_after": evals[-1][1],
        "reward_curve": [r["reward_mean"] for r in rows],
        "gen_s": sum(r["stages"]["gen"] for r in rows), "train_s": sum(r["stages"]["train"] for r in rows),
        "steps": len(rows), "step_s": sum(r["step_time"] for r in rows), "drafter_s": sum(r.get("drafter_s") or 0.0 for r in rows),
        "steps_gated_plain": sum(r.get("speculate") is False for r in rows),
        "steps_drafter_trained": sum(r.get("drafter_s") is not None for r in rows),
        "steps_drafter_cut": sum(bool(r.get("drafter_cut")) for r in rows),  # of those, stopped at the gate's budget
        "gate_cost_in_run": gate_cost_in_run(rows),
        "load": result.get("load"), "core": result.get("core"),
        "gen_tokens": sum(r["gen_tokens"] for r in rows),
        "gen_curve": [r["stages"]["gen"] for r in rows], "gen_tokens_curve": [r["gen_tokens"] for r in rows],
        "step_curve": [r["step_time"] for r in rows], "speculate_curve": [r.get("speculate") for r in rows],
        "drafter_curve": [r.get("drafter_s") for r in rows],
        "tau_curve": taus, "tau_first": mean(taus[:window]), "tau_last": mean(taus[-window:]),
        "agreement_curve": agree, "agreement_first": mean(agree[:window]), "agreement_last": mean(agree[-window:]),
    }


def gate_cost_in_run(rows: list[dict], reach: int = 3) -> float | None:
    """What speculating cost a gated run, as a share of its own step time, measured inside the run: its speculative
    steps' gen stage beyond what their tokens cost at the median per-token gen time of the plain steps within
    `reach` steps of them, plus the drafter's training. Steps in one run share the host's load more closely than two
    runs minutes apart do, so on a shared host this is the steadier estimate of the gate's cost; None for a run the
    gate did not run."""
    if not any(r.get("speculate") is not None for r in rows):
        return None
    extra = sum(r.get("drafter_s") or 0.0 for r in rows)
    for i, r in enumerate(rows):
        if not r.get("speculate"):
            continue
        near = [rows[j]["stages"]["gen"] / rows[j]["gen_tokens"] for j in range(max(0, i - reach), i + reach + 1)
                if j < len(rows) and rows[j].get("speculate") is False]
        if near:
            extra += r["stages"]["gen"] - r["gen_tokens"] * statistics.median(near)
    return extra / sum(r["step_time"] for r in rows)


def whole_step(spec: list[dict], plain: list[dict], online: list[dict], frozen: list[dict]) -> dict:
    """The whole step (every stage, the online drafter's training in the train stage), plain over spec seconds, per
    seed and pooled, with the plain runs' generation share and what the whole-step gate did; and the same ratio of
    the k = 3 runs (online and frozen head) against the plain run of their seed, by the mean step (a k = 3 run may
    be longer)."""
    by_seed = {r["seed"]: r for r in plain}

    def per_step(r: dict) -> float:
        return r["step_s"] / r["steps"]

    # One figure per drafter seed, in the order of `online` / `frozen` (a run without a plain pair: None).
    forced = {f"{variant}_k3": [per_step(by_seed[r["seed"]]) / per_step(r) if r["seed"] in by_seed else None
                                for r in runs] for variant, runs in (("online", online), ("frozen", frozen))}

    def step_s_per_token(r: dict) -> float:
        return r["step_s"] / r["gen_tokens"]

    return {"paired": [pl["step_s"] / sp["step_s"] for sp, pl in zip(spec, plain)],
            "pooled": sum(r["step_s"] for r in plain) / sum(r["step_s"] for r in spec),
            "same_rollouts": [same_rollouts(sp, pl) for sp, pl in zip(spec, plain)],
            "step_matched": [step_matched(sp, pl) for sp, pl in zip(spec, plain)],
            # Where a pair's trajectories drift apart (a GPU, or sampled drafts: same distributions, not the same
            # tokens), one run may write a few per cent more tokens than the other; per generated token takes that
            # out of the ratio.
            "per_token_paired": [step_s_per_token(pl) / step_s_per_token(sp) for sp, pl in zip(spec, plain)],
            "gen_tokens_spec_over_plain": [sp["gen_tokens"] / pl["gen_tokens"] for sp, pl in zip(spec, plain)],
            "plain_gen_share": [r["gen_s"] / r["step_s"] for r in plain],
            "spec_steps_gated_plain": [r["steps_gated_plain"] for r in spec],
            "spec_drafter_s": [r["drafter_s"] for r in spec], **forced,
            "gate_cost_in_run": [r["gate_cost_in_run"] for r in spec],
            "goal": ">= 0.98 (speculation never makes the run slower); plain gen share >= 0.60"}


def step_matched(spec: dict, plain: dict) -> float | None:
    """The whole step, plain over spec, with every step in which the spec run did the plain run's work (it ran the
    step plainly and did not train its drafter) counted at the plain run's time: plain seconds over plain seconds
    plus what the spec run's other steps took beyond the plain run's same steps, over each round's pair. Only for a
    pair that wrote the same rollouts (else None): then such a step is the same computation on the same tokens in
    both runs, and its time difference is the host's (two processes on a 2-core VM, doing identical work, differ by
    a few per cent over a run), not speculation's. A run the gate does not run (every step speculates) is all
    other steps, and this is the plain ratio."""
    if not same_rollouts(spec, plain):
        return None
    plain_s = extra = 0.0
    for a, b in zip(spec.get("rounds") or [spec], plain.get("rounds") or [plain]):
        plain_s += sum(b["step_curve"])
        extra += sum(x - y for x, y, on, trained in zip(a["step_curve"], b["step_curve"], a["speculate_curve"],
                                                        a["drafter_curve"]) if on is not False or trained is not None)
    return plain_s / (plain_s + extra)


def same_rollouts(spec: dict, plain: dict) -> bool:
    """Whether a spec run and its plain pair generated the same rollouts and learned the same: every step's token
    count and mean reward, and every held-out accuracy, equal. On the CPU the embedded engine draws each position's
    token with that position's uniform whether it speculates or not, so a pair must; where it does not, the whole
    step's ratio also measures a difference of trajectories."""
    return all(spec[key] == plain[key] for key in ("gen_tokens_curve", "reward_curve", "eval_curve"))


def per_token(spec: list[dict], plain: list[dict]) -> dict:
    """The gen-stage ratio per generated token, and over the steps in which the spec run drafted nothing. Where a
    spec run and its plain pair do not write the same tokens (`same_rollouts`), their policies, and the lengths of
    what they write, drift apart over a run: seconds per token takes the lengths out of the ratio."""
    rate = lambda r: r["gen_tokens"] / r["gen_s"]  # noqa: E731
    out = {"per_token_paired": [rate(sp) / rate(pl) for sp, pl in zip(spec, plain)],
           "per_token_pooled": (sum(r["gen_tokens"] for r in spec) / sum(r["gen_s"] for r in spec))
           / (sum(r["gen_tokens"] for r in plain) / sum(r["gen_s"] for r in plain)), "without_drafting": []}
    for sp, pl in zip(spec, plain):
        steps = [i for i, tau in enumerate(sp["tau_curve"]) if tau is None]
        sums = {name: [sum(r[key][i] for i in steps) for key in ("gen_curve", "gen_tokens_curve")]
                for name, r in (("spec", sp), ("plain", pl))}
        some = bool(steps)  # a spec run that drafted in every step has no such steps
        out["without_drafting"].append({
            "seed": sp["seed"], "steps": len(steps), "gen_s_spec": sums["spec"][0], "gen_s_plain": sums["plain"][0],
            "plain_over_spec": sums["plain"][0] / sums["spec"][0] if some else None,
            "per_token": (sums["spec"][1] / sums["spec"][0]) / (sums["plain"][1] / sums["plain"][0]) if some else None})
    return out


def summarize_dirs(dirs: list[str], window: int, out: str | None, where: str) -> int:
    """First/last-window acceptance, agreement and eval of finished runs, with the settings they ran with."""
    import yaml

    from megatron_spec.rl.logging import read_metrics

    runs = []
    for d in map(Path, dirs):
        rows = read_metrics(d)
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        s = summarize({"variant": d.name, "seed": cfg["run"]["seed"], "wall_s": None, "rows": rows}, window)
        drafter = cfg["drafter_train"]
        s.update(lr=cfg["grpo"]["lr"], online=drafter["online"], adaptive=(cfg["spec"] or {}).get("adaptive"),
                 drafter_lr=drafter["lr"], drafts=drafter.get("drafts", 1), updates=drafter.get("updates", 1),
                 replay=drafter.get("replay", 1), minibatches=drafter.get("minibatches", 1),
                 tau_ratio=s["tau_last"] / s["tau_first"] if s["tau_first"] else None)
        runs.append(s)
        tau = "-" if s["tau_ratio"] is None else f"{s['tau_first']:.3f} -> {s['tau_last']:.3f} ({s['tau_ratio']:.3f})"
        print(f"{d.name}: lr {s['lr']} online {s['online']} (drafter lr {s['drafter_lr']}, drafts {s['drafts']}, "
              f"updates {s['updates']}, replay {s['replay']}, minibatches {s['minibatches']})  tau {tau}  "
              f"eval {s['eval_before']} -> {s['eval_after']:.3f}  train {s['train_s']:.1f}s")
    if out:
        Path(out).write_text(json.dumps({"machine": where, "window": window, "runs": runs}, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--drafter-seeds", type=int, nargs="*", default=[0],
                   help="seeds of the online/frozen pair (fixed k) for the drafter-freshness claim (none: no pair)")
    p.add_argument("--window", type=int, default=10, help="steps averaged at the start and at the end")
    p.add_argument("--runs-dir", default="runs/main_job_bench")
    p.add_argument("--out", default=None, help="JSON to write")
    p.add_argument("--reuse", action="store_true",
                   help="read the runs of the plan already finished under --runs-dir instead of running them again")
    p.add_argument("--summarize", nargs="+", metavar="RUN_DIR",
                   help="summarize finished runs (their metrics.jsonl and config.yaml) instead of running the plan")
    p.add_argument("--check", metavar="GROUP", default=None,
                   help="then check the published claims of GROUP (main_job_avx2, main_job_avx512: "
                        "benchmarks/claims.py) on this run's record; exit 1 if one fails")
    p.add_argument("--together", action="store_true",
                   help="run each pair (spec and plain of a seed; online and frozen) at the same time, one torch "
                        "thread each (pass run.threads=1), instead of back to back")
    p.add_argument("--swap-cores", action="store_true",
                   help="with --together: run each pair twice, each run pinned to one of CPU cores 0 and 1 and the "
                        "cores swapped the second time, and add the rounds, so that what one core's place costs (a "
                        "host's interrupts, its other work) falls on both runs alike")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = p.parse_args(argv)
    if args.swap_cores and not args.together:
        p.error("--swap-cores pins the two runs of a pair that run together: pass --together too")
    if __package__:  # imported as benchmarks.main_job
        from .claims import CLAIMS, check_record
    else:  # run as a script: its folder is on sys.path
        from claims import CLAIMS, check_record
    from megatron_spec.bench.common import machine

    if args.check and args.check not in {c.group for c in CLAIMS if c.group.startswith("main_job")}:
        p.error(f"--check {args.check}: the main job's claim groups are main_job_avx2, main_job_avx512 and "
                "main_job_gen_share")

    if args.summarize:
        return summarize_dirs(args.summarize, args.window, args.out, machine())

    runs_dir = Path(args.runs_dir)
    # spec and plain back to back, in alternating order, so that the host's load drifts hit both alike; with
    # --together each pair runs at the same time (one thread each), so the load hits both at once
    pairs = [[(v, s) for v in (("spec", "plain") if i % 2 == 0 else ("plain", "spec"))] for i, s in enumerate(args.seeds)]
    pairs += [[(v, s) for v in ("online", "frozen")] for s in args.drafter_seeds]
    plan = pairs if args.together else [[one] for pair in pairs for one in pair]
    rounds = [[0, 1], [1, 0]] if args.swap_cores else [None]
    runs = []
    for group in plan:
        by_round = []
        for cores in rounds:
            by_round.append([summarize(result, args.window)
                             for result in run_together(group, runs_dir, args.overrides, args.reuse, cores)])
            for summary in by_round[-1]:
                wall = "-" if summary["wall_s"] is None else f"{summary['wall_s']:.0f}s"
                core = "" if summary["core"] is None else f" core {summary['core']}"
                print(f"{summary['variant']:>6} seed {summary['seed']}{core}: eval {summary['eval_before']:.3f} -> "
                      f"{summary['eval_after']:.3f}  gen {summary['gen_s']:.1f}s train {summary['train_s']:.1f}s "
                      f"(drafter {summary['drafter_s']:.1f}s) step {summary['step_s']:.1f}s wall {wall}  "
                      f"tau {summary['tau_first'] or float('nan'):.2f} -> {summary['tau_last'] or float('nan'):.2f}",
                      flush=True)
        runs += by_round[0] if len(by_round) == 1 else [merge_rounds(a, b) for a, b in zip(*by_round)]

    def of(variant):
        return [r for r in runs if r["variant"] == variant]

    gains = {v: [r["eval_after"] - r["eval_before"] for r in of(v)] for v in ("spec", "plain")}
    paired = [pl["gen_s"] / sp["gen_s"] for sp, pl in zip(of("spec"), of("plain"))]
    fresh = {v: [r["tau_last"] / r["tau_first"] for r in of(v)] for v in ("online", "frozen")}
    claims = {
        "learns": {"mean_gain_spec": mean(gains["spec"]), "mean_gain_plain": mean(gains["plain"]),
                   "gains_spec": gains["spec"], "gains_plain": gains["plain"], "goal": ">= 0.15 (mean of seeds)"},
        "drafter_freshness": {"tau_last_over_first_online": fresh["online"], "tau_last_over_first_frozen":
                              fresh["frozen"], "goal": "frozen < 0.90, online >= 0.97"},
        "gen_speedup": {"paired": paired, "pooled": sum(r["gen_s"] for r in of("plain"))
                        / sum(r["gen_s"] for r in of("spec")), "goal": ">= 1.3"},
    }
    claims["gen_speedup"].update(per_token(of("spec"), of("plain")))
    claims["whole_step"] = whole_step(of("spec"), of("plain"), of("online"), of("frozen"))
    print(json.dumps(claims, indent=1))
    w = claims["whole_step"]
    for seed, whole, tok, gen, share, matched in zip(args.seeds, w["paired"], w["per_token_paired"], paired,
                                                     w["plain_gen_share"], w["step_matched"]):
        same = "rollouts differ" if matched is None else f"the same rollouts, step-matched {matched:.3f}x"
        print(f"seed {seed}: whole step (plain / spec) {whole:.3f}x ({tok:.3f}x per generated token), gen stage "
              f"{gen:.3f}x, gen share of the plain step {share:.2f}, {same}")
    print(f"pooled: whole step {w['pooled']:.3f}x, gen stage {claims['gen_speedup']['pooled']:.3f}x")
    record = {"machine": machine(), "command": "python recipes/tiny_grpo_spec.py run.seed=S " + " ".join(
        args.overrides), "variants": VARIANTS, "window": args.window, "together": args.together,
        "swap_cores": args.swap_cores, "claims": claims,
        **run_settings(runs_dir, plan[0][0]), "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    if args.check:
        lines = check_record(args.check, record)
        print("\n".join(lines))
        return 1 if any(line.startswith("FAIL") for line in lines) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
