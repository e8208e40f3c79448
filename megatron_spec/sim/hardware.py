"""Hardware profiles: what one accelerator (or this CPU) can do, from public spec sheets or a micro-benchmark.

The GPU figures are the public ones gathered in `../shared/ANCHORS.md` (dense BF16 FLOP/s, HBM size and bandwidth,
NVLink bandwidth per GPU). Figures that file does not list are marked "assumption" where they are set, with the
public source they come from; they only matter for collectives that leave an NVLink domain.

How much of these peaks real kernels reach is *not* stored here: that lives in `calibration.py`, one set of
factors shared by every GPU profile, so a profile stays a plain copy of a spec sheet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    """Profile name as the CLI spells it (h100, h200, b200, gb200, cpu)."""
    flops_bf16: float
    """Dense BF16 (or, for the CPU, measured FP32) matmul peak per device, FLOP/s."""
    mem_bw: float
    """Device memory bandwidth, bytes/s (HBM on GPUs, DRAM stream bandwidth on the CPU)."""
    mem_bytes: float
    """Device memory, bytes."""
    link_bw: float
    """Scale-up link bandwidth per device, bytes/s, both directions added (NVLink as vendors quote it)."""
    domain_size: int
    """Devices that share the scale-up link (8 in an HGX node, 72 in a GB200 NVL72 rack)."""
    net_bw: float
    """Scale-out bandwidth per device, bytes/s, one direction (InfiniBand / Ethernet NIC per GPU)."""
    fp8_speedup: float = 2.0
    """Dense FP8 over dense BF16 FLOP/s; 2x on Hopper and Blackwell spec sheets."""
    op_overhead_s: float = 0.0
    """Host cost of launching one operator, seconds (measured on the CPU, where our eager engine and trainer launch
    hundreds per forward: `eager.py` counts them). GPU engines replay CUDA graphs, so their launch costs are part of
    the per-forward `Calibration.forward_overhead_s` instead, and this stays 0."""
    seq_overhead_s: float = 0.0
    """Host cost per sequence per engine forward, seconds: the embedded engine's Python work per sequence (token
    lists, acceptance, appending); 0 on GPUs, where it is part of the per-forward overhead."""
    seq_layer_s: float = 0.0
    """Host cost per sequence per decoder layer per engine forward, seconds: the embedded engine writes each
    sequence's keys and values into its KV-cache slot by advanced indexing; 0 on GPUs."""
    is_gpu: bool = True
    """False for the CPU profile: the roofline then adds `op_overhead_s` per operator instead of a per-forward cost."""
    overlap: bool = True
    """Memory traffic and arithmetic of one kernel overlap, so it costs the larger of the two (GPUs). Without
    overlap they add up: what a single-socket CPU's small-batch GEMMs show (time grows with the batch from 2 rows
    on, well before the arithmetic alone would bind)."""
    cache_bytes: float = 0.0
    """Last-level cache; a network whose weights fit in it streams at `cache_bw` instead (0: never)."""
    cache_bw: float = 0.0
    """Bandwidth of weight reads that hit the last-level cache, bytes/s."""
    cache_flops: float = 0.0
    """Matmul arithmetic rate when the weights are cache resident (no cold stream to wait on), FLOP/s."""
    row_s: float = 0.0
    """Cost per output row of a matrix product beyond its bytes and FLOPs (a CPU's horizontal reduction and store
    per dot product; 0 on GPUs, where it hides under the memory stream)."""
    dense_flops: float = 0.0
    """Matmul rate on training-sized products (thousands of rows), FLOP/s; the CPU's trainer passes use it (GPUs
    use `flops_bf16` at the training MFU)."""
    act_bw: float = 0.0
    """Bandwidth of elementwise operators on activation-sized tensors (megabytes, fresh outputs), bytes/s: norms,
    RoPE, SwiGLU and residual adds of the CPU trainer's passes."""
    attn_score_s: float = 0.0
    """CPU attention's cost per (query, key) score beyond its 4 x head_dim FLOPs (scaling, mask, exponent,
    softmax), seconds; the engine's written-out attention and the trainer's fused kernel both pay it."""
    train_op_s: float = 0.0
    """Host cost of one operator of the CPU trainer's step, autograd's recording and backward scheduling and the
    trainer's Python included (`cpu_eager.trainer_figures`), seconds; 0 on GPUs."""
    train_work: float = 1.0
    """The CPU trainer step's arithmetic and traffic (products, attention, elementwise, optimizer) over what
    `dense_flops`, `act_bw` and the attention figures give, measured on stand-in trainers
    (`cpu_eager.trainer_figures`): the CPU's counterpart of a training MFU. 1 on GPUs."""

    def __post_init__(self) -> None:
        for field in ("flops_bf16", "mem_bw", "mem_bytes", "link_bw", "net_bw", "fp8_speedup"):
            if getattr(self, field) <= 0:
                raise ValueError(f"Hardware {self.name!r}: {field} must be > 0, got {getattr(self, field)}")
        if self.domain_size < 1:
            raise ValueError(f"Hardware {self.name!r}: domain_size must be >= 1, got {self.domain_size}")
        for field in ("op_overhead_s", "seq_overhead_s", "seq_layer_s", "dense_flops", "act_bw", "attn_score_s",
                      "train_op_s", "train_work"):
            if getattr(self, field) < 0:
                raise ValueError(f"Hardware {self.name!r}: {field} must be >= 0, got {getattr(self, field)}")

    def linear_rates(self, stored_bytes: float, dtype_bytes: float) -> tuple[float, float, float]:
        """(bandwidth, FLOP/s, seconds per output row) for matmuls over a network of `stored_bytes` of weights:
        the cache's rates when it all fits in the last-level cache, else the memory's."""
        if self.cache_bw and stored_bytes <= self.cache_bytes:
            return self.cache_bw, self.cache_flops or self.flops(dtype_bytes), 0.0
        return self.mem_bw, self.flops(dtype_bytes), self.row_s

    def roof(self, memory_s: float, compute_s: float) -> float:
        """Time of a kernel from its memory and arithmetic times: max when they overlap, sum when not."""
        return max(memory_s, compute_s) if self.overlap else memory_s + compute_s

    def flops(self, dtype_bytes: float) -> float:
        """Dense matmul peak for weights of `dtype_bytes` bytes (1 = FP8, 2 = BF16, 4 = the CPU's FP32)."""
        return self.flops_bf16 * (self.fp8_speedup if dtype_bytes == 1 else 1.0)

    def collective_bw(self, group: int) -> float:
        """One-direction bandwidth a collective over `group` devices gets per device: the scale-up link inside a
        domain (half the quoted bidirectional figure), the NIC once the group spans domains."""
        return self.link_bw / 2 if group <= self.domain_size else self.net_bw


