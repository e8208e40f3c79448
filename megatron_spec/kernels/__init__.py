"""Fused CPU kernels for the engine's forwards (`cpu_ops.cpp`), compiled here on first use: RMSNorm, SiLU-times-up,
rotary-plus-cache-store, attention over the KV cache, a linear for a few rows that streams each weight once, and a
whole dense decoder layer built from those in one call, an MTP depth, a greedy MTP head's whole drafting, and the
sampled verification of deterministic drafts (plain sampling when there are none).

Why: after oneDNN took the GEMMs, most of a SmolLM2 decode step on 2 CPU cores was ~80 small torch ops a layer
(norms in five ops each, rotary in seven, the cache's index copies, the attention's matmuls, masks and casts), each
a few microseconds of dispatch and allocation: with the GEMMs stubbed out a bf16 B=1 step still took 13.2 of its
28.7 ms. The first four kernels replace ~60 of those ops a layer. Then, at a batch of one, MKL's GEMV read the
weights at about half the memory bandwidth: `linear` reads them at 16-19 GB/s of the ~21 the host sustains for up
to 16 (fp32) / 32 (bf16) rows (`models/packed.py`, KERNEL_ROWS), and `decoder_layer` drops the Python and dispatch
between a layer's kernels, which had become about a quarter of the step.

What: each kernel computes a row (a token, a head) from that row's inputs only, in a fixed order, so a token gets
the same numbers in a batch of any size and in a decode or a verify forward (greedy speculative decoding stays
token-identical to plain). Against torch's eager path the rotary and the cache store are bitwise equal (without
Qwen3's per-head norm before them); the norms, the linear and the attention (fp32 throughout, no bf16 score or
probability rounding) agree to rounding, and the whole layer is bitwise its kernels called one by one
(`tests/models/test_kernels.py`).

When: only the engine's forwards (CPU, `torch.inference_mode`, float32 / bfloat16), like the packed GEMMs; training
and the trainer's no-grad forwards keep torch's ops. `MEGATRON_SPEC_KERNELS=0` turns them off; `=1` makes a failed
build an error instead of a warning (the tests set it). The build needs g++ and takes about a minute, once per
torch version, source and CPU: the library is cached under `MEGATRON_SPEC_CACHE` (default `~/.cache/megatron_spec`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import subprocess
import sysconfig
import warnings
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-std=c++17", "-shared",
         "-fPIC", "-w"]
"""-march=native: the library is built on the machine that runs it (the cache key holds the CPU's flags).
-ffp-contract=off: no fused multiply-adds, so the rotary rounds as torch's eager ops do. -fno-trapping-math: lets
GCC vectorise the loops that call the kernels' exp (it changes no value, only what may raise FP exceptions)."""


ops = torch.ops.megatron_spec
"""The operators the functions below call: this source's build. `research/kernel_ab.py` points it at another
version's build (registered under another namespace) to time the engine on both in one process."""

_disabled = 0
"""Depth of `disabled()` blocks being run (the setting is process-wide, like torch's thread count)."""


def usable(x: Tensor) -> bool:
    """Whether `x`'s forward may take the kernels: the engine's (inference mode) CPU forwards in fp32 / bf16."""
    # Not while torch.compile traces (vLLM's compiled mode runs our drafter heads): the kernels have no fake-tensor
    # implementation, and a compiled graph fuses torch's ops itself.
    # Checked first: dynamo cannot trace `is_inference_mode_enabled`, and stops at it.
    return (not torch.compiler.is_compiling() and not _disabled and torch.is_inference_mode_enabled()
            and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and loaded())


@contextlib.contextmanager
def disabled():
    """Torch's ops instead of the kernels inside the block: the baseline of a benchmark, or the engine as it ran
    before the kernels existed (the CPU simulator's operator census of older measurements)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return ops.rms_norm(x, weight, eps)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for `gate_up` = [gate | up] on the last axis."""
    return ops.silu_mul(gate_up)


def rope_store(qkv: Tensor, cos: Tensor, sin: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, eps: float,
               k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions: Tensor, heads: int, kv_heads: int) -> Tensor:
    """Rotated queries [B, T, H, D] of `qkv` [B, T, (H + 2 KV) D]; the rotated keys and the values are stored in
    one layer's cache (keys [slots, KV, D, L], values [slots, KV, L, D]) at (slots[b], :, positions[b, t])."""
    return ops.rope_store(qkv, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, slots, positions, heads, kv_heads)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`x` [R, K] times `weight` [N, K] transposed, plus `bias`: [R, N], each row computed alone (see the source)."""
    return ops.linear(x, weight, bias)


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions: Tensor) -> Tensor:
    """[B, T, H * D]: query (b, t) of `q` [B, T, H, D] over its slot's keys and values 0..positions[b, t]."""
    return ops.attention(q, k_cache, v_cache, slots, positions)


def decoder_layer(x: Tensor, cos: Tensor, sin: Tensor, norms: tuple[Tensor, Tensor], eps: float,
                  qkv: tuple[Tensor, Tensor | None], o: tuple[Tensor, Tensor | None],
                  qk_norms: tuple[Tensor | None, Tensor | None], qk_eps: float, gate_up: Tensor, down: Tensor,
                  k_cache: Tensor, v_cache: Tensor, slots: Tensor, positions: Tensor, heads: int, kv_heads: int) -> Tensor:
    """A dense decoder layer's output for `x` [B, T, hidden] from its input / post-attention norm weights, its
    projections (weight, bias) [out, in] with q/k/v and gate/up concatenated, and its per-head q/k norms (or
    None); this step's keys and values are stored as `rope_store` stores them."""
    return ops.decoder_layer(x, cos, sin, *norms, eps, *qkv, *o, *qk_norms, qk_eps, gate_up, down, k_cache, v_cache,
                             slots, positions, heads, kv_heads)


def mtp_layer(hidden: Tensor, embeds: Tensor, norms: tuple[Tensor, Tensor], eps: float, eh: Tensor,
              final_norm: Tensor, final_eps: float, cos: Tensor, sin: Tensor, layer: tuple, k_cache: Tensor,
              v_cache: Tensor, slots: Tensor, positions: Tensor, heads: int, kv_heads: int) -> Tensor:
    """An MTP depth's normed output state for the target's `hidden` and the next tokens' `embeds` [B, T, hidden]:
    its embedding / hidden norm weights, its [embedding, hidden] projection `eh` [hidden, 2 hidden], its final
    norm, and its decoder layer's arguments as `decoder_layer` takes them from the norms on (`layer`, a
    `FusedPlan`'s weights)."""
    norm_weights, layer_eps, qkv, o, qk_norms, qk_eps, gate_up, down = layer
    return ops.mtp_layer(hidden, embeds, *norms, eps, eh, final_norm, final_eps, cos, sin, *norm_weights, layer_eps,
                         *qkv, *o, *qk_norms, qk_eps, gate_up, down, k_cache, v_cache, slots, positions, heads,
                         kv_heads)


def mtp_draft(hidden: Tensor, ids: Tensor, positions: Tensor, last: Tensor, rounds: int,
              head: tuple[Tensor, Tensor | None], embeddings: Tensor, rope: tuple[Tensor, Tensor],
              norms: tuple[Tensor, Tensor], eps: float, eh: Tensor, final_norm: Tensor, final_eps: float, layer: tuple,
              k_cache: Tensor, v_cache: Tensor, slots: Tensor, heads: int, kv_heads: int) -> Tensor:
    """Greedy drafts [B, rounds] (int64) of an MTP depth: its catch-up over `hidden` [B, T, hidden] and the tokens
    `ids` [B, T] at `positions` [B, T], read on from each sequence's row `last` [B]; then draft r is the argmax of
    the target's `head` (weight, bias) on the state, and the depth reads that state and the draft at the next
    position. `embeddings` is the target's table, `rope` its cos / sin tables [positions, head_dim]; the depth's
    other arguments are `mtp_layer`'s."""
    norm_weights, layer_eps, qkv, o, qk_norms, qk_eps, gate_up, down = layer
    return ops.mtp_draft(hidden, ids, positions, last, rounds, *head, embeddings, *rope, *norms, eps, eh, final_norm,
                         final_eps, *norm_weights, layer_eps, *qkv, *o, *qk_norms, qk_eps, gate_up, down, k_cache,
                         v_cache, slots, heads, kv_heads)


def verify_coupled(logprobs: Tensor, drafts: Tensor, draft_len: Tensor, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`spec.verify.verify_coupled` of a deterministic drafter's `drafts` [B, k] (`draft_len` [B] of them stand per
    sequence) against processed `logprobs` [B, k + 1, V] (fp32) with position uniforms `u` [B, k + 1], and the
    emitted tokens' log-probs, in one call; with k = 0, plain sampling. Returns the accepted counts [B], the next
    tokens [B] and the emitted tokens' log-probs [B, k + 1] (0 past the next token)."""
    return ops.verify_coupled(logprobs, drafts, draft_len, u)


@functools.cache
def loaded() -> bool:
    """Build (once) and load the library; False, with a warning, where it cannot be built."""
    setting = os.environ.get("MEGATRON_SPEC_KERNELS", "auto")
    if setting == "0":
        return False
    try:
        torch.ops.load_library(str(build()))
        return True
    except (OSError, subprocess.CalledProcessError, RuntimeError) as err:
        if setting == "1":
            raise RuntimeError(f"MEGATRON_SPEC_KERNELS=1 but the CPU kernels did not build or load: {err}") from err
        warnings.warn(f"megatron_spec CPU kernels unavailable, using torch's ops (slower decoding): {err}",
                      stacklevel=2)
        return False


def build() -> Path:
    """The compiled library for this source, torch and CPU, compiled if it is not cached yet."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), " ".join(FLAGS).encode(), cpu_flags().encode()):
        key.update(part)
    cache = Path(os.environ.get("MEGATRON_SPEC_CACHE", Path.home() / ".cache" / "megatron_spec")) / "kernels"
    cache.mkdir(parents=True, exist_ok=True)
    library = cache / f"cpu_ops_{key.hexdigest()[:16]}.so"
    # One process compiles while the others wait on the lock, then find the library built.
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.exists():
            compile_to(library)
    return library


def compile_to(library: Path) -> None:
    from torch.utils import cpp_extension

    torch_dir = Path(torch.__file__).parent
    command = [os.environ.get("CXX", "g++"), *FLAGS, str(SOURCE), "-o", f"{library}.tmp",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-I{path}" for path in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}",
               f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} ... failed:\n{done.stderr[-2000:]}")
    os.replace(f"{library}.tmp", library)  # atomic: a library in the cache is always a whole one


def cpu_flags() -> str:
    """The CPU's feature flags (`-march=native` code must not run on a CPU with fewer)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()
