"""EAGLE-3 with a draft vocabulary: the head's `lm_head` covers only the target ids in its `d2t` map, the map is
saved and validated with the head, and the full-vocabulary default (and the shipped checkpoint) is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_spec.drafters.files import load_drafter, save_drafter
from megatron_spec.drafters.eagle3.model import Eagle3Config, Eagle3Head

from .test_drafters import B, T, make_target, tiny, token_ids

SHIPPED = Path(__file__).resolve().parents[2] / "checkpoints"
D2T = torch.tensor([0, 2, 3, 5, 8, 13, 21, 34])  # 8 of the 40 target ids


def make_head(target, d2t=D2T):
    torch.manual_seed(1)
    return Eagle3Head.from_target(target, Eagle3Config(target.config.num_hidden_layers, (0, 1, 3)), d2t=d2t)


def test_head_rows_start_as_the_targets_rows_for_the_map():
    target = make_target()
    head = make_head(target)
    assert head.eagle_config.draft_vocab_size == 8 and head.lm_head.weight.shape == (8, 32)
    assert head.d2t.dtype == torch.long and torch.equal(head.d2t, D2T)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[D2T])
    assert "d2t" in head.state_dict()
    ids = token_ids()
    state, logits = head(head.fuse(target.trunk(ids, capture=head.capture_layers).layers), ids, None, target.embed)
    assert state.shape == (B, T, 32) and logits.shape == (B, T, 8)
    # The default stays the full vocabulary, with no map and no extra tensor name.
    full = Eagle3Head.from_target(target)
    assert full.eagle_config.draft_vocab_size == 0 and full.d2t is None and "d2t" not in full.state_dict()


def test_save_load_keeps_the_map(tmp_path):
    target = make_target()
    head = make_head(target)
    save_drafter(head, tmp_path / "d", "eagle3", target.config)
    meta = json.loads((tmp_path / "d" / "drafter_config.json").read_text())
    assert meta["config"]["draft_vocab_size"] == 8
    with safe_open(tmp_path / "d" / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("d2t"), D2T)
    loaded = load_drafter(tmp_path / "d", target.config, torch.bfloat16)
    assert loaded.d2t.dtype == torch.long and torch.equal(loaded.d2t, D2T)  # never cast with the weights
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    loaded = load_drafter(tmp_path / "d", target.config)
    ids = token_ids()
    with torch.no_grad():
        fused = head.fuse(target.trunk(ids, capture=head.capture_layers).layers)
        assert torch.equal(head(fused, ids, None, target.embed)[1], loaded(fused, ids, None, target.embed)[1])


@pytest.mark.parametrize("d2t,match", [
    (torch.tensor([0, 2, 2, 5]), "more than once.*2"),
    (torch.tensor([0, 2, 40, 5]), "outside the target vocabulary 0..39.*40"),
    (torch.tensor([0, -1, 3, 5]), "outside"),
    (torch.tensor([0.0, 1.0, 2.0, 3.0]), "integer"),
    (torch.tensor([[0, 1], [2, 3]]), "1-D"),
])
def test_bad_maps_are_rejected(d2t, match):
    target = make_target()
    with pytest.raises(ValueError, match=match):
        Eagle3Head.from_target(target, d2t=d2t)


def test_bad_sizes_are_rejected():
    target = make_target()
    with pytest.raises(ValueError, match="maps 8 draft ids, the head's draft_vocab_size is 4"):
        Eagle3Head.from_target(target, Eagle3Config(4, draft_vocab_size=4), d2t=D2T)
    with pytest.raises(ValueError, match="needs its d2t map"):
        Eagle3Head.from_target(target, Eagle3Config(4, draft_vocab_size=4))
    with pytest.raises(ValueError, match="smaller than the target's vocabulary"):
        Eagle3Head(tiny(), Eagle3Config(4, draft_vocab_size=40))
    with pytest.raises(ValueError, match="draft_vocab_size must be >= 0"):
        Eagle3Config(4, draft_vocab_size=-1)


def test_load_rejects_a_tampered_map(tmp_path):
    target = make_target()
    save_drafter(make_head(target), tmp_path / "d", "eagle3", target.config)
    weights = tmp_path / "d" / "model.safetensors"
    with safe_open(weights, "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    for bad, match in [(torch.tensor([0, 2, 3, 5, 8, 13, 21, 21]), "d2t lists target id"),
                       (torch.tensor([0, 2, 3, 5, 8, 13, 21, 99]), "d2t holds id"),
                       (torch.tensor([0, 2, 3]), "d2t maps 3 draft ids")]:
        save_file({**tensors, "d2t": bad}, str(weights))
        with pytest.raises(ValueError, match=match):
            load_drafter(tmp_path / "d", target.config)
    save_file({n: t for n, t in tensors.items() if n != "d2t"}, str(weights))
    with pytest.raises(ValueError, match="missing tensor.*d2t"):
        load_drafter(tmp_path / "d", target.config)
    head = make_head(target)
    head.d2t[0] = 2  # a duplicate made in place is caught before anything is written
    with pytest.raises(ValueError, match="more than once"):
        save_drafter(head, tmp_path / "e", "eagle3", target.config)
    assert not (tmp_path / "e").exists()


@pytest.mark.skipif(not (SHIPPED / "tiny-qwen3-eagle3").is_dir(), reason="shipped tiny EAGLE-3 head missing")
def test_shipped_full_vocabulary_head_still_loads():
    from megatron_spec.models.hf_io import read_config

    head = load_drafter(SHIPPED / "tiny-qwen3-eagle3", read_config(SHIPPED / "tiny-qwen3"))
    assert head.d2t is None and head.eagle_config.draft_vocab_size == 0
    assert head.lm_head.weight.shape[0] == 64


@pytest.mark.skipif(not (SHIPPED / "smollm2-135m-eagle3").is_dir(), reason="shipped SmolLM2 EAGLE-3 head missing")
def test_shipped_smollm2_head_loads_with_its_map():
    """Only the target's config is needed (no SmolLM2 weights): 4096 draft ids, sorted, EOS (id 2) among them."""
    from megatron_spec.models import preset

    head = load_drafter(SHIPPED / "smollm2-135m-eagle3", preset("smollm2-135m"))
    assert head.eagle_config.draft_vocab_size == 4096 and head.lm_head.weight.shape == (4096, 576)
    assert 2 in head.d2t.tolist() and torch.equal(head.d2t, head.d2t.sort().values)
