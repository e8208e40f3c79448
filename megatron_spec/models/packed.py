"""Linear layers for inference on CPU: one GEMM per group of layers that read the same input, on weights packed once.

Decoding multiplies a few rows by every weight matrix, so each step streams all the weights from memory. Measured
on a 2-core AMD EPYC (AVX2), fp32, the weights of ten SmolLM2 layers at 4-32 rows: torch's `F.linear` (MKL, the
weight in its [out, in] layout) took 1.5-2.1x longer than oneDNN's matmul on the same weights reordered once into
oneDNN's blocked layout, and concatenating q/k/v and gate/up into one matrix saved another ~8 % (fewer, larger
GEMMs). At one row (a batch of one, plain decoding) that AVX2 machine ran oneDNN 1.4x slower than MKL's GEMV, and
MKL's GEMV 7-25 % faster on the concatenated weights stored transposed ([in, out], read row after row) than on
`F.linear`'s [out, in] layout; that copy is made the first time a one-row input comes. On an AVX-512 EPYC (all of
SmolLM2's weights, 2 threads) oneDNN was the faster at one row too, fp32 25.8 ms against 31.6 ms, so CPUs with
AVX-512 take it at every row count (`ONEDNN_ONE_ROW`, fixed per machine so a run's numbers do not depend on timing).
bf16 packs where oneDNN has a bf16 path (AVX512-BF16, AMX): there it took 12.8 / 14.9 ms at 1 / 8 rows against
`F.linear`'s 18.8 / 23.8 ms. Elsewhere bf16 keeps `F.linear` on the concatenated weights at one row, and inputs of
several rows are upcast to fp32 and go to oneDNN on an fp32 copy of the weights: on the AVX2 EPYC, bf16 `F.linear`
is about 2x faster at one row and 2-5x slower at 8-32 rows than fp32 oneDNN on SmolLM2's GEMMs. The result is the
same arithmetic (bf16 values are exact in fp32, products accumulate in fp32 either way, the output is rounded to
bf16 once) in another order; the copy costs 4 bytes a weight.

Where the CPU kernels are built (`megatron_spec.kernels`), inputs of up to KERNEL_ROWS rows take their `linear`
on the concatenated weights as they are (`Pack.plain`) instead of the paths above, which then serve larger inputs,
and every input where the kernels are off.

The packed copy is rebuilt whenever a weight changes: the cache is keyed on each weight's storage pointer and
version counter, which every in-place write bumps (optimizer steps, refit `copy_`, `load_state_dict`) and which a
re-assigned parameter changes. It costs one or two extra copies of the weights in memory. Only the engine's
forwards (CPU, under `torch.inference_mode`) read packed weights; training, the trainer's no-grad forwards, other
devices and inference-tensor weights take the plain `F.linear` path.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels

PACK_FOR_ROWS = 8
"""Row count oneDNN picks its weight layout for (decode / verify batches are a few to a few dozen rows)."""

ONEDNN_ONE_ROW = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
"""One-row inputs go to oneDNN too (AVX-512 CPUs) rather than to MKL's GEMV on transposed weights (AVX2)."""

ROW_MULTIPLE = 8
"""oneDNN inputs of more than this many rows are padded to a multiple of it. oneDNN builds a kernel (a
"primitive") for every row count it meets: a forward of the deep tiny model at a new row count took 6.8 ms against
4.1 ms again (`research/shape_costs.py`), and oneDNN caches at most 1024 kernels. Plain decoding meets a few dozen
row counts (the batch size shrinking), but a speculative rollout meets batch x (k + 1) for every batch size and k
the adaptive controller picks: most of its verify steps paid a new kernel, and a long run cycled the cache. Padded,
a 64-sequence rollout needs at most 8 + 384 / 8 row counts whatever k is; the padding costs ~2 us a GEMM and at
most 7 extra rows."""


KERNEL_ROWS = {torch.float32: 16, torch.bfloat16: 32}
"""Inputs of at most this many rows take the CPU kernels' `linear` (which streams each weight once for all the
rows) when the kernels are built. On all of SmolLM2's GEMMs on the AVX2 EPYC, 2 threads, the kernel is faster than
this module's other paths up to 16 rows in fp32 (slower from 24) and up to 32 rows in bf16.
Every input up to these counts computes each row alone, in the same order, so its outputs are bitwise the same in
a batch of any of these sizes."""

