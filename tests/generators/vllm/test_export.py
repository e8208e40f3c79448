"""Export to vLLM's layouts, checked without an engine: the EAGLE-3 fc fold and d2t offsets, the MTP config."""

import json

import torch

from megatron_spec.models import from_pretrained
from megatron_spec.drafters.files import load_drafter
from megatron_spec.drafters.eagle3.model import Eagle3Config, Eagle3Head

from .common import vllm_only

pytestmark = vllm_only


def test_eagle3_fc_fold_is_the_same_linear_map():
    """The shipped head fuses layer 1 three times; vLLM passes that state once, so the exported fc (blocks summed)
    applied to h must equal ours applied to cat[h, h, h] (fp32, sums of 3 products: 1e-6)."""
    from megatron_spec.drafters.eagle3.export import aux_layer_ids, eagle3_tensors

    target = from_pretrained("checkpoints/tiny-qwen3")
    head = load_drafter("checkpoints/tiny-qwen3-eagle3", target.config)
    assert head.capture_layers == (1, 1, 1) and aux_layer_ids(head.capture_layers) == [2]
    out = eagle3_tensors(head.state_dict(), head.capture_layers, target.config.hidden_size)
    h = torch.randn(5, target.config.hidden_size)
    assert torch.allclose(h @ out["fc.weight"].T, head.fc(torch.cat([h, h, h], -1)), atol=1e-6)


def test_eagle3_distinct_layers_and_draft_vocab_offsets():
    """Distinct capture layers keep fc as is, with aux ids shifted by one (vLLM records layer inputs); a draft
    vocabulary's d2t becomes vLLM's offsets, and target = draft id + offset recovers our map exactly."""
    from megatron_spec.drafters.eagle3.export import aux_layer_ids, eagle3_tensors

    target = from_pretrained("checkpoints/tiny-qwen3")
    d2t = torch.tensor([2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37])
    head = Eagle3Head.from_target(target, Eagle3Config(4, (0, 1, 2)), d2t=d2t)
    out = eagle3_tensors(head.state_dict(), head.capture_layers, target.config.hidden_size)
    assert aux_layer_ids(head.capture_layers) == [1, 2, 3]
    assert torch.equal(out["fc.weight"], head.fc.weight)
    assert torch.equal(torch.arange(12) + out["d2t"], d2t)


def test_mtp_export_config(tmp_path):
    from megatron_spec.generators.vllm.export import export_drafter

    target = from_pretrained("checkpoints/tiny-qwen3")
    head = load_drafter("checkpoints/tiny-qwen3-mtp", target.config)
    cfg = json.loads((export_drafter(head, tmp_path / "mtp") / "config.json").read_text())
    assert cfg["model_type"] == "mtp" and cfg["target_model_type"] == "qwen3"
    assert cfg["architectures"] == ["MegatronSpecMTP"] and cfg["num_nextn_predict_layers"] == 1
    assert cfg["torch_dtype"] == "float32"
