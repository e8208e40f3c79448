"""The refit's projection from the implemented topology (`megatron_spec/sim/refit.py`): stages partition the model,
a one-stage refit with nothing to gather is its bytes over the receiver's link, and the 235B recipe's layout is
bounded below by its receivers' NICs at line rate."""

import pytest

from megatron_spec.sim.config import resolve_model
from megatron_spec.sim.hardware import NDR_IB_BW, hardware
from megatron_spec.sim.refit import CutShare, RefitTopology, project, refit_report, stage_bytes, stage_layers
from megatron_spec.sim.shapes import shape_of

RECIPE = RefitTopology(tp=2, pp=8, ep=8, engines=8, gen_tp=8, first_stage_layers=12, last_stage_layers=10)
"""The 235B recipe's layout (recipes/qwen3_235b_grpo_spec.py: TP2 x PP8 x EP8, 8 engines of vLLM TP8)."""


def test_stages_partition_the_model():
    """The 235B recipe's 94 layers as 12, six middle stages of 12, and 10; the stages' bytes add up to the whole
    model (untied head) plus the drafter, in bf16."""
    shape = shape_of(resolve_model("qwen3-235b-a22b"))
    assert stage_layers(shape, RECIPE) == [12] * 7 + [10]
    stages = stage_bytes(shape, RECIPE, 2, drafter_params=1e9)
    assert sum(stages) == pytest.approx(2 * (shape.total_params + 1e9), rel=1e-12)
    with pytest.raises(ValueError, match="cannot fill"):
        stage_layers(shape, RefitTopology(tp=1, pp=8, ep=1, engines=1, gen_tp=1, first_stage_layers=90,
                                          last_stage_layers=10))


def test_one_stage_with_nothing_to_gather_is_its_bytes_over_the_nic():
    """TP = EP = 1, one stage: nothing is gathered, so the refit is the model's bytes over one receiver's NIC at
    `link_eff`, exactly. Sharded over the engines' TP4: qwen3-8b's 8 kv heads split evenly, so what is not split
    is the norms (2 x 4096 + 2 x 128 per layer, 36 layers: 304,128 parameters, 608,256 bytes in bf16); a receiver
    takes a quarter of the rest plus those, the sender's link the model plus three more copies of them, and the
    sender's link is the bound."""
    shape, hw = shape_of(resolve_model("qwen3-8b")), hardware("h100")
    top = RefitTopology(tp=1, pp=1, ep=1, engines=2, gen_tp=4, link_eff=0.5)
    nbytes = sum(stage_bytes(shape, top, 2))
    assert project(shape, top, hw).seconds == pytest.approx(nbytes / (NDR_IB_BW * 0.5), rel=1e-12)
    p = project(shape, top, hw, cut=CutShare.of(resolve_model("qwen3-8b")))
    assert p.receiver_bytes == pytest.approx((nbytes - 608_256) / 4 + 608_256, rel=1e-12)
    assert p.sender_wire_bytes == [pytest.approx(nbytes + 3 * 608_256, rel=1e-12)]
    assert p.seconds == pytest.approx((nbytes + 3 * 608_256) / (NDR_IB_BW * 0.5), rel=1e-12)


def test_recipe_refit_is_bounded_by_the_receivers_links():
    """Every receiver takes the whole model through its NIC: the refit cannot beat those bytes at line rate, and
    with gathers inside NVLink domains it stays within one bucket's gather of the bytes at `link_eff`."""
    shape, hw = shape_of(resolve_model("qwen3-235b-a22b")), hardware("h100")
    p = project(shape, RECIPE, hw)
    wire = p.receiver_bytes / (NDR_IB_BW * RECIPE.link_eff)
    assert p.receiver_bytes == pytest.approx(2 * shape.total_params)
    assert wire <= p.seconds <= wire + 512 * 2**20 / p.gather_bw


def test_colocated_refit_walks_the_whole_model_on_every_gpu():
    """Colocated (the per-GPU CUDA IPC refit): every trainer GPU receives the whole model, the other stages' buckets
    through its NIC when the pipeline spans nodes, so the recipe's layout colocated is bounded by the same bytes at
    line rate as disaggregated; with one stage and nothing to gather the bytes cross NVLink (half its two-way
    figure) or the IPC device copy (half the HBM bandwidth), whichever is slower."""
    shape, hw = shape_of(resolve_model("qwen3-235b-a22b")), hardware("h100")
    coloc = RefitTopology(tp=2, pp=8, ep=8, engines=16, gen_tp=8, colocated=True, first_stage_layers=12,
                          last_stage_layers=10)
    p = project(shape, coloc, hw)
    wire = p.receiver_bytes / (NDR_IB_BW * coloc.link_eff)
    assert p.receiver_bytes == pytest.approx(2 * shape.total_params) and "NIC" in p.receive_link
    assert wire <= p.seconds <= wire + 512 * 2**20 / p.gather_bw
    small = shape_of(resolve_model("qwen3-8b"))
    one = RefitTopology(tp=1, pp=1, ep=1, engines=8, gen_tp=1, colocated=True)
    nbytes = sum(stage_bytes(small, one, 2))
    slower = min(hw.link_bw / 2 * one.link_eff, hw.mem_bw / 2)
    assert project(small, one, hw).seconds == pytest.approx(nbytes / slower, rel=1e-12)
    assert "CUDA IPC" in refit_report("qwen3-235b-a22b", coloc)


def test_recipe_sharded_takes_the_busiest_link_with_the_senders_at_once():
    """The recipe sharded: a receiver takes 1/8 of each split tensor, k / v at one of the 4 kv heads (a quarter),
    norms and router gates whole (about 59 GB of 470); each sender still puts its whole stage on its link. The
    receivers take the senders at once, so the refit is bound by the busiest link: the busiest sender's stage or a
    receiver's share, whichever is larger (here the sender's 61 GB), plus the first bucket's gather; the stages'
    sends taken one after another would have added up to about the whole-tensor refit."""
    cfg = resolve_model("qwen3-235b-a22b")
    shape, hw = shape_of(cfg), hardware("h100")
    bw = NDR_IB_BW * RECIPE.link_eff
    p = project(shape, RECIPE, hw, cut=CutShare.of(cfg))
    assert 58e9 < p.receiver_bytes < 60e9
    floor = max(max(p.sender_wire_bytes), p.receiver_bytes) / bw
    assert floor <= p.seconds <= floor + 512 * 2**20 / p.gather_bw
    assert p.seconds < sum(p.sender_wire_bytes) / bw / 5
    whole = project(shape, RECIPE, hw)
    assert whole.receiver_bytes / bw <= whole.seconds <= whole.receiver_bytes / bw + 512 * 2**20 / whole.gather_bw
    with pytest.raises(ValueError, match="never sharded"):
        project(shape, RefitTopology(tp=2, pp=8, ep=8, engines=16, gen_tp=8, colocated=True), hw, cut=CutShare.of(cfg))


def test_report_states_its_assumptions():
    text = refit_report("qwen3-235b-a22b", RECIPE)
    for part in ("senders: 8 (one per pipeline stage)", "whole tensors", "links at 90% of the spec sheet",
                 "buckets of 512 MiB", "refit with whole tensors: 10.4 s", "k / v 0.25 of each",
                 "refit sharded (backend.refit_shard_receivers, as implemented): 1.4 s", "taken at once"):
        assert part in text