SMALL_OUTPUT = 1 << 15
"""A weight small enough to stay in a core's L2 (CACHE_RESIDENT_BYTES, as the kernels' tiles assume) takes the
kernels' `linear` past KERNEL_ROWS, for inputs of up to this many outputs (rows x the group's output width): there
oneDNN's cost per call outweighs its faster GEMM. What sets the crossing is the output width, not the
multiply-adds: on the main job's policy (hidden 96, AVX2 EPYC, 2 threads, each call alone and warm) oneDNN
overtakes the kernel for gate/up (576 x 96) between 40 and 64 rows and for q/k/v (160 x 96) near 200, while down
(96 x 288: three times the multiply-adds of q/k/v a row) and o (96 x 96) stay 1.3x faster in the kernel up to 256
rows. 32768 outputs put the crossing at 56 rows for gate/up, 204 for q/k/v and 341 for down and o. It rules where
a layer is not fused: a fused layer (`decoder.FUSED_LAYER_MACS`) takes the kernels' linear for all its groups
further than this."""

CACHE_RESIDENT_BYTES = 512 << 10
"""The kernels' own bound (`cpu_ops.cpp`) for a weight that stays in a core's L2 between calls."""


@dataclass
class Pack:
    key: tuple
    weight: Tensor
    """The concatenated weights [sum(out), in] as they are: what `F.linear` reads where oneDNN is not used, and what
    `blocked` is made from."""
    bias: Tensor | None
    sizes: list[int]
    plain: Tensor | None
    """The concatenated weights [sum(out), in] in the model's layout and dtype, for the kernels' `linear` (None in
    an `upcast` pack, which only oneDNN reads)."""
    onednn: bool
    """oneDNN packs this dtype here; without it (bf16 on CPUs without a bf16 path) `F.linear` reads `weight`."""
    rows_weight: Tensor | None = None
    """The concatenated weights transposed, [in, sum(out)] contiguous, for one-row inputs (built on first use)."""
    upcast: Pack | None = None
    """bf16 weights where oneDNN has no bf16 path: an fp32 copy packed for oneDNN, which inputs of several rows
    take (upcast, then the output rounded back to bf16). See the module docstring."""
    _blocked: Tensor | None = None

    def blocked(self) -> Tensor:
        """`weight` in oneDNN's blocked layout, made on the first oneDNN call. A reorder costs ~0.27 ms whatever
        the weight's size (AVX2 EPYC), and an RL run refits every step: the main job's 33 groups took
        9.6 ms of a ~240 ms rollout to repack, and in its rollouts only the kernels read them (fused layers, and
        a head under SMALL_OUTPUT)."""
        if self._blocked is None:
            self._blocked = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_FOR_ROWS)
        return self._blocked


PACKS: weakref.WeakKeyDictionary[nn.Module, Pack] = weakref.WeakKeyDictionary()
"""Packs by the group's first layer. Kept beside the modules, not on them, so a model still deep-copies and
pickles (oneDNN's blocked tensors have no storage to copy), and a pack goes when its layers go."""


_registrations = 0


def registrations() -> int:
    """How many parameters any module has registered in this process (constructions, assignments such as
    `module.weight = p`, `load_state_dict(..., assign=True)`): a cache keyed on parameters it found through their
    modules is stale once this moves, even if the parameters it holds did not change."""
    return _registrations


def _count_registration(module: nn.Module, name: str, param) -> None:
    global _registrations
    _registrations += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)


def linears(x: Tensor, *layers: nn.Linear) -> tuple[Tensor, ...]:
    """`x` through each of `layers` (all reading x's last dimension): one output per layer."""
    if not packable(x, layers):
        return tuple(F.linear(x, m.weight, m.bias) for m in layers)
    y = packed_linear(x, layers)
    return y.split([m.out_features for m in layers], -1) if len(layers) > 1 else (y,)


