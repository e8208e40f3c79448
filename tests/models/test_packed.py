"""The engine's packed CPU linears compute what `F.linear` computes, follow weight updates, and stay out of training."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_spec import kernels
from megatron_spec.models.packed import linears, packed, packed_dtypes


def layers(dtype):
    torch.manual_seed(0)
    return [nn.Linear(64, n, bias=bias).to(dtype) for n, bias in ((96, False), (32, True), (32, False))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8])
def test_packed_group_equals_separate_linears_and_follows_updates(dtype, rows):
    """fp32: the same dot products summed in another order, so 1e-5 relative to the output's scale (inputs ~1, 64-term
    sums of ~0.07-sized products: |y| ~ 0.6, fp32 rounding ~1e-7 per term). bf16 (oneDNN where it has a bf16 path,
    else `F.linear` on the concatenated weights at one row and oneDNN on their fp32 copy at 8): each output is
    rounded to bf16 once (relative 2^-8 = 0.4 %) whichever kernel runs, and the fp32 accumulation orders differ
    below that, so one bf16 step of the output's magnitude (1 %) bounds them. After an in-place weight update the
    pack is rebuilt: outputs follow the new weights at once."""
    group = layers(dtype)
    x = torch.randn(rows, 1, 64).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for _ in range(2):
        with torch.inference_mode():
            got = linears(x, *group)
        for y, m in zip(got, group):
            torch.testing.assert_close(y, F.linear(x, m.weight, m.bias), **tol)
        # bf16 without oneDNN's bf16 path: several rows take the fp32 copy (checked above like the others)
        assert (packed(tuple(group)).upcast is not None) == (dtype == torch.bfloat16 and dtype not in packed_dtypes())
        with torch.no_grad():
            group[1].weight.mul_(-2.0)  # an optimizer step or refit: bumps the version the pack is keyed on


def test_onednn_layout_is_made_on_first_use_and_follows_updates(monkeypatch):
    """A pack reorders its weights into oneDNN's layout only when oneDNN first reads it (a reorder costs ~0.27 ms
    however small the weight, and the engine repacks after every refit), so a group only the kernels' `linear`
    reads never pays for it; after an in-place update the next oneDNN call reads the new weights, not a layout
    made from the old ones. fp32 tolerance as in the first test."""
    import megatron_spec.models.packed as packed_mod

    if torch.float32 not in packed_dtypes():
        pytest.skip("no oneDNN on this build")
    monkeypatch.setattr(packed_mod, "SMALL_OUTPUT", 0)  # oneDNN above KERNEL_ROWS (with the kernels built)
    group = layers(torch.float32)
    many = packed_mod.KERNEL_ROWS[torch.float32] + 8
    with torch.inference_mode():
        linears(torch.randn(1, 64), *group)  # one row: the kernels' linear, or MKL's GEMV without them
        pack = packed(tuple(group))
        assert pack._blocked is None
        for _ in range(2):
            x = torch.randn(many, 64)
            for y, m in zip(linears(x, *group), group):
                torch.testing.assert_close(y, F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
            assert packed(tuple(group))._blocked is not None
            with torch.no_grad():
                group[0].weight.mul_(-2.0)
            assert packed(tuple(group))._blocked is None  # rebuilt for the new weights, not reordered yet


def test_outside_inference_mode_it_is_f_linear_bit_for_bit():
    """The trainer's forwards (grad or no_grad) must compute exactly what training computes."""
    group = layers(torch.float32)
    x = torch.randn(4, 3, 64)
    with torch.no_grad():
        for y, m in zip(linears(x, *group), group):
            assert torch.equal(y, F.linear(x, m.weight, m.bias))