# Inter-node figures (assumption, not in ANCHORS.md): one 400 Gb/s NIC per GPU on HGX H100/H200 (NVIDIA DGX
# reference architecture), one 800 Gb/s NIC per GPU on Blackwell systems (ConnectX-8). 400 Gb/s = 50 GB/s.
GPU_PROFILES: dict[str, Hardware] = {
    "h100": Hardware("h100", flops_bf16=989e12, mem_bw=3.35 * TB, mem_bytes=80 * GB, link_bw=900 * GB,
                     domain_size=8, net_bw=50 * GB),
    "h200": Hardware("h200", flops_bf16=989e12, mem_bw=4.8 * TB, mem_bytes=141 * GB, link_bw=900 * GB,
                     domain_size=8, net_bw=50 * GB),
    "b200": Hardware("b200", flops_bf16=2.25e15, mem_bw=8.0 * TB, mem_bytes=180 * GB, link_bw=1.8 * TB,
                     domain_size=8, net_bw=100 * GB),
    "gb200": Hardware("gb200", flops_bf16=2.5e15, mem_bw=8.0 * TB, mem_bytes=186 * GB, link_bw=1.8 * TB,
                      domain_size=72, net_bw=100 * GB),
}


def hardware(name: str, cpu_profile_path: str | None = None) -> Hardware:
    """The profile called `name`; "cpu" loads (or measures and caches) this machine's micro-benchmark."""
    key = name.lower()
    if key == "cpu":
        from .cpu_profile import load_or_measure

        return load_or_measure(cpu_profile_path).to_hardware()
    if key not in GPU_PROFILES:
        raise ValueError(f"unknown hardware {name!r}: known are {', '.join([*GPU_PROFILES, 'cpu'])}")
    return GPU_PROFILES[key]


def with_memory(hw: Hardware, mem_bytes: float) -> Hardware:
    """A copy with another memory size (what-if studies: an H100 with 94 GB, a smaller CPU budget)."""
    return replace(hw, mem_bytes=mem_bytes)
