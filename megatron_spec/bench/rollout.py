"""`megatron-spec bench rollout`: speculative vs plain decoding, measured side by side in one process.

For each drafter x batch size x k (1, 2, 3, 5 and adaptive): tokens/s, speedup over plain decoding of the same
prompts with the same seeds, mean acceptance length (tokens emitted per verify step, the bonus token included,
as the reference paper counts it) and per-position acceptance. Plus an "RL rollout" row: one GRPO rollout batch
(prompts x group size, sampled at temperature 1, stopping at EOS, so lengths are long-tailed), measured on the
second of two steps so the history drafter has the previous step's rollouts, as it would in training.
Speedups are medians of back-to-back ratios over `repeats` (plain and speculative runs alternating which goes
first), speeds best-of-`repeats`.

`--engine vllm` puts our engine and vLLM (the peer our users would otherwise pick) side by side instead: the same
target, drafters, prompts and sampling, plain and speculative at one k, on both engines in one run (see `peer_rows`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..drafters.registry import method_names

CONTROL = "plain"
"""`--drafters plain`: a plain engine measured against a plain engine, the same way as a drafter: the benchmark's own
noise floor, in the same run as the rows it qualifies (its speed-ups should all be 1)."""


def spec_method(drafter: str) -> str | None:
    return None if drafter == CONTROL else drafter


def make_engine(target, method: str | None, k: int | str, drafter_dir: str | None, max_num_seqs: int,
                draft_sampling: bool = False):
    from ..engine import LLMEngine
    from ..drafters.config import SpecConfig

    if method is None:
        return LLMEngine(target, max_num_seqs=max_num_seqs)
    adaptive = k == "adaptive"
    spec = SpecConfig(method, 5 if adaptive else int(k), model=drafter_dir, adaptive=adaptive,
                      draft_sampling=draft_sampling)
    return LLMEngine(target, max_num_seqs=max_num_seqs, spec=spec)


def measure(make_engine, make_plain, prompts, params, repeats: int, warm: list[tuple]) -> dict:
    """Tokens/s of a fresh speculative engine (a history drafter must never see the very rollout it is timed on)
    against a fresh plain engine, `repeats` times. Each engine first runs each of `warm`'s (prompts, params)
    untimed: in RL an engine lives across steps, so its caches are allocated and its adaptive controller calibrated
    before the rollout that counts. Both are fresh, so neither carries state the other lacks (a plain engine reused
    across repeats has run every timed rollout before).

    The two timed rollouts run step by step in turn (`interleaved`), so the ratio of one repeat compares the two
    engines over the same seconds. On a shared machine the load changes over seconds, by up to 30 % on this
    project's CPU: two whole rollouts run back to back (how this benchmark paired them before) gave single ratios
    spread over +-0.2 for engines that decode identically. `speedup` is the median of the repeats' ratios (all of
    them in `ratios`, with the drafts each repeat's timed rollout made in `drafted_per_repeat`: 0 where the controller
    kept speculation off); `tok_s` and `plain_tok_s` are best-of, for scale; the speculation summary is the last
    repeat's."""
    from statistics import median

    from ..speculative.stats import speculation_summary

    t_plain = t_spec = float("inf")
    ratios, drafted = [], []
    for r in range(repeats):
        engine, plain = make_engine(), make_plain()
        for rollout in warm:
            engine.generate(*rollout)
            plain.generate(*rollout)
        # Alternate which engine steps first, so neither always runs right after the untimed warm-ups.
        first = [engine, plain] if r % 2 == 0 else [plain, engine]
        times, results = interleaved(first, prompts, params)
        s, p = first.index(engine), first.index(plain)
        (ts, outs), (tp, ref) = (times[s], results[s]), (times[p], results[p])
        t_plain, t_spec = min(t_plain, tp), min(t_spec, ts)
        tokens = sum(len(o.token_ids) for o in outs)
        ref_tokens = sum(len(o.token_ids) for o in ref)
        ratios.append((tokens / ts) / (ref_tokens / tp))
        summary = speculation_summary(outs)
        drafted.append(summary["drafted"])
    return {"tok_s": tokens / t_spec, "plain_tok_s": ref_tokens / t_plain, "speedup": median(ratios),
            "speedup_range": [min(ratios), max(ratios)], "ratios": ratios, "drafted_per_repeat": drafted, **summary}


