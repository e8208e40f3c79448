"""Tiny models and seeded HF checkpoints shared by the Megatron backend tests (no megatron-core needed here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_spec.models import CausalLM, ModelConfig
from megatron_spec.models.hf_io import save_tensors
from megatron_spec.drafters.mtp.model import MTP, MTPConfig

MTP_LAYERS = 2


def tiny(kind: str, **overrides) -> ModelConfig:
    """hidden 64, 2 layers, 4 heads / 2 kv heads; `moe` adds 4 experts (top-2), `mixed` keeps layer 0 dense and
    does not renormalise the top-k router weights, `tied` is Llama with a tied head. Vocab 96 is padded by Megatron."""
    d = dict(
        model_type="qwen3", vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=64, qk_norm=True,
    )
    if kind == "moe":
        d.update(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if kind == "mixed":  # layer 0 dense, layer 1 MoE, router without top-k renormalisation
        d.update(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 mlp_only_layers=(0,), norm_topk_prob=False)
    if kind == "tied":  # Llama / SmolLM2 style: no QK-norm, output head tied to the embedding
        d.update(model_type="llama", qk_norm=False, tie_word_embeddings=True)
    d.update(overrides)
    return ModelConfig(**d)


def hf_tensors(cfg: ModelConfig, mtp_layers: int = MTP_LAYERS, seed: int = 0) -> dict[str, torch.Tensor]:
    """A seeded policy + MTP drafter in HF names. Norm weights are random around 1 (not all ones), so a swapped
    or misplaced norm changes the logits and cannot pass unnoticed."""
    torch.manual_seed(seed)
    tensors = dict(CausalLM(cfg).state_dict())
    if mtp_layers:
        tensors.update(MTP(cfg, MTPConfig(num_layers=mtp_layers)).state_dict())
    g = torch.Generator().manual_seed(seed + 1)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight")  # HF layout: a tied head is not stored
    return {n: t.detach().clone() for n, t in tensors.items()}


def policy_part(tensors: dict) -> dict:
    return {n: t for n, t in tensors.items() if not n.startswith("mtp.")}


def drafter_part(tensors: dict) -> dict:
    return {n: t for n, t in tensors.items() if n.startswith("mtp.")}


def save_hf_dir(cfg: ModelConfig, tensors: dict, out: Path, max_shard_bytes: int | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf()))
    save_tensors(tensors, out, max_shard_bytes)
    return out


def token_ids(cfg: ModelConfig, batch: int = 2, length: int = 12, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def reference_logits(cfg: ModelConfig, tensors: dict, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Our CausalLM's logits and our MTP drafter's per-depth logits for `ids`, from HF-named tensors."""
    model = CausalLM(cfg).eval()
    policy = policy_part(tensors)
    if cfg.tie_word_embeddings:
        policy["lm_head.weight"] = policy["model.embed_tokens.weight"]
    model.load_state_dict(policy)
    mtp_layers = len({n.split(".")[2] for n in drafter_part(tensors)})
    drafter = MTP(cfg, MTPConfig(num_layers=mtp_layers)).eval()
    drafter.load_state_dict(drafter_part(tensors))
    with torch.no_grad():
        hidden = model.trunk(ids).hidden
        return model.lm_head(hidden), drafter.forward_all(hidden, ids, None, model.embed, model.lm_head)


def sharded_tensors(ckpt_dir) -> dict[str, torch.Tensor]:
    """Every tensor of a run checkpoint's `policy/` shards (`torch_dist`), read whole in this process (no process
    group needed)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    out: dict = {}
    _load_state_dict(out, storage_reader=FileSystemReader(str(Path(ckpt_dir) / "policy")),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
