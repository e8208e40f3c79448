"""Hardware profiles: what one accelerator can do, from public spec sheets.

Dense BF16 FLOP/s (without sparsity), HBM size and bandwidth and NVLink bandwidth per GPU are the vendors' public
figures: NVIDIA H100 SXM and H200 datasheets (989 TFLOP/s, 3.35 / 4.8 TB/s, 80 / 141 GB, NVLink 900 GB/s), the
DGX B200 and GB200 NVL72 product pages (2.25 / 2.5 PFLOP/s per GPU, 8 TB/s, 180 / 186 GB, NVLink 5 at 1.8 TB/s).
Inter-node figures are marked "assumption" where they are set, with their source; they only matter for
collectives that leave an NVLink domain. One CPU host (`CPU_PROFILES['cpu']`, this project's 2-core machine) sits
beside them with measured figures, its weight refit the gloo broadcast as timed end to end.

How much of these peaks real kernels reach is *not* stored here: that lives in `calibration.py`, one set of
factors per GPU profile, so a profile stays a plain copy of a spec sheet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9
TB = 1e12
MiB = 2 ** 20


@dataclass(frozen=True)
class Hardware:
    name: str
    """Profile name as the CLI spells it (h100, h200, b200, gb200)."""
    flops_bf16: float
    """Dense BF16 matmul peak per device, FLOP/s."""
    mem_bw: float
    """Device memory bandwidth (HBM), bytes/s."""
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
    host_bw: float = 64e9
    """Device <-> host memory bandwidth, bytes/s, one direction: what offloading optimizer states and sleeping an
    engine move over (PCIe Gen5 x16, 64 GB/s, on HGX H100 / H200 / B200; NVLink-C2C on GB200)."""
    refit_bw: float = 0.0
    """A measured weight-refit bandwidth, bytes/s, that replaces the link model (`refit_link`) on a profile whose
    refit was timed end to end (the CPU host's gloo broadcast); 0: from the spec sheet's links."""

    def __post_init__(self) -> None:
        if self.refit_bw < 0:
            raise ValueError(f"Hardware {self.name!r}: refit_bw must be >= 0, got {self.refit_bw}")
        for field in ("flops_bf16", "mem_bw", "mem_bytes", "link_bw", "net_bw", "fp8_speedup", "host_bw"):
            if getattr(self, field) <= 0:
                raise ValueError(f"Hardware {self.name!r}: {field} must be > 0, got {getattr(self, field)}")
        if self.domain_size < 1:
            raise ValueError(f"Hardware {self.name!r}: domain_size must be >= 1, got {self.domain_size}")

    def flops(self, dtype_bytes: float) -> float:
        """Dense matmul peak for weights of `dtype_bytes` bytes (1 = FP8, 2 = BF16)."""
        return self.flops_bf16 * (self.fp8_speedup if dtype_bytes == 1 else 1.0)

    def collective_bw(self, group: int) -> float:
        """One-direction bandwidth a collective over `group` devices gets per device: the scale-up link inside a
        domain (half the quoted bidirectional figure), the NIC once the group spans domains."""
        return self.link_bw / 2 if group <= self.domain_size else self.net_bw


# Public figures behind the GPU profiles' links, one direction per GPU unless said otherwise:
# - NVLink 4 on H100 / H200 SXM: 900 GB/s per GPU, both directions added (NVIDIA H100 Tensor Core GPU datasheet,
#   "NVLink: 900GB/s"; H200 datasheet, same), i.e. 450 GB/s each way.
# - InfiniBand NDR: 400 Gb/s per port = 50 GB/s each way (NVIDIA ConnectX-7 and Quantum-2 NDR product briefs; DGX
#   H100 pairs each GPU with one such port).
# - HBM3 of H100 SXM: 3.35 TB/s (datasheet): a device copy through a CUDA IPC handle reads and writes each byte.
NVLINK4_BW = 900 * GB
NDR_IB_BW = 400e9 / 8
# Measured once on one H100 (torch 2.11, CUDA 13): a trainer process handed an engine process 2 GiB in 256 MiB
# buckets through CUDA IPC handles in 0.059 s, 36.2 GB/s, opening the handles and synchronising included (gloo on
# the same host: 0.53 GB/s). The step model keeps the device-copy bound above for colocated refits; this figure
# is shown beside it (`stages.refit_table`): the bound is optimistic for small refits, whose fixed costs it omits.
H100_CUDA_IPC_MEASURED_BW = 36.2e9

# Inter-node figures (not on the GPU datasheets): one 400 Gb/s NDR NIC per GPU on HGX H100/H200 (NVIDIA DGX H100
# reference architecture; `NDR_IB_BW` above), one 800 Gb/s NIC per GPU on Blackwell systems (ConnectX-8).
# Hopper memory: the sheets' "80 GB" / "141 GB" are what the driver reports as 81559 MiB / 143771 MiB (nvidia-smi's
# total), 85.5 / 150.8 decimal GB, which is what vLLM's gpu_memory_utilization takes its share of.
# GB200's host link (assumption): NVLink-C2C's 900 GB/s (both directions) shared by the two GPUs of a Grace,
# 225 GB/s per GPU and direction.
GPU_PROFILES: dict[str, Hardware] = {
    "h100": Hardware("h100", flops_bf16=989e12, mem_bw=3.35 * TB, mem_bytes=81559 * MiB, link_bw=NVLINK4_BW,
                     domain_size=8, net_bw=NDR_IB_BW),
    "h200": Hardware("h200", flops_bf16=989e12, mem_bw=4.8 * TB, mem_bytes=143771 * MiB, link_bw=NVLINK4_BW,
                     domain_size=8, net_bw=NDR_IB_BW),
    "b200": Hardware("b200", flops_bf16=2.25e15, mem_bw=8.0 * TB, mem_bytes=180 * GB, link_bw=1.8 * TB,
                     domain_size=8, net_bw=100 * GB),
    "gb200": Hardware("gb200", flops_bf16=2.5e15, mem_bw=8.0 * TB, mem_bytes=186 * GB, link_bw=1.8 * TB,
                      domain_size=72, net_bw=100 * GB, host_bw=225 * GB),
}


# The CPU host: what this project's 2-core AVX-512 EPYC measured. The refit figure is the median of five rounds of
# the collective refit (a 0.54 GB float32 SmolLM2-135M policy, 16 MiB buckets broadcast over a gloo group from the
# trainer process to the engine process of a local two-CPU Ray cluster): 0.537 GB/s, against 0.259 GB/s through
# Ray's object store on the same model. The rest are the CPU harness's 2-thread calibration (dense training
# products, cold weight stream); the host's 24 GB are its memory. The compute and memory figures only scale the
# step model on this host; the CPU calibration set (`calibration.CPU_HOST`) carries what its eager engine and
# trainer reach.
CPU_GLOO_REFIT_BW = 0.537e9
# A pipeline stage's send to the next on this host: gloo isend / irecv between two 1-thread ranks, timed as a
# ping-pong of 24 B to 4 MiB (medians of 200 rounds each, other jobs running: load 2-4 on the 2 cores), seconds
# fitted on bytes by least squares: 146 us a message plus the bytes at 2.30 GB/s (on a quiet host 88 us and
# 2.54 GB/s). What `bubble.p2p_exchange_s` charges a Megatron pipeline exchange on the CPU host.
CPU_GLOO_P2P_LATENCY_S = 146e-6
CPU_GLOO_P2P_BW = 2.30e9

CPU_PROFILES: dict[str, Hardware] = {
    "cpu": Hardware("cpu", flops_bf16=177e9, mem_bw=22.8 * GB, mem_bytes=24 * GB, link_bw=2 * CPU_GLOO_REFIT_BW,
                    domain_size=1, net_bw=CPU_GLOO_REFIT_BW, fp8_speedup=1.0, host_bw=22.8 * GB,
                    refit_bw=CPU_GLOO_REFIT_BW),
}


def hardware(name: str | Hardware) -> Hardware:
    """The GPU profile or CPU host called `name` (a `Hardware` passes through: a profile built elsewhere, e.g. a
    what-if copy or the CPU validation harness's measured profile in `research/sim_cpu`)."""
    if isinstance(name, Hardware):
        return name
    key = str(name).lower()
    profiles = {**GPU_PROFILES, **CPU_PROFILES}
    if key not in profiles:
        raise ValueError(f"unknown hardware {name!r}: known are {', '.join(profiles)}")
    return profiles[key]


def with_memory(hw: Hardware, mem_bytes: float) -> Hardware:
    """A copy with another memory size (what-if studies: an H100 with 94 GB)."""
    return replace(hw, mem_bytes=mem_bytes)
