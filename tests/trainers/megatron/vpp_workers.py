"""What the spawned ranks run for `test_virtual_pipeline.py`: 2 GRPO steps of one tiny 4-layer policy at a given
layout (virtual pipeline stages or not), on `schedule_workers`' micro-batches of 8 different lengths."""

from __future__ import annotations

from megatron_spec.models import CausalLM

from .common import hf_tensors, policy_part, tiny
from .policy_workers import SAMPLING, grpo, with_policy_old
from .schedule_workers import BUDGET, varied_batches

LAYERS = 4


def our_model(cfg) -> CausalLM:
    """`policy_workers.our_model`, also for a tied head (whose HF tensors store no `lm_head.weight`)."""
    model = CausalLM(cfg)
    missing, unexpected = model.load_state_dict(policy_part(hf_tensors(cfg, mtp_layers=0)), strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if cfg.tie_word_embeddings else []), (missing, unexpected)
    assert not cfg.tie_word_embeddings or model.lm_head.weight is model.model.embed_tokens.weight
    return model


def two_steps(rank: int, world: int, kind: str, layout: dict, layers: int = LAYERS) -> dict:
    """Each step's metrics and the exported weights after it; the chunks' global layer numbers; this rank's
    stage's share of the refit into engines (`stage_buckets`, 64 KiB buckets) after the last step."""
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.importer import layer_offset
    from megatron_spec.trainers.megatron.policy import MegatronPolicy
    from megatron_spec.trainers.megatron.refit_stream import stage_buckets

    cfg = tiny(kind, num_hidden_layers=layers)
    policy = MegatronPolicy(our_model(cfg), grpo(micro_batch_tokens=BUDGET), SAMPLING, Parallelism(**layout))
    metrics, weights = [], []
    for b in varied_batches(cfg, 8):
        metrics.append(policy.train_step(with_policy_old(b, policy.logprobs(b))))
        weights.append({n: t.clone() for n, t in policy.export_weights()})
    layers = [[layer_offset(c) + j for j in range(len(c.decoder.layers))] for c in policy.chunks]
    stage = {n: t.clone() for bucket in stage_buckets(policy.chunks, 1 << 16) for n, t in bucket}
    return {"metrics": metrics, "weights": weights, "layers": layers, "stage": stage}


def resumed(rank: int, world: int, root: str, kind: str, saved_at: dict, loaded_at: dict) -> dict:
    """3 steps straight at `saved_at`, against 1 step there, a sharded checkpoint (`save_sharded`), and 2 steps
    of a policy at `loaded_at` that loads it: the last 2 steps' metrics and the weights after them."""
    from pathlib import Path

    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy

    cfg = tiny(kind, num_hidden_layers=LAYERS)
    batches = varied_batches(cfg, 8, n=3)

    def make(layout):
        return MegatronPolicy(our_model(cfg), grpo(micro_batch_tokens=BUDGET), SAMPLING, Parallelism(**layout))

    def steps(policy, todo):
        metrics = [policy.train_step(with_policy_old(b, policy.logprobs(b))) for b in todo]
        return {"metrics": metrics, "weights": {n: t.clone() for n, t in policy.export_weights()}}

    out = {"straight": steps(make(saved_at), batches)}
    first = make(saved_at)
    steps(first, batches[:1])
    ckpt = Path(root) / "ckpt"
    state = first.save_sharded(ckpt)
    second = make(loaded_at)
    second.load_state_dict({**state, "sharded_dir": str(ckpt)})
    out["resumed"] = steps(second, batches[1:])
    return out
