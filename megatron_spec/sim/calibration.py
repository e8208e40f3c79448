"""Every calibration constant of the simulator, in one place.

A hardware profile is a spec sheet; these factors say how much of it real software reaches. There is one set,
shared by H100, H200, B200 and GB200 and by every validation and projection. Nothing is fitted per case: changing
a number here moves every prediction, which is what the tests in `tests/sim` guard.

Where each GPU value comes from:

- `mem_eff` 0.80: decode kernels stream weights and KV at ~80 % of the HBM spec (STREAM-like copies reach 85-90 %
  on H100; GEMV-shaped decode kernels a little less).
- `gemm_eff` 0.60: skinny decode / verify GEMMs (64-2048 rows) reach ~60 % of the dense peak; large square GEMMs
  reach 70-80 %.
- `train_mfu` 0.40: Megatron-scale pretraining reports 40-50 % MFU; RL training with ragged sequence lengths,
  recomputation and a separate logprob pass sits at the low end.
- `link_eff` 0.70: bus bandwidth NCCL all-reduce / all-to-all reach relative to the link spec.
- `collective_latency_s` 10 us: a small NCCL all-reduce inside an NVLink domain.
- `forward_overhead_s` 1.5 ms: what one engine forward pass costs beyond its kernels (scheduler, input
  preparation, sampler and logprob bookkeeping, host-device synchronisation), paid by every target *and every
  draft* forward. This is the one constant not read off a public figure: it was set once so that the reference
  paper's RL-Zero k=3 gen time comes out right (README.md, "Validation"). Everything else -- the RL-Think column,
  the k sweep, the 235B projections, the tuner -- is predicted with the same value.
- `refit_eff` 0.25 and `engine_wake_s` 1.0: a bucketed weight refit reaches about a quarter of the link (gathers,
  name mapping, per-bucket synchronisation); waking a sleeping engine (KV re-allocation, CUDA-graph reuse) costs
  about a second.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Calibration:
    mem_eff: float
    """Fraction of the memory bandwidth decode kernels reach."""
    gemm_eff: float
    """Fraction of the dense matmul peak decode / verify / prefill GEMMs and attention reach."""
    train_mfu: float
    """Fraction of the dense peak the training and logprob passes reach (model FLOPs utilisation)."""
    link_eff: float
    """Fraction of the link bandwidth collectives reach."""
    collective_latency_s: float
    """Fixed cost of one collective call, seconds."""
    forward_overhead_s: float
    """Fixed cost of one engine forward beyond its kernels, seconds."""
    refit_eff: float
    """Fraction of the link bandwidth a bucketed weight refit reaches."""
    engine_wake_s: float
    """Fixed cost of waking a sleeping generation engine, seconds."""
    data_s_per_rollout: float = 5e-5
    """Host time per rollout for the `data` stage (batching prompts, scoring rewards), seconds."""

    def __post_init__(self) -> None:
        for name in ("mem_eff", "gemm_eff", "train_mfu", "link_eff", "refit_eff"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"Calibration.{name} must be in (0, 1], got {value}")
        for name in ("collective_latency_s", "forward_overhead_s", "engine_wake_s", "data_s_per_rollout"):
            if getattr(self, name) < 0:
                raise ValueError(f"Calibration.{name} must be >= 0, got {getattr(self, name)}")


GPU = Calibration(
    mem_eff=0.80, gemm_eff=0.60, train_mfu=0.40, link_eff=0.70, collective_latency_s=10e-6,
    forward_overhead_s=1.5e-3, refit_eff=0.25, engine_wake_s=1.0,
)