def interleaved(engines: list, prompts, params) -> tuple[list[float], list[list]]:
    """One rollout of `prompts` on each engine, one engine step of each in turn (in the order given, then reversed,
    and so on), until all have finished: the seconds each engine spent in its own work (`start` and its steps) and
    its completions. Each engine's steps are exactly those of its `generate`; only their timing is interleaved."""
    import time

    import torch

    from ..models.decoder import weights_fixed

    spent = [0.0] * len(engines)
    seqs = []
    for i, e in enumerate(engines):
        t0 = time.perf_counter()
        seqs.append(e.start(prompts, params))
        spent[i] += time.perf_counter() - t0
    order = list(range(len(engines)))
    with torch.inference_mode(), weights_fixed():  # as in `generate`
        while not all(e.scheduler.is_finished() for e in engines):
            for i in order:
                if not engines[i].scheduler.is_finished():
                    t0 = time.perf_counter()
                    engines[i].step()
                    spent[i] += time.perf_counter() - t0
            order.reverse()
    return spent, [[e.completion(s) for s in ss] for e, ss in zip(engines, seqs)]


def run(args) -> dict:
    import torch

    from ..engine import SamplingParams
    from ..models import from_pretrained
    from ..rl.train_drafter import task_prompts
    from .common import drafter_checkpoint, machine

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    # Drafters are loaded in the target's dtype, on its device.
    target = from_pretrained(args.target, dtype=dtype, device=args.device)

    def rl_batch(seed: int) -> list:
        prompts = task_prompts(args.target, args.rl_prompts, seed=seed, split="bench")
        return [p for p in prompts for _ in range(args.group)]

    def rl_params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=args.rl_max_tokens, seed=seed)

    # RL rollout: prompts x group, sampled to EOS (long tail), the step after one on the same prompts, after
    # `rl_warm` - 1 steps on others: an RL engine lives across steps, and its controller explores each batch-size
    # octave once. After one warm rollout of the tiny model (~30 steps of ~2 ms) that exploration would be most of
    # the timed rollout, so `--rl-warm` rollouts come first.
    rl_prompts = rl_batch(7)
    rl_warm = [(rl_batch(70 + i), rl_params(30 + i)) for i in range(args.rl_warm - 1)] + [(rl_prompts, rl_params(2))]
    rows = []
    for method in args.drafters:
        ddir = drafter_checkpoint(args.target, method, args.draft_model)
        if ddir is not None and not ddir.exists():
            print(f"  skip {method}: no drafter checkpoint at {ddir} (megatron-spec train-drafter makes one)")
            continue
        ddir = ddir and str(ddir)
        for batch in args.batch:
            prompts = task_prompts(args.target, batch, seed=1000 + batch, split="bench")
            params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=batch)
            # Warm-up on other prompts and seeds: nothing a lookup drafter learns there helps the timed run.
            warm = (task_prompts(args.target, batch, seed=2000 + batch, split="bench"),
                    SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=batch + 1))
            fresh_plain = lambda: make_engine(target, None, 0, None, batch)  # noqa: E731
            for k in ["-"] if method == CONTROL else args.k:
                fresh = lambda: make_engine(target, spec_method(method), k, ddir, batch, args.draft_sampling)  # noqa: E731
                row = {"drafter": method, "batch": batch, "k": str(k),
                       **measure(fresh, fresh_plain, prompts, params, args.repeats, [warm])}
                rows.append(row)
                print(f"  {method:12s} B={batch:3d} k={str(k):8s} {row['tok_s']:8.1f} tok/s  x{row['speedup']:.2f}  "
                      f"acc.len {row['acceptance_length'] or 0:.2f}")
        fresh_plain = lambda: make_engine(target, None, 0, None, len(rl_prompts))  # noqa: E731
        for k in ["-"] if method == CONTROL else args.rl_k:
            fresh = lambda: make_engine(target, spec_method(method), k, ddir, len(rl_prompts), args.draft_sampling)  # noqa: E731
            row = {"drafter": method, "batch": f"RL {args.rl_prompts}x{args.group}", "k": str(k),
                   **measure(fresh, fresh_plain, rl_prompts, rl_params(3), args.repeats, rl_warm)}
            rows.append(row)
            print(f"  {method:12s} RL rollout k={str(k):8s} x{row['speedup']:.2f}  acc.len {row['acceptance_length'] or 0:.2f}")
    return {"benchmark": "rollout", "target": args.target, "dtype": args.dtype, "draft_sampling": args.draft_sampling,
            "machine": machine(args.device), "device": args.device,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows}


