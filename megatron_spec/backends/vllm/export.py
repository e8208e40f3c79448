"""Our models and drafters in the layouts vLLM loads, and our drafter's refit names in vLLM's naming.

- target / draft model: HF layout as `models.hf_io.save_pretrained` writes it (vLLM's Qwen3 / Llama classes).
- MTP: our drafter's tensors unchanged, with a `config.json` that is the target's with `model_type: "mtp"`,
  `architectures: ["MegatronSpecMTP"]` (our plugin's class), `target_model_type` and `num_nextn_predict_layers`.
- EAGLE-3: the checkpoint vLLM's `Eagle3LlamaForCausalLM` / `Eagle3Qwen3ForCausalLM` load: `fc`, `midlayer.*`, `norm`,
  `lm_head` (over the draft vocabulary when the head has one, with `d2t` as vLLM wants it: offsets target - draft
  id), and a config naming `draft_vocab_size`, `target_hidden_size` and the auxiliary layer ids. vLLM captures the
  *inputs* of its aux layers, so our capture layer i (the output of layer i) is vLLM's aux id i + 1. The head's
  layer is dense whatever the target: a Qwen3-MoE target's head is a Qwen3 layer (vLLM's Qwen3-MoE model records
  the aux states), so its config is a dense `qwen3` one without the target's expert fields.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from ...models.eagle3 import Eagle3Head
from ...models.hf_io import save_pretrained, write_atomically
from ...models.mtp import MTP
from .plugin import MTP_ARCHITECTURE

EAGLE3_ARCHITECTURES = {"qwen3": "Eagle3Qwen3ForCausalLM", "qwen3_moe": "Eagle3Qwen3ForCausalLM",
                        "llama": "Eagle3LlamaForCausalLM"}
"""vLLM's EAGLE-3 drafter class for each target model_type we export (its layer as the target family's dense one)."""

EAGLE3_LAYER_TYPE = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "llama": "llama"}
"""The model_type of the head's dense layer for each target model_type: what vLLM builds the drafter's config as."""

MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef")


def drafter_kind(drafter) -> str | None:
    if drafter is None:
        return None
    if isinstance(drafter, MTP):
        return "mtp"
    if isinstance(drafter, Eagle3Head):
        return "eagle3"
    return "draft_model"


def dtype_name(module) -> str:
    return str(next(module.parameters()).dtype).removeprefix("torch.")


def export_target(model, out_dir: str | os.PathLike) -> Path:
    """HF layout, with the weights' dtype in config.json (`torch_dtype`): without it vLLM picks its own default
    (bf16 on CPU), and outputs would no longer be our engine's."""
    path = save_pretrained(model, out_dir)
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = dtype_name(model)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def export_mtp(drafter: MTP, out_dir: str | os.PathLike) -> Path:
    cfg = drafter.target_config
    n, depths = cfg.num_hidden_layers, drafter.mtp_config.num_layers
    # Our MTP layer copies the trunk's last layer (dense or MoE); vLLM builds layer n + i by the same rule as the
    # trunk's layers (`decoder_sparse_step`, `mlp_only_layers`), which may give the other kind: refuse before any engine.
    if any(cfg.is_moe_layer(n + i) != cfg.is_moe_layer(n - 1) for i in range(depths)):
        raise NotImplementedError(f"vLLM backend: with decoder_sparse_step={cfg.decoder_sparse_step} and "
                                  f"mlp_only_layers={cfg.mlp_only_layers}, vLLM would build an MTP layer of another "
                                  "kind (dense vs MoE) than the trunk's last layer our MTP layer copies")
    # model_type "mtp" is what makes vLLM accept the directory as an MTP drafter; the target's own family is kept
    # in `target_model_type` for our class to build the matching decoder layer.
    config = {**cfg.to_hf(), "model_type": "mtp", "target_model_type": cfg.model_type,
              "architectures": [MTP_ARCHITECTURE], "num_nextn_predict_layers": drafter.mtp_config.num_layers,
              "torch_dtype": dtype_name(drafter)}
    tensors = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return write_atomically(out_dir, write)


def aux_layer_ids(capture_layers) -> list[int]:
    """vLLM's auxiliary layer ids for our capture layers: distinct, ascending, each + 1 (vLLM records a layer's input,
    we record its output)."""
    return [i + 1 for i in sorted(set(capture_layers))]


def eagle3_tensors(named: dict[str, torch.Tensor], capture_layers, hidden_size: int) -> dict[str, torch.Tensor]:
    """Our head's tensors (its state dict) by vLLM's names and in vLLM's form.

    Names are the same except `d2t`: ours maps draft id -> target id, vLLM's holds the offset target - draft id.
    `fc`: vLLM records each auxiliary layer once, in layer order, so a head that fuses one layer twice (shallow
    targets: (1, 1, 1) on 4 layers) gets the fc blocks of repeated layers summed, which is the same linear map on the
    one state vLLM passes (fc(cat[h, h, h]) = (W1 + W2 + W3) h).
    """
    out = {k: v.detach().contiguous() for k, v in named.items() if k != "d2t"}
    distinct = sorted(set(capture_layers))
    if list(capture_layers) != distinct:
        blocks = out["fc.weight"].split(hidden_size, dim=1)
        out["fc.weight"] = torch.cat([sum(b for b, layer in zip(blocks, capture_layers) if layer == d)
                                      for d in distinct], dim=1).contiguous()
    if named.get("d2t") is not None:
        d2t = named["d2t"].detach().to(torch.long)
        out["d2t"] = (d2t - torch.arange(d2t.numel(), device=d2t.device)).contiguous()
    return out


def export_eagle3(head: Eagle3Head, out_dir: str | os.PathLike) -> Path:
    cfg = head.target_config
    if cfg.model_type not in EAGLE3_ARCHITECTURES:
        raise NotImplementedError(f"vLLM backend: no vLLM EAGLE-3 class for model_type {cfg.model_type!r}")
    ec = head.eagle_config
    dense = EAGLE3_LAYER_TYPE[cfg.model_type]
    family = dense if ec.qk_norm in (None, cfg.qk_norm) else ("qwen3" if ec.qk_norm else "llama")
    target = {k: v for k, v in cfg.to_hf().items() if k not in MOE_FIELDS}
    config = {**target, "model_type": dense, "architectures": [EAGLE3_ARCHITECTURES[family]], "num_hidden_layers": 1,
              "intermediate_size": ec.intermediate_size, "draft_vocab_size": ec.draft_vocab_size or cfg.vocab_size,
              "target_hidden_size": cfg.hidden_size, "torch_dtype": dtype_name(head),
              "norm_before_residual": ec.norm_before_residual,
              "num_aux_hidden_states": len(aux_layer_ids(ec.capture_layers)),
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids(ec.capture_layers),
                               "use_aux_hidden_state": True}}
    if max(aux_layer_ids(ec.capture_layers)) >= cfg.num_hidden_layers:
        raise NotImplementedError("vLLM backend: vLLM cannot capture the target's last layer output for EAGLE-3 "
                                  f"(capture layers {ec.capture_layers} on {cfg.num_hidden_layers} layers)")
    tensors = eagle3_tensors(head.state_dict(), ec.capture_layers, cfg.hidden_size)

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return write_atomically(out_dir, write)


def export_drafter(drafter, out_dir: str | os.PathLike) -> Path:
    kind = drafter_kind(drafter)
    if kind == "mtp":
        return export_mtp(drafter, out_dir)
    if kind == "eagle3":
        return export_eagle3(drafter, out_dir)
    return export_target(drafter, out_dir)

