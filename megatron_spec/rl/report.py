"""`megatron-spec report RUN_DIR [--compare OTHER_RUN_DIR ...] [--out FILE.html]`.

Reads `metrics.jsonl` and `config.yaml` of each run and writes one HTML page with PNG plots next to it (in
`<out stem>_plots/`, referenced relatively, so the folder can be copied as is):

  - reward and accuracy over steps, all runs overlaid;
  - stage-time stacks per step (data / prepare / gen / logprob / train), one panel per run;
  - acceptance length per step of the speculative runs (online and frozen drafters together), and the first
    draft's acceptance beside the drafter's agreement with the policy (measured even on steps that did not draft);
  - generation speedup per step: gen-stage tokens/s of a spec run over that of a plain run at the same step;
  - losslessness: the min-max band over seeds of the plain runs' reward with the spec runs overlaid, a table of
    last-10-step mean rewards against the plain seed-to-seed spread, and same-seed plain/spec pairs compared
    step by step (identical under greedy rollouts);
  - a summary table per run.

Plain runs are drawn in blues, spec runs with an online drafter in oranges, with a frozen drafter in greens.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path

from .logging import STAGES, read_metrics

TAIL = 10  # the losslessness table compares mean rewards over the last TAIL steps of each run


@dataclass
class Run:
    path: Path
    name: str
    kind: str  # "plain" or "spec"
    desc: str  # "plain" or "spec: mtp k=3 online" (", greedy" appended for temperature-0 rollouts)
    online: bool | None
    seed: int | None
    greedy: bool  # temperature-0 rollouts: spec and plain runs of one seed must then match exactly
    metrics: list[dict]

    @property
    def label(self) -> str:
        return f"{self.name} ({self.desc})"

    @property
    def steps(self) -> list[int]:
        return [m["step"] for m in self.metrics]

    def values(self, key: str) -> list[float]:
        return [_num(m.get(key)) for m in self.metrics]

    def gen_rate(self) -> dict[int, float]:
        """Tokens per second of the gen stage alone (not the whole step) at each step."""
        out = {}
        for m in self.metrics:
            gen_s = _num((m.get("stages") or {}).get("gen"))
            out[m["step"]] = _num(m.get("gen_tokens")) / gen_s if gen_s > 0 else _num(m.get("tokens_per_s"))
        return out


def load_run(path: str | Path) -> Run:
    import yaml

    path = Path(path)
    metrics = read_metrics(path)
    if not metrics:
        raise ValueError(f"{path}: metrics.jsonl has no steps yet")
    cfg_path = path / "config.yaml"
    cfg = (yaml.safe_load(cfg_path.read_text()) or {}) if cfg_path.is_file() else {}
    if "spec" in cfg:
        spec = cfg["spec"]
    else:  # no config: a run that measured acceptance speculated
        spec = {} if any(m.get("acceptance_length") is not None for m in metrics) else None
    online = None
    if spec is None:
        kind, desc = "plain", "plain"
    else:
        # Only drafters with weights train online; for the lookup drafters "online" means nothing, so it is not shown.
        from ..drafters.registry import method_names

        if spec.get("method") not in method_names(weights=False):
            online = (cfg.get("drafter_train") or {}).get("online")
        k = spec.get("num_speculative_tokens", "?")
        desc = f"spec: {spec.get('method', '?')} k{'<=' if spec.get('adaptive') else '='}{k}"
        desc += {True: " online", False: " frozen"}.get(online, "")
        kind = "spec"
    greedy = (cfg.get("grpo") or {}).get("temperature") == 0
    desc += ", greedy" if greedy else ""
    seed = (cfg.get("run") or {}).get("seed")
    return Run(path, path.resolve().name, kind, desc, online, seed, greedy, metrics)


def load_runs(paths: list[str | Path]) -> list[Run]:
    runs = [load_run(p) for p in paths]
    names = [r.name for r in runs]
    for r in runs:  # two `seed0` directories under different parents: name them parent/seed0
        if names.count(r.name) > 1:
            r.name = f"{r.path.resolve().parent.name}/{r.name}"
    return runs


# -- numbers ------------------------------------------------------------------------------------------------------

def speedups(runs: list[Run]) -> dict[str, tuple[str, dict[int, float]]]:
    """Per spec run: (baseline description, {step: gen-stage tokens/s over the plain baseline's}).

    The baseline is the plain run with the same seed (same prompts in the same order) when there is one,
    otherwise the mean over all plain runs at that step. Empty without a plain run."""
    plains = [r for r in runs if r.kind == "plain"]
    out = {}
    for r in runs:
        if r.kind != "spec" or not plains:
            continue
        same = [p for p in plains if r.seed is not None and p.seed == r.seed]
        base = same[:1] or plains
        rates = [p.gen_rate() for p in base]
        ratios = {}
        for step, rate in r.gen_rate().items():
            ref = [x[step] for x in rates if step in x and x[step] > 0]
            if ref:
                ratios[step] = rate / (sum(ref) / len(ref))
        out[r.name] = (base[0].name if same else f"mean of {len(plains)} plain runs", ratios)
    return out


def lossless_table(runs: list[Run], tail: int = TAIL) -> dict:
    """Last-`tail`-step mean reward per run, and for each spec run whether it lies in the plain runs' [min, max]
    and how far outside, in units of that spread (so 'just outside' and 'far off' read differently)."""
    tails = {r.name: _mean(r.values("reward_mean")[-tail:]) for r in runs}
    plain = [tails[r.name] for r in runs if r.kind == "plain"]
    lo, hi = (min(plain), max(plain)) if plain else (math.nan, math.nan)
    spec = {}
    for r in (r for r in runs if r.kind == "spec"):
        t = tails[r.name]
        gap = max(lo - t, t - hi, 0.0)
        spec[r.name] = {"tail": t, "within": lo <= t <= hi, "outside": gap / (hi - lo) if hi > lo else math.nan}
    return {"tails": tails, "plain_min": lo, "plain_max": hi, "plain_spread": hi - lo, "n_plain": len(plain),
            "spec": spec}


def same_seed_pairs(runs: list[Run]) -> list[dict]:
    """Spec runs next to the plain run of the same seed and the same rollout mode (a greedy run is never compared
    with a sampled one): with greedy rollouts every column must be zero."""
    out = []
    for r in (r for r in runs if r.kind == "spec" and r.seed is not None):
        for p in (p for p in runs if p.kind == "plain" and p.seed == r.seed and p.greedy == r.greedy):
            a, b = {m["step"]: m for m in r.metrics}, {m["step"]: m for m in p.metrics}
            common = sorted(set(a) & set(b))
            row = {"spec": r.name, "plain": p.name, "steps": len(common), "greedy": r.greedy and p.greedy}
            for key in ("reward_mean", "gen_tokens", "loss"):
                row[key] = max((_absdiff(a[s].get(key), b[s].get(key)) for s in common), default=math.nan)
            row["identical"] = bool(common) and all(row[k] == 0 for k in ("reward_mean", "gen_tokens", "loss"))
            out.append(row)
    return out


def stage_ratios(plain: list[dict], spec: list[dict]) -> dict:
    """Plain over speculative seconds, summed over the steps both runs logged: the gen stage alone and the whole step
    (every stage; the online drafter's training is part of the train stage), with the plain step's generation share
    (what bounds any gen-stage gain: at share R a gen stage S times faster gives at most 1 / (R / S + 1 - R)), the
    drafter's training seconds, and how many speculative-run steps the whole-step gate ran plainly. Rows are steps'
    metrics (`stages`, optional `drafter_s` and `speculate`)."""
    a, b = {m["step"]: m for m in plain}, {m["step"]: m for m in spec}
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("the two runs share no step")

    def total(rows: dict, stage: str | None) -> float:
        return sum((sum(st.values()) if stage is None else st.get(stage, 0.0))
                   for st in ((rows[i].get("stages") or {}) for i in common))

    gen_p, gen_s, step_p, step_s = total(a, "gen"), total(b, "gen"), total(a, None), total(b, None)
    return {"steps": len(common), "gen_ratio": gen_p / gen_s, "step_ratio": step_p / step_s,
            "plain_gen_share": gen_p / step_p, "drafter_s": sum(b[i].get("drafter_s") or 0.0 for i in common),
            "plain_steps_gated": sum(b[i].get("speculate") is False for i in common)}


def whole_step_pairs(runs: list[Run]) -> list[dict]:
    """Each speculative run beside the plain run of its seed (`stage_ratios`)."""
    out = []
    for r in (r for r in runs if r.kind == "spec" and r.seed is not None):
        for p in (p for p in runs if p.kind == "plain" and p.seed == r.seed and p.greedy == r.greedy):
            out.append({"spec": r.name, "plain": p.name, **stage_ratios(p.metrics, r.metrics)})
    return out


def _eval_before(r: Run) -> float:
    """Held-out accuracy of the policy as loaded (logged with step 0); NaN for a resumed run or one without it."""
    return _num(r.metrics[0].get("eval_accuracy_before")) if r.metrics else math.nan


def summary_rows(runs: list[Run]) -> list[dict]:
    sp = speedups(runs)
    rows = []
    for r in runs:
        evals = [v for v in r.values("eval_accuracy") if not math.isnan(v)]
        before = _eval_before(r)
        rows.append({
            "run": r.label, "steps": len(r.metrics),
            **{s: _mean([_num((m.get("stages") or {}).get(s)) for m in r.metrics]) for s in STAGES},
            "step_time": _mean(r.values("step_time")), "tokens_per_s": _mean(r.values("tokens_per_s")),
            "acceptance": _mean(r.values("acceptance_length")),
            "speedup": _mean(list(sp[r.name][1].values())) if r.name in sp else math.nan,
            "reward_tail": _mean(r.values("reward_mean")[-TAIL:]),
            "eval_start": before if not math.isnan(before) else evals[0] if evals else math.nan,
            "eval_final": evals[-1] if evals else math.nan,
        })
    return rows


# -- plots (matplotlib's Agg canvas, no pyplot state) -------------------------------------------------------------

def _figure(w: float, h: float, nrows: int = 1, ncols: int = 1, **kw):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False, **kw)


def _colors(runs: list[Run]) -> dict[str, tuple]:
    from matplotlib import colormaps

    families = {}
    for r in runs:
        cmap = "Blues" if r.kind == "plain" else {True: "Oranges", False: "Greens"}.get(r.online, "Purples")
        families.setdefault(cmap, []).append(r.name)
    out = {}
    for cmap, names in families.items():
        for i, name in enumerate(names):  # shades from mid to dark, so the lightest is still readable
            out[name] = colormaps[cmap](0.5 + 0.4 * i / (len(names) - 1) if len(names) > 1 else 0.75)
    return out


def plot_reward_accuracy(runs, colors, path: Path) -> None:
    fig, ax = _figure(12, 4, 1, 2)
    for r in runs:
        c = colors[r.name]
        ax[0, 0].plot(r.steps, r.values("reward_mean"), color=c, label=r.label)
        ax[0, 1].plot(r.steps, r.values("accuracy"), color=c)
        ev = [(s, v) for s, v in zip(r.steps, r.values("eval_accuracy")) if not math.isnan(v)]
        before = _eval_before(r)
        if not math.isnan(before):  # the policy as loaded, drawn at step -1 (before step 0's update)
            ev.insert(0, (-1, before))
        if ev:
            ax[0, 1].plot(*zip(*ev), color=c, ls="--", marker="o", ms=4)
    _style(ax[0, 0], "mean reward of the step's rollouts", "reward")
    # Colours match the reward panel, so this legend only explains the two line styles.
    ax[0, 1].plot([], [], color="k", label="rollouts of the step")
    ax[0, 1].plot([], [], color="k", ls="--", marker="o", ms=4, label="held-out eval (greedy)")
    _style(ax[0, 1], "accuracy", "accuracy")
    fig.savefig(path, dpi=100)


def plot_stage_times(runs, path: Path) -> None:
    ncols = 1 if len(runs) == 1 else 2
    nrows = math.ceil(len(runs) / ncols)
    fig, ax = _figure(6 * ncols, 2.6 * nrows + 0.6, nrows, ncols, sharey=True)
    colors = dict(zip(STAGES, ("#9e9e9e", "#8c6bb1", "#e6550d", "#3182bd", "#31a354")))
    for i, r in enumerate(runs):
        a = ax[i // ncols, i % ncols]
        bottom = [0.0] * len(r.metrics)
        for s in STAGES:
            h = [_num((m.get("stages") or {}).get(s), 0.0) for m in r.metrics]
            a.bar(r.steps, h, bottom=bottom, color=colors[s], label=s, width=0.85)
            bottom = [b + x for b, x in zip(bottom, h)]
        a.set_title(r.label, fontsize=9)
        _step_axis(a)
        a.set_ylabel("seconds")
    for j in range(len(runs), nrows * ncols):
        ax[j // ncols, j % ncols].set_visible(False)
    fig.legend(*ax[0, 0].get_legend_handles_labels(), loc="outside upper center", ncols=len(STAGES), fontsize=9)
    fig.savefig(path, dpi=100)


def plot_acceptance(spec_runs, colors, path: Path) -> None:
    """Left: acceptance length measured in the rollouts (gaps where the adaptive controller kept speculation off).
    Right: the first draft's acceptance rate, measured (dots) and as the drafter's agreement with the policy on
    the train batch predicts it (line, every step whether or not it drafted): a drafter going stale shows there."""
    fig, ax = _figure(14, 4, 1, 2)
    for r in spec_runs:
        ls = "--" if r.online is False else "-"
        ax[0, 0].plot(r.steps, r.values("acceptance_length"), color=colors[r.name], ls=ls, label=r.label)
        first = [_num((m.get("accepted_per_pos") or [None])[0]) for m in r.metrics]
        agree = [_num((m.get("drafter_agreement") or [None])[0]) for m in r.metrics]
        ax[0, 1].plot(r.steps, first, color=colors[r.name], ls="none", marker=".", label=f"{r.name} measured")
        if not all(math.isnan(a) for a in agree):
            ax[0, 1].plot(r.steps, agree, color=colors[r.name], ls=ls, label=f"{r.name} agreement")
    _style(ax[0, 0], "acceptance length (tokens per target forward): online solid, frozen dashed", "tokens")
    _style(ax[0, 1], "first draft accepted: measured (dots), drafter agreement on the train batch (lines)", "rate")
    fig.savefig(path, dpi=100)


def plot_speedup(runs, colors, sp, path: Path) -> None:
    fig, ax = _figure(8, 4)
    for r in runs:
        if r.name in sp and sp[r.name][1]:
            steps = sorted(sp[r.name][1])
            ax[0, 0].plot(steps, [sp[r.name][1][s] for s in steps], color=colors[r.name],
                          ls="--" if r.online is False else "-", label=f"{r.label} vs {sp[r.name][0]}")
    ax[0, 0].axhline(1.0, color="k", lw=0.8)
    _style(ax[0, 0], "generation speedup: gen-stage tokens/s, spec over plain", "speedup (x)")
    fig.savefig(path, dpi=100)


def plot_lossless(runs, colors, path: Path, window: int = 5) -> None:
    """Plain min-max band over seeds, raw per step (left) and as a trailing moving average (right)."""
    plains = [r for r in runs if r.kind == "plain"]
    steps = sorted(set.intersection(*(set(p.steps) for p in plains)))
    fig, ax = _figure(12, 4, 1, 2, sharey=True)
    for a, smooth in ((ax[0, 0], 1), (ax[0, 1], window)):
        curves = [_moving(dict(zip(p.steps, p.values("reward_mean"))), steps, smooth) for p in plains]
        a.fill_between(steps, [min(c) for c in zip(*curves)], [max(c) for c in zip(*curves)],
                       color=colors[plains[-1].name], alpha=0.25, label=f"plain: min-max over {len(plains)} seeds")
        a.plot(steps, [sum(c) / len(c) for c in zip(*curves)], color=colors[plains[-1].name], ls=":",
               label="plain: mean over seeds")
        for r in (r for r in runs if r.kind == "spec"):
            a.plot(r.steps, _moving(dict(zip(r.steps, r.values("reward_mean"))), r.steps, smooth),
                   color=colors[r.name], label=r.label)
        _style(a, "reward per step" if smooth == 1 else f"reward, moving average over {smooth} steps", "reward")
    fig.savefig(path, dpi=100)


def _style(a, title: str, ylabel: str) -> None:
    a.set_title(title, fontsize=10)
    _step_axis(a)
    a.set_ylabel(ylabel)
    a.grid(alpha=0.3)
    a.legend(fontsize=7)


def _step_axis(a) -> None:
    from matplotlib.ticker import MaxNLocator

    a.set_xlabel("step")
    a.xaxis.set_major_locator(MaxNLocator(integer=True))  # no "step 0.5" ticks on short runs


# -- HTML ---------------------------------------------------------------------------------------------------------

def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401  (a base dependency; a trimmed install may still lack it)
    except ImportError:
        return False
    return True


def write_report(run_dirs: list[str | Path], out: str | Path) -> Path:
    """The HTML report of `run_dirs` (the first is the main run) at `out`; without matplotlib, the summary table and
    a one-line hint instead of the plots (a report is never a traceback)."""
    runs = load_runs(run_dirs)
    out = Path(out)
    if not have_matplotlib():
        body = ["<p>Plots need matplotlib (<code>pip install matplotlib</code>, part of the base install); "
                "the summary follows.</p>", *_whole_step_html(runs), "<h2>Summary</h2>", _summary_html(runs),
                *_memory_html(runs)]
        return _write_html(out, runs, body)
    plots = out.parent / f"{out.stem}_plots"
    plots.mkdir(parents=True, exist_ok=True)
    colors, sp = _colors(runs), speedups(runs)
    spec_runs = [r for r in runs if r.kind == "spec"]

    def img(name: str, alt: str) -> str:
        return f'<img src="{plots.name}/{name}" alt="{alt}">'

    body = ["<h2>Reward and accuracy</h2>"]
    plot_reward_accuracy(runs, colors, plots / "reward_accuracy.png")
    body.append(img("reward_accuracy.png", "reward and accuracy over steps"))
    body.append("<h2>Stage times per step</h2>")
    plot_stage_times(runs, plots / "stage_times.png")
    body.append(img("stage_times.png", "stage-time stacks per step"))
    body.append("<h2>Acceptance length</h2>")
    if spec_runs:
        plot_acceptance(spec_runs, colors, plots / "acceptance.png")
        body.append(img("acceptance.png", "acceptance length per step"))
    else:
        body.append("<p>No speculative run in this report.</p>")
    body.append("<h2>Generation speedup</h2>")
    if sp:
        plot_speedup(runs, colors, sp, plots / "speedup.png")
        body.append(img("speedup.png", "generation speedup per step"))
    else:
        body.append("<p>Needs a plain run and a speculative run (<code>--compare</code>).</p>")
    body += _lossless_html(runs, colors, plots, img)
    body += _whole_step_html(runs)
    body += ["<h2>Summary</h2>", _summary_html(runs), *_memory_html(runs)]
    return _write_html(out, runs, body)


def _write_html(out: Path, runs: list[Run], body: list[str]) -> Path:
    title = f"megatron-spec report: {html.escape(runs[0].name)}"
    out.write_text(f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{title}</title>\n<style>{_CSS}</style>"
                   f"</head><body><h1>{title}</h1>\n<p>Runs: {', '.join(html.escape(r.label) for r in runs)}</p>\n"
                   + "\n".join(body) + "\n</body></html>\n", encoding="utf-8")
    return out


def plain_step(run, m: dict) -> bool:
    """Whether a step ran without speculation: every step of a plain run, the steps a gated run ran plainly."""
    return run.kind != "spec" or m.get("speculate") is False


def _whole_step_html(runs) -> list[str]:
    """The whole-step ratio beside the gen stage's, per same-seed pair, and what the gate decided."""
    out = ["<h2>Whole step</h2>"]
    shares = [[r.name, len(steps), _f(sum(m["stages"]["gen"] for m in steps)
                                      / sum(sum(m["stages"].values()) for m in steps), 3)]
              for r in runs if (steps := [m for m in r.metrics if plain_step(r, m)])]
    if shares:  # RL post-training's steps are mostly generation; speculation can only speed up that share
        out.append(_table(["run", "plain steps", "gen share of the plain step"], shares))
    pairs = whole_step_pairs(runs)
    if not pairs:
        return out + ["<p>The ratios need a speculative run and the plain run of its seed (<code>--compare</code>)."
                      "</p>"]
    out.append(_table(["spec run", "plain run", "steps", "plain gen share", "gen stage (plain / spec)",
                       "whole step (plain / spec)", "drafter training s", "steps run plainly by the gate"],
                      [[p["spec"], p["plain"], p["steps"], _f(p["plain_gen_share"], 3), _f(p["gen_ratio"], 3),
                        _f(p["step_ratio"], 3), _f(p["drafter_s"], 1), p["plain_steps_gated"]] for p in pairs]))
    out.append("<p>Seconds summed over the steps both runs logged; the whole step counts every stage, the online "
               "drafter's training included. Above 1: speculation made the step faster.</p>")
    for r in (r for r in runs if r.kind == "spec"):
        gated = [m for m in r.metrics if m.get("speculate") is not None]
        off = sum(m["speculate"] is False for m in gated)
        cut = sum(bool(m.get("drafter_cut")) for m in gated)
        if gated and gated[-1].get("gate_pays") is False:
            out.append(f"<p>{html.escape(r.name)}: speculation did not pay for the whole step on this host once the "
                       f"drafter's training was counted (per token {_f(gated[-1].get('gate_spec_cost'), 6)} s "
                       f"speculative against {_f(gated[-1].get('gate_plain_cost'), 6)} s plain), so the gate ran "
                       f"{off} of {len(r.metrics)} steps plainly, without drafting or drafter training"
                       + (f"; {cut} of its {len(gated) - off} speculative steps stopped the drafter's training once "
                          "it had taken what their generation saved" if cut else "") + ".</p>")
    return out


def _lossless_html(runs, colors, plots, img) -> list[str]:
    out = ["<h2>Losslessness at the RL level</h2>"]
    pairs = same_seed_pairs(runs)
    if pairs:
        out.append("<p>Same seed, plain vs speculative: with greedy rollouts every difference must be 0 (identical "
                   "trajectories and losses); with sampling the random streams differ and only the curves below "
                   "are comparable.</p>")
        out.append(_table(["spec run", "plain run", "rollouts", "steps", "max |Δ reward|", "max |Δ gen tokens|",
                           "max |Δ loss|", "identical"],
                          [[p["spec"], p["plain"], "greedy" if p["greedy"] else "sampled", p["steps"],
                            _g(p["reward_mean"]), _g(p["gen_tokens"]), _g(p["loss"]), "yes" if p["identical"] else "no"]
                           for p in pairs]))
    # The band compares sampled runs: greedy runs have no seed-to-seed spread and would only blur it.
    runs = [r for r in runs if not r.greedy]
    spec_runs = [r for r in runs if r.kind == "spec"]
    n_plain = len(runs) - len(spec_runs)
    if n_plain < 2 or not spec_runs:
        out.append(f"<p>The seed-to-seed band needs at least 2 sampled plain runs and 1 sampled spec run "
                   f"(here {n_plain} plain, {len(spec_runs)} spec).</p>")
        return out
    plot_lossless(runs, colors, plots / "lossless.png")
    out.append(img("lossless.png", "plain reward band over seeds with spec runs overlaid"))
    t = lossless_table(runs)
    rows = []
    for r in runs:
        v = t["spec"].get(r.name)
        rows.append([r.label, _f(t["tails"][r.name], 4), "" if v is None else ("yes" if v["within"] else "no"),
                     "" if v is None else _f(v["outside"], 2)])
    rows.append(["plain seed-to-seed spread (max - min)", _f(t["plain_spread"], 4),
                 f"[{_f(t['plain_min'], 4)}, {_f(t['plain_max'], 4)}]", ""])
    out.append(_table(["run", f"mean reward, last {TAIL} steps", "spec run within plain range",
                       "outside by (plain spreads)"], rows))
    n = t["n_plain"]
    out.append(f"<p>Reading the verdict: a run exchangeable with the {n} plain seeds lands inside their "
               f"[min, max] with probability (n-1)/(n+1) = {(n - 1) / (n + 1):.0%}, so an occasional 'no' just "
               f"outside the range is expected; a spec run far outside it (several spreads) is not.</p>")
    return out


def _summary_html(runs) -> str:
    head = ["run", "steps", *[f"{s} s" for s in STAGES], "step s", "tokens/s", "acceptance", "gen speedup",
            f"reward (last {TAIL})", "eval acc: start -> final"]
    rows = [[r["run"], r["steps"], *[_f(r[s], 2) for s in STAGES], _f(r["step_time"], 2), _f(r["tokens_per_s"], 1),
             _f(r["acceptance"], 2), _f(r["speedup"], 2), _f(r["reward_tail"], 3),
             f"{_f(r['eval_start'], 3)} -> {_f(r['eval_final'], 3)}"] for r in summary_rows(runs)]
    return _table(head, rows) + "<p>Stage times, tokens/s, acceptance and speedup are means over steps.</p>"


def memory_rows(runs: list[Run]) -> list[dict]:
    """Per run, the largest per-step peak (MB) of each memory figure the steps logged (`memory.py`); a figure
    logged per rank or per process keeps one value per rank / process. Runs without memory figures are left out."""
    rows = []
    for r in runs:
        peaks: dict[str, list[float]] = {}
        for m in r.metrics:
            for key, value in (m.get("memory") or {}).items():
                values = value if isinstance(value, list) else [value]
                old = peaks.setdefault(key, [math.nan] * len(values))
                peaks[key] = [max(a, _num(b)) if not math.isnan(a) else _num(b) for a, b in zip(old, values)]
        if peaks:
            rows.append({"run": r.label, **peaks})
    return rows


def _memory_html(runs) -> list[str]:
    rows = memory_rows(runs)
    if not rows:
        return []
    keys = sorted({k for row in rows for k in row if k != "run"})
    cells = [[row["run"], *(" / ".join(_f(v, 0) for v in row.get(k, [])) for k in keys)] for row in rows]
    return ["<h2>Peak memory (MB)</h2>", _table(["run", *keys], cells),
            "<p>The largest per-step peak of each process over the run; per-rank figures are listed by rank.</p>"]


def _table(head, rows) -> str:
    th = "".join(f"<th>{html.escape(str(h))}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>\n" for row in rows)
    return f"<table><tr>{th}</tr>\n{trs}</table>"


_CSS = ("body{font-family:sans-serif;max-width:1250px;margin:2em auto;color:#222}img{max-width:100%}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
        "td:first-child,th:first-child{text-align:left}")


# -- small helpers -----------------------------------------------------------------------------------------------

def _num(value, default: float = math.nan) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _mean(values) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def _absdiff(a, b) -> float:
    a, b = _num(a), _num(b)
    return 0.0 if math.isnan(a) and math.isnan(b) else abs(a - b)


def _moving(by_step: dict[int, float], steps: list[int], window: int) -> list[float]:
    vals = [by_step.get(s, math.nan) for s in steps]
    return [_mean(vals[max(0, i - window + 1): i + 1]) for i in range(len(vals))]


def _f(x, digits: int) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _g(x) -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else f"{x:.3g}"


# -- command line ------------------------------------------------------------------------------------------------

def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="HTML page with plots of one or more RL runs",
                              description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="run directory with metrics.jsonl (and config.yaml)")
    p.add_argument("--compare", nargs="+", action="extend", default=[], metavar="OTHER_RUN_DIR",
                   help="more runs on the same plots (plain and spec, several seeds for the losslessness band)")
    p.add_argument("--out", default="", help="HTML file to write (default RUN_DIR/report.html)")
    p.add_argument("--compare-sim", default="", metavar="HARDWARE:GPUS",
                   help="also print measured stage times and memory peaks beside the simulator's for the config on "
                        "GPUS GPUs of HARDWARE (h100, h200, b200, gb200), e.g. h100:32 (megatron_spec/sim/compare.py)")
    p.add_argument("--sim-prompt-len", type=int, default=200, help="mean prompt tokens for --compare-sim")
    p.set_defaults(func=report_command)


def report_command(args) -> int:
    out = Path(args.out) if args.out else Path(args.run_dir) / "report.html"
    path = write_report([args.run_dir, *args.compare], out)
    print(f"wrote {path} (plots in {path.parent / (path.stem + '_plots')})")
    if args.compare_sim:
        from megatron_spec.sim.compare import compare_run

        print(compare_run(args.run_dir, args.compare_sim, args.sim_prompt_len))
    return 0
