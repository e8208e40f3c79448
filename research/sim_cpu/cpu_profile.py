"""A hardware profile of this CPU, measured with torch in about a second and cached as JSON.

The embedded engine decodes on the CPU at float32 with one matrix product per weight matrix, each streamed cold
from DRAM. A CPU does not overlap that stream with the arithmetic (time grows with the batch from 2 rows on), and
each output row of a matrix-vector product costs a horizontal reduction and a store. So one linear of N x K
weights over M tokens takes

    t = 4 N K / dram_bw  +  N * row_s  +  2 M N K / gemm_flops  +  op_overhead_s

and the micro-benchmark fits the three rates (least squares) to timings of cold stacks of matrices (128 MB each,
far beyond the cache) whose rows per byte vary 16x, at M = 1 and M = 8.
It also measures a cache-resident 256 x 256 product at M = 1 and M = 8 for `cache_bw` and `cache_flops` (hot
weights need no per-row term: the reduction hides under the arithmetic), and the eager-execution figures of
`cpu_eager.py`: per-operator and per-sequence costs, the rate of training-sized products, elementwise bandwidth on
activations and the attention kernel's cost per score. Every timing is the fastest of a few repeats, on the
thread's CPU clock when single-threaded, which filters out the preemptions of a shared machine. torch is imported
inside `measure` only.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

from .hardware import CpuHardware

DEFAULT_PATH = Path.home() / ".cache" / "megatron_spec" / "cpu_profile.json"
DEFAULT_THREADS = 2


@dataclass(frozen=True)
class CpuProfile:
    threads: int
    """torch intra-op threads the figures were measured with."""
    op_overhead_s: float
    """Cost of one dispatched operator that does no work (Python call, dispatcher, allocation), seconds."""
    dram_bw: float
    """Weight-streaming bandwidth from DRAM, bytes/s."""
    cache_bw: float
    """Weight-streaming bandwidth from the last-level cache, bytes/s."""
    cache_flops: float
    """Float32 matmul arithmetic rate with cache-resident weights, FLOP/s."""
    row_s: float
    """Cost per output row of a matrix product, seconds."""
    gemm_flops: float
    """Float32 matmul arithmetic rate, FLOP/s."""
    cache_bytes: float
    """Last-level cache size, bytes."""
    mem_bytes: float
    """Physical memory, bytes."""
    seq_overhead_s: float
    """Our engine's Python work per sequence per forward, seconds (`cpu_eager.seq_seconds`)."""
    seq_layer_s: float
    """Our engine's cost per sequence per decoder layer per forward (its KV-cache slot write), seconds."""
    dense_flops: float
    """Float32 matmul rate on training-sized products, FLOP/s."""
    act_bw: float
    """Floats read plus written per second (x 4 bytes) by elementwise operators over activation-sized tensors."""
    attn_score_s: float
    """Torch's CPU attention cost per (query, key) score beyond its FLOPs, seconds."""
    train_op_s: float = 0.0
    """Cost of one operator of the trainer's step (autograd included), seconds (`cpu_eager.trainer_figures`);
    0 in profiles measured before it existed, which then charge `op_overhead_s`."""
    train_work: float = 1.0
    """The trainer step's arithmetic and traffic, measured over modelled (`cpu_eager.trainer_figures`); 1.0 in
    profiles measured before it existed."""
    machine: str = ""
    """Processor / platform description, to notice a profile copied from another machine."""
    note: str = ""
    """When it was measured and how busy the machine was (1-minute load average before and after)."""

    def __post_init__(self) -> None:
        for name in ("dram_bw", "cache_bw", "cache_flops", "row_s", "gemm_flops", "mem_bytes", "dense_flops",
                     "act_bw", "train_work"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CpuProfile.{name} must be > 0, got {getattr(self, name)}")
        # The fixed costs may be 0: `without_overheads` builds the pure roofline to show what they are worth.
        for name in ("op_overhead_s", "seq_overhead_s", "seq_layer_s", "attn_score_s", "train_op_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"CpuProfile.{name} must be >= 0, got {getattr(self, name)}")

    def without_overheads(self) -> "CpuProfile":
        """The same machine with no per-operator or per-sequence cost: the roofline alone."""
        return replace(self, op_overhead_s=0.0, seq_overhead_s=0.0, seq_layer_s=0.0, train_op_s=0.0)

    def to_hardware(self) -> CpuHardware:
        """The profile as a `CpuHardware` for the CPU roofline: no overlap, per-operator overhead, one device."""
        return CpuHardware(
            name="cpu", flops_bf16=self.gemm_flops, mem_bw=self.dram_bw, mem_bytes=self.mem_bytes,
            link_bw=2 * self.dram_bw, domain_size=1, net_bw=self.dram_bw, fp8_speedup=1.0,
            op_overhead_s=self.op_overhead_s, seq_overhead_s=self.seq_overhead_s, seq_layer_s=self.seq_layer_s,
            cache_bytes=self.cache_bytes, cache_bw=self.cache_bw, cache_flops=self.cache_flops, row_s=self.row_s,
            dense_flops=self.dense_flops, act_bw=self.act_bw, attn_score_s=self.attn_score_s,
            train_op_s=self.train_op_s or self.op_overhead_s, train_work=self.train_work,
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CpuProfile":
        data = json.loads(Path(path).read_text())
        missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
        if missing:
            raise ValueError(f"CPU profile {path} lacks {', '.join(missing)} (written by an older version): "
                             "re-measure with `python -m research.sim_cpu calibrate`")
        return cls(**data)


def _last_level_cache() -> float:
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 2 ** 10, "M": 2 ** 20}.get(text[-1:], 1)
        sizes.append(float(text.rstrip("KM")) * scale)
    return max(sizes) if sizes else 8 * 2 ** 20


def _mem_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * 2 ** 30


def clock_for(threads: int):
    """The clock to time `threads`-thread work with: the thread's own CPU time when torch runs single-threaded (a
    shared machine's preemptions then cost nothing), wall time otherwise."""
    return time.thread_time if threads == 1 else time.perf_counter


def min_time(fn, repeats: int, warmup: int = 2, clock=time.perf_counter) -> float:
    """Fastest of `repeats` calls, seconds."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


# Cold-stack shapes (rows N, columns K, tokens M): rows per byte vary 16x across the M = 1 shapes, which separates
# the per-row cost from the bandwidth; the M = 8 shapes add arithmetic.
COLD_SHAPES = ((4096, 256, 1), (2048, 512, 1), (1024, 1024, 1), (512, 2048, 1), (256, 4096, 1), (2048, 512, 8),
               (256, 4096, 8))
MAX_FIT_ERROR = 0.30  # a timing further than this from the fitted model means the measurement was disturbed
COLD_BYTES = 128 * 2 ** 20  # per stack: 4x a large last-level cache, and as long to stream as a small model's step


def _least_squares(rows: list[list[float]], y: list[float]) -> list[float]:
    """Solve min |A x - y| for three unknowns via the normal equations, each column scaled to unit size."""
    scale = [max(abs(r[j]) for r in rows) for j in range(3)]
    a = [[r[j] / scale[j] for j in range(3)] for r in rows]
    ata = [[sum(r[i] * r[j] for r in a) for j in range(3)] for i in range(3)]
    aty = [sum(r[i] * v for r, v in zip(a, y)) for i in range(3)]

    def det(m: list[list[float]]) -> float:
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))

    d = det(ata)
    x = [det([[aty[r] if c == i else ata[r][c] for c in range(3)] for r in range(3)]) / d for i in range(3)]
    return [xi / si for xi, si in zip(x, scale)]


def measure(threads: int = DEFAULT_THREADS) -> CpuProfile:
    """Run the micro-benchmark (about a second) with `threads` torch threads; restores the thread count."""
    import torch
    import torch.nn.functional as F

    from .cpu_eager import measure_eager, op_seconds, trainer_figures

    load_before = os.getloadavg()[0]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    clock = clock_for(threads)
    try:
        with torch.inference_mode():
            # Put glibc's allocator in a running process's steady state: freeing a 16 MB block raises its mmap
            # threshold, so megabyte tensors come from the heap instead of freshly mapped, page-faulting memory.
            torch.empty(16 * 2 ** 20, dtype=torch.uint8).fill_(0)
            gen = torch.Generator().manual_seed(0)
            overhead = op_seconds(clock, min_time)  # what each timed product below pays besides its work

            def stack_time(n: int, k: int, m: int) -> float:
                # Separately allocated matrices, as a model's are: the prefetcher cannot run from one into the next.
                mats = [torch.rand(n, k, generator=gen) for _ in range(COLD_BYTES // (4 * n * k))]
                xin = torch.rand(m, k, generator=gen)

                def run() -> None:
                    for mat in mats:
                        F.linear(xin, mat)

                return min_time(run, 5, warmup=1, clock=clock) / len(mats) - overhead

            # Unknowns (1/dram_bw, row_s, 1/gemm_flops); each row: bytes, output rows, FLOPs of one matrix.
            coeffs = [[4.0 * n * k, float(n), 2.0 * m * n * k] for n, k, m in COLD_SHAPES]
            times = [stack_time(*shape) for shape in COLD_SHAPES]
            inv_bw, row_s, inv_flops = _least_squares(coeffs, times)
            fit = [c[0] * inv_bw + c[1] * row_s + c[2] * inv_flops for c in coeffs]
            worst = max(abs(f / t - 1) for f, t in zip(fit, times))
            if inv_bw <= 0 or inv_flops <= 0 or worst > MAX_FIT_ERROR:
                raise ValueError(f"CPU micro-benchmark with {threads} threads does not fit the linear cost model "
                                 f"(worst timing off by {100 * worst:.0f} %): the machine is probably busy; "
                                 "re-run `python -m research.sim_cpu calibrate --threads 1` or on an idle machine")
            dram_bw, gemm_flops = 1 / inv_bw, 1 / inv_flops

            # Cache resident: t = bytes / cache_bw + FLOPs / cache_flops, from M = 1 and M = 8 (two unknowns).
            small = torch.rand(256, 256, generator=gen)  # 256 KB: stays in the core's cache between calls
            x1, x8 = torch.rand(1, 256, generator=gen), torch.rand(8, 256, generator=gen)
            t1 = min_time(lambda: F.linear(x1, small), 200, clock=clock) - overhead
            t8 = min_time(lambda: F.linear(x8, small), 200, clock=clock) - overhead
            cache_flops = 2 * 7 * small.numel() / max(t8 - t1, 1e-9)
            cache_bw = small.numel() * 4 / max(t1 - 2 * small.numel() / cache_flops, 1e-9)
        eager = measure_eager(clock, min_time, cache_flops)
        profile = CpuProfile(threads=threads, dram_bw=dram_bw, cache_bw=max(cache_bw, dram_bw),
                             cache_flops=cache_flops, row_s=max(row_s, 1e-12), gemm_flops=gemm_flops,
                             cache_bytes=_last_level_cache(), mem_bytes=_mem_bytes(),
                             machine=f"{platform.machine()} {platform.processor()} {os.cpu_count()} cpus".strip(),
                             **eager)
        # Last: the trainer stand-in is modelled with every other figure.
        trainer = trainer_figures(clock, min_time, profile.to_hardware())
    finally:
        torch.set_num_threads(previous)
    return replace(profile, **trainer,
                   note=f"measured {time.strftime('%Y-%m-%d %H:%M')}, load average {load_before:.2f} before, "
                        f"{os.getloadavg()[0]:.2f} after")


def load_or_measure(path: str | Path | None = None, threads: int | None = None,
                    remeasure: bool = False) -> CpuProfile:
    """The cached profile at `path` (default ~/.cache/megatron_spec/cpu_profile.json); measured (with `threads`,
    default 2) and written there if missing, if `threads` is given and differs from the cached one, or if
    `remeasure` is set."""
    path = Path(path) if path else DEFAULT_PATH
    if path.is_file() and not remeasure:
        try:
            profile = CpuProfile.load(path)
        except (ValueError, TypeError):
            profile = None  # written by an older version: measure again
        if profile is not None and (threads is None or profile.threads == threads):
            return profile
    profile = measure(threads or DEFAULT_THREADS)
    profile.save(path)
    return profile
