"""Megatron-Core on 2 gloo ranks (CPU): HF -> Megatron -> HF for TP=2, EP=2 and PP=2, bitwise against the TP=1
export and the source; Megatron-Core's own forward (on CPU through `cpu.on_cpu`) against our CausalLM
and MTP drafter; MTP-only training leaves the trunk untouched; import errors name the problem.

All scenarios run in one spawned pair of processes (`workers.run_all`, ~1 minute: importing megatron-core dominates);
each test below checks one part of the result.
"""

from __future__ import annotations

import pytest
import torch

from .common import MTP_LAYERS, drafter_part, hf_tensors, reference_logits, tiny, token_ids

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")


@pytest.fixture(scope="module")
def runs():
    from megatron_spec.trainers.megatron.parallel import spawn

    from .workers import run_all

    ranks = spawn(run_all, 2)
    return ranks


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    different = [n for n in a if not (a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]))]
    assert not different, f"{len(different)} tensor(s) differ, e.g. {different[:3]}"


@pytest.mark.parametrize("kind, layout", [("dense", "tp1"), ("dense", "tp2"), ("dense", "pp2"),
                                          ("moe", "tp1"), ("moe", "tp2"), ("moe", "ep2"), ("moe", "pp2"),
                                          ("mixed", "ep2"), ("mixed", "pp2"), ("tied", "tp2"), ("tied", "pp2")])
def test_hf_megatron_hf_round_trip_is_bitwise(runs, kind, layout):
    source = hf_tensors(tiny(kind))
    for rank in runs:  # every rank drains the generator and gets every tensor
        assert_same(rank[kind, layout]["export"], source)


@pytest.mark.parametrize("kind, layout",
                         [("dense", "tp2"), ("dense", "pp2"), ("moe", "tp2"), ("moe", "ep2"), ("moe", "pp2")])
def test_parallel_export_equals_tp1_export(runs, kind, layout):
    assert_same(runs[0][kind, layout]["export"], runs[0][kind, "tp1"]["export"])


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tp2_export_of_megatron_init_equals_tp1_export_of_the_same_seed(runs, kind):
    """No importer involved: Megatron-Core draws the full weights from the seed and splits them; only a correct
    gather (and QKV / gate-up / vocab handling) gives back the TP=1 model bitwise."""
    tp1, tp2 = runs[0][kind, "native_tp1"], runs[0][kind, "native_tp2"]
    assert_same(tp2, tp1)
    assert any(n.startswith("mtp.layers.1.") for n in tp1) and len(tp1) == len(hf_tensors(tiny(kind)))


def test_buckets_are_bounded(runs):
    from .workers import BUCKET_BYTES

    for kind, layout in [("dense", "tp2"), ("moe", "ep2"), ("moe", "pp2")]:
        r = runs[0][kind, layout]
        assert len(r["bucket_sizes"]) > 3
        # No single parameter exceeds the bound here, so no bucket may.
        assert max(r["bucket_bytes"]) <= BUCKET_BYTES


@pytest.mark.parametrize("kind, layout", [("dense", "tp1"), ("dense", "tp2"), ("moe", "tp1"), ("moe", "tp2"), ("moe", "ep2"),
                                          ("mixed", "ep2"), ("tied", "tp2")])
def test_megatron_logits_equal_our_models(runs, kind, layout):
    """Megatron-Core's forward (fp32, CPU) == our CausalLM and our MTP drafter on the same weights, to 1e-5."""
    cfg = tiny(kind)
    policy, mtp = reference_logits(cfg, hf_tensors(cfg), token_ids(cfg))
    r = runs[0][kind, layout]
    torch.testing.assert_close(r["logits"], policy, rtol=1e-5, atol=1e-5)
    assert len(r["mtp_logits"]) == len(mtp) == MTP_LAYERS
    for depth, (ours, theirs) in enumerate(zip(mtp, r["mtp_logits"])):
        # Depth k predicts token t+k+2; Megatron rolls ids with zero fill, so its last k+1 rows have no input.
        torch.testing.assert_close(theirs[:, : ours.shape[1]], ours, rtol=1e-5, atol=1e-5, msg=f"MTP depth {depth}")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_training_only_mtp_leaves_the_trunk_untouched(runs, kind):
    r = runs[0][kind, "train_mtp"]
    assert r["loss"] > 0
    assert r["trunk_with_grad"] == []
    assert r["mtp_without_grad"] == []
    assert r["changed"] == [n for n in r["params"] if n.startswith("mtp.")]


def test_import_errors_name_the_problem(runs):
    errors = runs[0]["errors"]
    assert "mlp.up_proj.weight" in errors["wrong_shape"] and "decoder.layers.1.mlp.linear_fc1.weight" in errors["wrong_shape"]
    assert "1 missing tensor(s)" in errors["missing"] and "model.layers.1.self_attn.k_norm.weight" in errors["missing"]
    assert "1 unexpected tensor(s)" in errors["unexpected"] and "model.layers.7.mlp.up_proj.weight" in errors["unexpected"]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_our_model_from_the_export_matches_hf_transformers(runs, kind, tmp_path):
    """The TP=2 export, saved as an HF checkpoint: our CausalLM and HF transformers give the same logits (fp32)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e .[hf]")
    from megatron_spec.models import from_pretrained

    from .common import policy_part, save_hf_dir

    cfg = tiny(kind)
    exported = runs[0][kind, "tp2"]["export"]
    assert drafter_part(exported)  # the drafter came along; the HF model does not load it
    path = save_hf_dir(cfg, policy_part(exported), tmp_path / "ckpt", max_shard_bytes=64 * 1024)
    ids = token_ids(cfg)
    ours = from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
