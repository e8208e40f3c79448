"""The Hopper calibration's fit: a deterministic coordinate search on NeMo-RL's published H100 step times.

Loss: the sum over FIT_ROWS of log(simulated / published)^2, so a row 10 % slow and one 10 % fast weigh the same.
Search: start at the Blackwell set's values, then for each parameter in turn try it multiplied and divided by a
factor (1.25, then 1.1, 1.04, 1.015), keep any move that lowers the loss, and repeat at a factor until no move
does, within each parameter's bounds. No randomness: the same rows give the same constants, which
`calibration.HOPPER_FIT` holds (rounded) and tests/sim/test_published.py checks are still a local minimum.
The rows left out of FIT_ROWS check the result.

    python -m megatron_spec.sim.fit          # prints the fitted values and every row's ratio
"""

from __future__ import annotations

import math
from dataclasses import replace

from .calibration import GPU, Calibration
from .published import compare

FIT_ROWS = ("llama3.1-8b sync", "qwen3-32b 1-off", "qwen3-30b-a3b sync", "qwen3-30b-a3b 1-off",
            "qwen3-235b sync 128")
"""One row per model and the placements that pin each parameter: gen-bound sync rows of a dense, a small MoE and
a large MoE model (decode efficiency and per-forward overhead), a training-bound dense row (dense MFU) and an
asynchronous MoE row whose training side is near its gen side (MoE MFU)."""

PARAMS = {"decode_eff": (0.1, 1.0), "forward_overhead_s": (2e-4, 1e-2), "train_mfu": (0.15, 0.7),
          "train_mfu_moe": (0.05, 0.7)}
"""Fitted parameters and their bounds. `offload_eff` stays at the base set's 0.5 (the prepare stages are a few
seconds of steps of minutes: the rows cannot pin it); every other factor is the spec-sheet set's."""

FACTORS = (1.25, 1.1, 1.04, 1.015)


def loss(cal: Calibration, rows: tuple[str, ...] = FIT_ROWS) -> float:
    """Sum of squared log-ratios of simulated to published step time over `rows`."""
    return sum(math.log(c.ratio) ** 2 for c in compare(list(rows), cal=cal))


def with_params(base: Calibration, values: dict[str, float]) -> Calibration:
    return replace(base, **values)


def fit_calibration(base: Calibration = GPU, rows: tuple[str, ...] = FIT_ROWS,
                    start: dict[str, float] | None = None) -> tuple[dict[str, float], float]:
    """(fitted values, loss) by coordinate search from `start` (default: the base set's values; MoE MFU from the
    dense one)."""
    values = dict(start) if start else {
        "decode_eff": base.decode_eff, "forward_overhead_s": base.forward_overhead_s, "train_mfu": base.train_mfu,
        "train_mfu_moe": base.train_mfu_moe or base.train_mfu}
    best = loss(with_params(base, values), rows)
    for factor in FACTORS:
        improved = True
        while improved:
            improved = False
            for name, (lo, hi) in PARAMS.items():
                for f in (factor, 1 / factor):
                    trial = dict(values, **{name: min(max(values[name] * f, lo), hi)})
                    if trial[name] == values[name]:
                        continue
                    value = loss(with_params(base, trial), rows)
                    if value < best - 1e-12:
                        values, best, improved = trial, value, True
                        break
    return values, best


def main() -> None:
    values, best = fit_calibration()
    print("fitted:", {k: float(f"{v:.4g}") for k, v in values.items()}, f"loss {best:.5f}")
    for c in compare(cal=with_params(GPU, values)):
        print(f"  {'fit  ' if c.name in FIT_ROWS else 'check'} {c.name:22} {c.ratio:.3f}")


if __name__ == "__main__":
    main()