def packed_linear(x: Tensor, layers: tuple[nn.Linear, ...]) -> Tensor:
    """`x` through `layers`' concatenated packed weights: their outputs side by side, [..., sum(out)]. Needs
    `packable(x, layers)`."""
    pack = packed(layers)
    rows = x.reshape(-1, x.shape[-1])
    if kernel_takes(x, layers):
        y = kernels.linear(rows, pack.plain, pack.bias)
    elif pack.upcast is not None and rows.shape[0] > 1:  # see `Pack.upcast`
        y = onednn_rows(rows.float(), pack.upcast).to(x.dtype)
    elif not pack.onednn:
        y = F.linear(rows, pack.weight, pack.bias)
    elif rows.shape[0] == 1 and x.dtype == torch.float32 and not ONEDNN_ONE_ROW:
        if pack.rows_weight is None:
            pack.rows_weight = torch.cat([m.weight.detach() for m in layers]).t().contiguous()
        y = rows @ pack.rows_weight if pack.bias is None else torch.addmm(pack.bias, rows, pack.rows_weight)
    else:
        y = onednn_rows(rows, pack)
    return y.view(*x.shape[:-1], y.shape[-1])


def kernel_takes(x: Tensor, layers: tuple[nn.Linear, ...]) -> bool:
    """Whether the kernels' `linear` computes `x` [..., in] through `layers` (see KERNEL_ROWS). Needs `packable`."""
    return x.numel() // x.shape[-1] <= kernel_rows(layers) and kernels.usable(x)


def kernel_rows(layers: tuple[nn.Linear, ...]) -> int:
    """The most input rows the kernels' `linear` takes through `layers` in their dtype: KERNEL_ROWS, or for a
    cache-resident group SMALL_OUTPUT's worth of rows where that is more, or 0 where their input size is not a
    multiple of 8 (its 8-lane sums) or the dtype has no kernel."""
    if not all(m.in_features % 8 == 0 for m in layers):
        return 0
    bound = KERNEL_ROWS.get(layers[0].weight.dtype, 0)
    width = sum(m.out_features for m in layers)
    resident = width * layers[0].in_features * layers[0].weight.element_size() <= CACHE_RESIDENT_BYTES
    return max(bound, SMALL_OUTPUT // width if resident else 0) if bound else 0


def onednn_rows(rows: Tensor, pack: Pack) -> Tensor:
    n = rows.shape[0]
    pad = -n % ROW_MULTIPLE if n > ROW_MULTIPLE else 0
    if pad:  # see ROW_MULTIPLE; the padded rows' outputs are dropped, the others do not depend on them
        return onednn_linear(torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]), pack)[:n]
    return onednn_linear(rows, pack)


def onednn_linear(rows: Tensor, pack: Pack) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, pack.blocked(), pack.bias, "none", [], "")


def packable(x: Tensor, layers: tuple[nn.Linear, ...]) -> bool:
    # Inference mode only (the engine's): the trainer's no-grad forwards (the log-prob recompute, the drafter's
    # agreement) must compute exactly what its training forward does, or the folded and recomputed old log-probs
    # of a step would differ.
    return (torch.is_inference_mode_enabled() and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and x.dtype == layers[0].weight.dtype and not layers[0].weight.is_inference())


@functools.cache
def packed_dtypes() -> tuple[torch.dtype, ...]:
    if not torch.backends.mkldnn.is_available():
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def packed(layers: tuple[nn.Linear, ...]) -> Pack:
    """The cached pack of `layers`' weights, rebuilt if any weight changed."""
    key = tuple((m.weight.data_ptr(), m.weight._version) for m in layers)
    pack = PACKS.get(layers[0])
    if pack is None or pack.key != key:
        weight = torch.cat([m.weight for m in layers]) if len(layers) > 1 else layers[0].weight
        bias = None
        if any(m.bias is not None for m in layers):
            bias = torch.cat([m.weight.new_zeros(m.weight.shape[0]) if m.bias is None else m.bias.detach()
                              for m in layers])
        pack = make_pack(key, weight.detach(), bias, [m.weight.shape[0] for m in layers])
        if not pack.onednn and weight.dtype == torch.bfloat16 and torch.float32 in packed_dtypes():
            pack.upcast = make_pack(key, weight.detach().float(), None if bias is None else bias.float(), pack.sizes,
                                    keep_plain=False)
        PACKS[layers[0]] = pack
    return pack


def make_pack(key: tuple, weight: Tensor, bias: Tensor | None, sizes: list[int], keep_plain: bool = True) -> Pack:
    return Pack(key, weight, bias, sizes, weight if keep_plain else None, weight.dtype in packed_dtypes())