@pytest.mark.parametrize("with_kernels", [False, True])
def test_row_counts_reaching_onednn_are_bounded_and_padding_changes_no_output(monkeypatch, with_kernels):
    """oneDNN builds a kernel per row count it meets (a deep tiny model forward at a new count: 6.8 ms against 4.1
    again, benchmarks/results/shape_costs.json), so inputs above ROW_MULTIPLE rows are padded to a multiple of it:
    feeding every row count 1..64 (what a 64-sequence speculative rollout's B x (k + 1) spans) reaches oneDNN with
    1..8 and multiples of 8 only, 16 distinct counts instead of 64. With the CPU kernels, inputs of up to
    KERNEL_ROWS rows go to their `linear` instead (SMALL_OUTPUT off here: it would take all 64 rows of this
    small group, see the next test), and oneDNN meets only the padded counts above it. The padding rows are dropped:
    each output equals `F.linear` to the fp32 tolerance reasoned in the test above."""
    import megatron_spec.models.packed as packed_mod

    if torch.float32 not in packed_dtypes():
        pytest.skip("no oneDNN on this build")
    monkeypatch.setattr(packed_mod, "SMALL_OUTPUT", 0)
    seen = []
    real = packed_mod.onednn_linear
    monkeypatch.setattr(packed_mod, "onednn_linear", lambda rows, pack: seen.append(rows.shape[0]) or real(rows, pack))
    group = layers(torch.float32)
    for n in range(1, 65):
        x = torch.randn(n, 64)
        with torch.inference_mode(), (contextlib.nullcontext() if with_kernels else kernels.disabled()):
            got = linears(x, *group)
        for y, m in zip(got, group):
            assert y.shape == (n, m.out_features)
            torch.testing.assert_close(y, F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
    if with_kernels:
        assert set(seen) == set(range(packed_mod.KERNEL_ROWS[torch.float32] + 8, 65, 8))
    else:
        first = 1 if packed_mod.ONEDNN_ONE_ROW else 2  # without AVX-512 one row goes to MKL's GEMV, not to oneDNN
        assert set(seen) == set(range(first, 9)) | set(range(16, 65, 8))


def test_a_small_weight_takes_the_kernels_linear_past_kernel_rows(monkeypatch):
    """A weight that stays in a core's L2 (a tiny model's layers and output head) takes the kernels' `linear` up
    to SMALL_OUTPUT outputs (rows x output width), bitwise each row alone, and oneDNN above that; a large one
    (SmolLM2's head, 576 x 49152; a 1 MB fp32 layer however narrow) keeps KERNEL_ROWS. The bounds are computed, not
    assumed: the head's 64 outputs a row give 512 rows, the main job's down projection (96 of 288) 341, its
    gate/up (576 of 96) 56."""
    import megatron_spec.models.packed as packed_mod

    if not kernels.loaded() or torch.float32 not in packed_dtypes():
        pytest.skip("needs the CPU kernels and oneDNN")
    torch.manual_seed(0)
    head = nn.Linear(96, 64, bias=False)
    assert packed_mod.kernel_rows((head,)) == packed_mod.SMALL_OUTPUT // 64 == 512
    with torch.device("meta"):
        big, wide = nn.Linear(576, 49152, bias=False), nn.Linear(1024, 256, bias=False)
        down, gate, up = nn.Linear(288, 96, bias=False), nn.Linear(96, 288, bias=False), nn.Linear(96, 288, bias=False)
    assert packed_mod.kernel_rows((big,)) == packed_mod.kernel_rows((wide,)) == packed_mod.KERNEL_ROWS[torch.float32]
    assert packed_mod.kernel_rows((down,)) == 341 and packed_mod.kernel_rows((gate, up)) == 56
    onednn, kernel = [], []
    real_onednn, real_kernel = packed_mod.onednn_linear, kernels.linear
    monkeypatch.setattr(packed_mod, "onednn_linear",
                        lambda rows, pack: onednn.append(rows.shape[0]) or real_onednn(rows, pack))
    monkeypatch.setattr(kernels, "linear", lambda x, *a: kernel.append(x.shape[0]) or real_kernel(x, *a))
    x = torch.randn(513, 96)
    with torch.inference_mode():
        alone = linears(x[:1], head)[0]
        for rows in (64, 512, 513):
            y = linears(x[:rows], head)[0]
            torch.testing.assert_close(y, F.linear(x[:rows], head.weight), rtol=1e-5, atol=1e-5)
            if rows <= 512:
                assert torch.equal(y[0], alone[0])
    assert kernel == [1, 64, 512] and onednn == [520]  # 513 rows padded to a multiple of ROW_MULTIPLE
