"""The CPU as a simulator profile: the measured figures of `cpu_profile.py` and the constant set that goes with them.

The simulator's core (`megatron_spec.sim`) describes GPUs: a spec sheet (`Hardware`) and one set of efficiencies
(`Calibration`). Our eager embedded engine and trainer on a CPU need more: the cost of launching an operator, the
engine's Python per sequence, a cache-resident rate, a cost per output row, elementwise bandwidth, the trainer's
per-operator cost. `CpuHardware` adds those to `Hardware`; the rates are used as measured, so the efficiencies
are 1 (`CPU`), and nothing in either is fitted to a case.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_spec.sim.calibration import Calibration
from megatron_spec.sim.hardware import Hardware


@dataclass(frozen=True)
class CpuHardware(Hardware):
    op_overhead_s: float = 0.0
    """Host cost of launching one operator, seconds: our eager engine launches hundreds per forward (`counts.py`)."""
    seq_overhead_s: float = 0.0
    """The embedded engine's Python work per sequence per forward (token lists, acceptance, appending), seconds."""
    seq_layer_s: float = 0.0
    """Per sequence per decoder layer per forward (the KV-cache slot write by advanced indexing), seconds."""
    cache_bytes: float = 0.0
    """Last-level cache; a network whose weights fit in it streams at `cache_bw` instead (0: never)."""
    cache_bw: float = 0.0
    """Bandwidth of weight reads that hit the last-level cache, bytes/s."""
    cache_flops: float = 0.0
    """Matmul arithmetic rate when the weights are cache resident (no cold stream to wait on), FLOP/s."""
    row_s: float = 0.0
    """Cost per output row of a matrix product beyond its bytes and FLOPs (a horizontal reduction and store)."""
    dense_flops: float = 0.0
    """Matmul rate on training-sized products (thousands of rows), FLOP/s: the trainer's passes use it."""
    act_bw: float = 0.0
    """Bandwidth of elementwise operators on activation-sized tensors (norms, RoPE, SwiGLU, residual adds)."""
    attn_score_s: float = 0.0
    """Attention's cost per (query, key) score beyond its 4 x head_dim FLOPs (scale, mask, exponent, softmax)."""
    train_op_s: float = 0.0
    """Host cost of one operator of the trainer's step, autograd and the trainer's Python included, seconds."""
    train_work: float = 1.0
    """The trainer step's arithmetic and traffic over what `dense_flops`, `act_bw` and the attention figures give,
    measured on stand-in trainers (`cpu_eager.trainer_figures`): the CPU's counterpart of a training MFU."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("op_overhead_s", "seq_overhead_s", "seq_layer_s", "dense_flops", "act_bw", "attn_score_s",
                     "train_op_s", "train_work"):
            if getattr(self, name) < 0:
                raise ValueError(f"CpuHardware: {name} must be >= 0, got {getattr(self, name)}")

    def linear_rates(self, stored_bytes: float, dtype_bytes: float) -> tuple[float, float, float]:
        """(bandwidth, FLOP/s, seconds per output row) for matmuls over a network of `stored_bytes` of weights:
        the cache's rates when it all fits in the last-level cache, else the memory's."""
        if self.cache_bw and stored_bytes <= self.cache_bytes:
            return self.cache_bw, self.cache_flops or self.flops(dtype_bytes), 0.0
        return self.mem_bw, self.flops(dtype_bytes), self.row_s

    @staticmethod
    def roof(memory_s: float, compute_s: float) -> float:
        """A CPU does not overlap a kernel's memory stream with its arithmetic (time grows with the batch from 2
        rows on, well before the arithmetic alone would bind): they add up."""
        return memory_s + compute_s


# Measured rates are used as measured (efficiency 1); fixed costs are per operator and per sequence
# (`CpuHardware`), not per forward.
CPU = Calibration(
    mem_eff=1.0, gemm_eff=1.0, train_mfu=1.0, link_eff=1.0, collective_latency_s=0.0,
    forward_overhead_s=0.0, refit_eff=1.0, engine_wake_s=0.0,
)
