"""`python -m megatron_spec.placement.bench`: the same RL run synchronous and with `async_lag=1`, side by side on
one Ray cluster, and the simulator's composition of a lag-1 step applied to the synchronous run's measured stages.

    python -m megatron_spec.placement.bench --config configs/tiny_grpo_spec.yaml --steps 8 \\
        --out runs/ray_bench/tiny.json backend.placement=colocated

Per run: wall seconds of the steps (Ray start and actor start-up excluded: they are in the first step, which is
left out), the median step time and stages, `policy_lag` per step. The prediction is
`megatron_spec.sim.pipeline.compose` (step = max(gen, data + logprob + train) + prepare at lag >= 1) on the
synchronous run's median stages: what overlapping generation with training can buy at best on this placement.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from types import SimpleNamespace


def median_stages(metrics: list[dict]) -> dict:
    return {s: statistics.median(m["stages"][s] for m in metrics) for s in metrics[0]["stages"]}


def run_one(cfg, out: Path, lag: int) -> dict:
    from ..metrics import read_metrics
    from .driver import train

    cfg.backend.async_lag, cfg.run.out_dir = lag, str(out)
    t0 = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t0
    metrics = read_metrics(out)
    rest = metrics[1:]  # the first step also starts the actors' work (allocations, first sync)
    return {"async_lag": lag, "wall_s_all_steps": wall, "steps": len(metrics),
            "median_step_s": statistics.median(m["step_time"] for m in rest),
            "mean_step_s": statistics.mean(m["step_time"] for m in rest),
            "median_stages_s": median_stages(rest), "policy_lag": [m["policy_lag"] for m in metrics],
            "weight_sync_bytes": metrics[-1]["weight_sync_bytes"],
            "weight_sync_s_median": statistics.median(m["weight_sync_s"] for m in rest),
            "logprob_mismatch_max": max((m["logprob_mismatch"] for m in metrics if m["logprob_mismatch"] is not None),
                                        default=None),
            "acceptance_length": [m["acceptance_length"] for m in metrics],
            "reward_mean": [m["reward_mean"] for m in metrics]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_spec.placement.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)

    from ..rl.overrides import apply_overrides, load_yaml
    from ..sim.pipeline import compose
    from . import require_ray

    out = Path(args.out)
    ray = require_ray()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        runs = []
        for lag in (0, 1):
            cfg = apply_overrides(load_yaml(args.config), [f"run.steps={args.steps}", "run.resume=false",
                                                          "run.eval_every=0", "run.report=false", *args.overrides])
            if cfg.backend.placement == "inline":
                cfg.backend.placement = "colocated"
            runs.append(run_one(cfg, out.with_suffix("") / f"lag{lag}", lag))
    finally:
        ray.shutdown()
    sync, lagged = runs
    predicted, _ = compose(SimpleNamespace(policy_lag=1), sync["median_stages_s"], sync["median_stages_s"]["gen"])
    result = {"config": args.config, "overrides": args.overrides, "placement": cfg.backend.placement,
              "generators": cfg.backend.generators, "machine": f"{platform.machine()}, {ray_cpus()} CPUs",
              "runs": runs, "async_over_sync_median_step": lagged["median_step_s"] / sync["median_step_s"],
              "sim_compose_lag1_step_s": predicted,
              "measured_over_predicted_lag1": lagged["median_step_s"] / predicted}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    return 0


def ray_cpus() -> int:
    import os

    return os.cpu_count() or 0


if __name__ == "__main__":
    raise SystemExit(main())
