"""The sharded refit under Ray: a disaggregated run with one vLLM engine of TP2 (an embedded trainer sending) forms
the weight-update group in its sharded mode (`CollectiveRefit.shard_geometry`), and every step's refit lands
exactly: the engine's log-probs stay the trainer's, and the sender puts on the wire each split tensor once and
each whole one (norms, the drafter) once per TP rank."""

import pytest

from megatron_spec.rl import loop
from megatron_spec.rl.logging import read_metrics
from tests.generators.vllm.common import vllm_only
from tests.placement.test_driver import ray_cfg
from tests.rl.test_loop import ckpts, shaped_reward  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.ray, *vllm_only]


def sharded_wire_bytes(ckpts) -> int:
    """tiny-qwen3 over TP2 (4 heads, 2 kv heads, vocabulary 64 = its padding, widths 128 / 384): every target
    tensor but the norms splits in two, so the sender sends it once; norms and the MTP drafter go whole to both
    groups. fp32, the engine's served dtype."""
    from megatron_spec.drafters.files import load_drafter
    from megatron_spec.models import from_pretrained
    from megatron_spec.refit import DRAFTER_PREFIX, named_weights

    model = from_pretrained(str(ckpts / "policy"))
    total = 0
    for name, t in named_weights(model, load_drafter(str(ckpts / "mtp"), model.config)):
        whole = name.startswith(DRAFTER_PREFIX) or "norm" in name
        total += t.numel() * t.element_size() * (2 if whole else 1)
    return total


def test_disaggregated_ray_run_refits_a_tp2_vllm_engine_sharded(ray_cluster, ckpts, tmp_path,  # noqa: F811
                                                                 shaped_reward):
    """Two steps; each step's refit sends `sharded_wire_bytes` over the collective transport (against twice the
    split tensors had every worker taken whole tensors), and the engine's log-probs match the trainer's
    recomputation (`logprob_mismatch` < 1e-4: a worker that loaded a wrong part would be far off)."""
    cfg = ray_cfg(ckpts, tmp_path, "disaggregated", steps=2)
    cfg.backend.generator = "vllm"
    cfg.backend.vllm.tensor_parallel_size = 2
    cfg.backend.vllm.max_model_len = 256
    loop.train(cfg)
    metrics = read_metrics(tmp_path)
    assert len(metrics) == 2
    for m in metrics:
        assert m["weight_sync_transport"] == "collective"
        assert m["weight_sync_bytes"] == sharded_wire_bytes(ckpts)
        assert m["logprob_mismatch"] < 1e-4