def peer_rows(args, target) -> list[dict]:
    """Our engine and vLLM on the same target, drafters, prompts and sampling (T=1, EOS ignored, `max_tokens`
    each), plain and speculative with k = the first numeric `--k`. vLLM engines start once (one plain, one per
    drafter) and are warmed on other prompts like ours; each cell is best-of-`repeats` tokens/s, alternating the two
    engines. vLLM is imported by name through the backend, so this core module never imports it."""
    import importlib
    import tempfile

    from ..engine import SamplingParams
    from ..drafters.config import SpecConfig
    from ..drafters.registry import drafter_method, vllm_problem
    from ..speculative.stats import speculation_summary
    from ..rl.train_drafter import task_prompts
    from .common import drafter_checkpoint, timed

    backend = importlib.import_module("megatron_spec.generators.vllm")
    export = importlib.import_module("megatron_spec.generators.vllm.export")
    k = next(int(x) for x in args.k if x != "adaptive")
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    export.export_target(target, root / "policy")
    max_len = min(target.config.max_position_embeddings, 4096)
    engines = {None: backend.VLLMGenerator(str(root / "policy"), max_model_len=max_len)}
    dirs = {None: None}
    for method in args.drafters:
        if problem := vllm_problem(method):
            print(f"  skip {method}: {problem}")
            continue
        ddir = drafter_checkpoint(args.target, method, args.draft_model)
        if ddir is not None and not ddir.exists():
            print(f"  skip {method}: no drafter checkpoint at {ddir}")
            continue
        path = ddir and str(ddir)
        if ddir is not None:  # our drafter checkpoint in the layout vLLM loads
            path = str(export.export_drafter(drafter_method(method).load(ddir, target, "cpu"), root / method))
        engines[method] = backend.VLLMGenerator(str(root / "policy"), SpecConfig(method, k, model=path),
                                                max_model_len=max_len)
        dirs[method] = ddir and str(ddir)
    rows = []
    try:
        for batch in args.batch:
            prompts = task_prompts(args.target, batch, seed=1000 + batch, split="bench")
            warm = task_prompts(args.target, batch, seed=2000 + batch, split="bench")
            params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=batch)
            for method, theirs in engines.items():
                ours = make_engine(target, method, k, dirs[method], batch)
                ours.generate(warm, params)
                theirs.generate(warm, params)
                t_ours = t_vllm = float("inf")
                run_ours = lambda: timed(lambda: ours.generate(prompts, params))  # noqa: E731
                run_vllm = lambda: timed(lambda: theirs.generate(prompts, params))  # noqa: E731
                for r in range(args.repeats):
                    if r % 2 == 0:
                        (ta, out_ours), (tb, out_vllm) = run_ours(), run_vllm()
                    else:
                        (tb, out_vllm), (ta, out_ours) = run_vllm(), run_ours()
                    t_ours, t_vllm = min(t_ours, ta), min(t_vllm, tb)
                for engine, t, outs in (("ours", t_ours, out_ours), ("vllm", t_vllm, out_vllm)):
                    tokens = sum(len(o.token_ids) for o in outs)
                    rows.append({"engine": engine, "drafter": method or "plain", "batch": batch,
                                 "k": k if method else 0, "tok_s": tokens / t,
                                 "acceptance_length": speculation_summary(outs)["acceptance_length"]})
                print(f"  {method or 'plain':12s} B={batch:3d}  ours {rows[-2]['tok_s']:8.1f}  "
                      f"vllm {rows[-1]['tok_s']:8.1f} tok/s")
    finally:
        for gen in engines.values():
            gen.close()
    for row in rows:  # speedup of each engine over its own plain decoding at the same batch
        plain = next(r for r in rows if r["engine"] == row["engine"] and r["batch"] == row["batch"]
                     and r["drafter"] == "plain")
        row["speedup"] = row["tok_s"] / plain["tok_s"]
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if not str(r["batch"]).startswith("RL")]
    drafters = sorted({r["drafter"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], batches):
        for d in drafters:
            cells = [r for r in rows if r["drafter"] == d and r["batch"] == b]
            ax.plot([r["k"] for r in cells], [r["speedup"] for r in cells], marker="o", label=d)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"batch {b}")
        ax.set_xlabel("k")
    axes[0][0].set_ylabel("speedup over plain decoding")
    axes[0][-1].legend()
    fig.suptitle(f"bench rollout: {result['target']} {result.get('dtype', 'float32')} ({result['machine']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_peer(args) -> dict:
    import torch

    from ..models import from_pretrained
    from .common import machine

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    target = from_pretrained(args.target, dtype=dtype)
    return {"benchmark": "rollout-vs-vllm", "target": args.target, "dtype": args.dtype, "machine": machine(),
            "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": peer_rows(args, target)}


def main(args: argparse.Namespace) -> int:
    from ..rl.config import RunSection
    from .common import print_table, set_threads, write_json

    set_threads(args.threads)
    if args.rl_warm < 1:
        raise SystemExit(f"bench rollout: --rl-warm must be at least 1 (the step before the timed one), "
                         f"got {args.rl_warm}")
    if args.device != "cpu":  # checked before any model is loaded
        if args.engine == "vllm":
            raise SystemExit("bench rollout: --device applies to --engine ours (vLLM places its own engine)")
        try:
            RunSection(device=args.device).torch_device()
        except ValueError as e:
            raise SystemExit(f"bench rollout: {e}".replace("run.device", "--device")) from None
    if args.engine == "vllm":
        result = run_peer(args)
        print(f"bench rollout --engine vllm: {result['target']} ({result['dtype']}) on {result['machine']}")
        print_table(result["rows"], ["engine", "drafter", "batch", "k", "tok_s", "speedup", "acceptance_length"])
        print(f"wrote {write_json(args.out, result)}")
        return 0
    result = run(args)
    print(f"bench rollout: {result['target']} ({result['dtype']}) on {result['machine']}")
    print_table(result["rows"], ["drafter", "batch", "k", "tok_s", "plain_tok_s", "speedup", "acceptance_length"])
    out = write_json(args.out, result)
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="checkpoints/tiny-qwen3")
    p.add_argument("--drafters", nargs="+", default=list(method_names()),
                   help=f"drafters to measure; '{CONTROL}' measures plain against plain (the noise floor)")
    p.add_argument("--draft-model", default="checkpoints/tiny-draft", help="checkpoint of the draft_model drafter")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--k", nargs="+", default=["1", "2", "3", "5", "adaptive"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rl-prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--rl-max-tokens", type=int, default=160)
    p.add_argument("--rl-k", nargs="+", default=["3", "adaptive"])
    p.add_argument("--rl-warm", type=int, default=6,
                   help="untimed RL rollouts each engine runs before the timed one (the last on the same prompts)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--draft-sampling", action="store_true",
                   help="model drafters sample their drafts (their q enters verification) instead of their argmax")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights and activations of target and drafter; on CPUs with AVX512-BF16 a bf16 135M model "
                        "decodes in about the same time for 1 to 6 tokens per sequence (memory-bound), in float32 not")
    p.add_argument("--engine", choices=["ours", "vllm"], default="ours",
                   help="vllm: our engine and vLLM side by side, plain and speculative (needs the vllm extra)")
    p.add_argument("--device", default="cpu",
                   help="where target and drafters run (cpu, cuda, cuda:N); with --engine ours only")
    p.add_argument("--out", default="runs/bench/bench_rollout.json")
