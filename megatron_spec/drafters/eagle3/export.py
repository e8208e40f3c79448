"""The EAGLE-3 head in the layout vLLM loads, and its refit tensors in vLLM's form.

The checkpoint vLLM's `Eagle3LlamaForCausalLM` / `Eagle3Qwen3ForCausalLM` load: `fc`, `midlayer.*`, `norm`,
`lm_head` (over the draft vocabulary when the head has one, with `d2t` as vLLM wants it: offsets target - draft
id), and a config naming `draft_vocab_size`, `target_hidden_size` and the auxiliary layer ids. vLLM captures the
*inputs* of its aux layers, so our capture layer i (the output of layer i) is vLLM's aux id i + 1. The head's
layer is dense whatever the target: a Qwen3-MoE target's head is a Qwen3 layer (vLLM's Qwen3-MoE model records
the aux states), so its config is a dense `qwen3` one without the target's expert fields. Written from the module,
or from checkpoint files in our layout or a public one (`generators.vllm.export`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

from ...generators.vllm.export import (DrafterExport, TensorFiles, as_loaded, checked_files, entries_of,
                                       loaded_dtype, write_export)
from ...models.config import ModelConfig
from .model import Eagle3Config, Eagle3Head, check_d2t

EAGLE3_ARCHITECTURES = {"qwen3": "Eagle3Qwen3ForCausalLM", "qwen3_moe": "Eagle3Qwen3ForCausalLM",
                        "llama": "Eagle3LlamaForCausalLM"}
"""vLLM's EAGLE-3 drafter class for each target model_type we export (its layer as the target family's dense one)."""

EAGLE3_LAYER_TYPE = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "llama": "llama"}
"""The model_type of the head's dense layer for each target model_type: what vLLM builds the drafter's config as."""

MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef")


def aux_layer_ids(capture_layers) -> list[int]:
    """vLLM's auxiliary layer ids for our capture layers: distinct, ascending, each + 1 (vLLM records a layer's input,
    we record its output)."""
    return [i + 1 for i in sorted(set(capture_layers))]


def eagle3_tensor(name: str, t: torch.Tensor, capture_layers, hidden_size: int) -> torch.Tensor:
    """One tensor of our head (by its state-dict name) in vLLM's form.

    Names are the same; `d2t`: ours maps draft id -> target id, vLLM's holds the offset target - draft id.
    `fc`: vLLM records each auxiliary layer once, in layer order, so a head that fuses one layer twice (shallow
    targets: (1, 1, 1) on 4 layers) gets the fc blocks of repeated layers summed, which is the same linear map on the
    one state vLLM passes (fc(cat[h, h, h]) = (W1 + W2 + W3) h).
    """
    if name == "d2t":
        d2t = t.detach().to(torch.long)
        return (d2t - torch.arange(d2t.numel(), device=d2t.device)).contiguous()
    distinct = sorted(set(capture_layers))
    if name == "fc.weight" and list(capture_layers) != distinct:
        blocks = t.detach().split(hidden_size, dim=1)
        return torch.cat([sum(b for b, layer in zip(blocks, capture_layers) if layer == d) for d in distinct],
                         dim=1).contiguous()
    return t.detach().contiguous()


def eagle3_shape(name: str, shape: tuple[int, ...], capture_layers, hidden_size: int) -> tuple[int, ...]:
    """The shape `eagle3_tensor` gives the tensor `name` of shape `shape`."""
    if name == "fc.weight":
        return (shape[0], hidden_size * len(set(capture_layers)))
    return tuple(shape)


def eagle3_tensors(named: dict[str, torch.Tensor], capture_layers, hidden_size: int) -> dict[str, torch.Tensor]:
    """Our head's tensors (its state dict, `d2t` None when absent) by vLLM's names and in vLLM's form
    (`eagle3_tensor`)."""
    return {k: eagle3_tensor(k, v, capture_layers, hidden_size) for k, v in named.items() if v is not None}


def eagle3_config(cfg: ModelConfig, ec: Eagle3Config, dtype: torch.dtype) -> dict:
    """config.json of the EAGLE-3 drafter directory for target config `cfg` and the head's resolved config `ec`
    (its `intermediate_size` set); refuses a head vLLM cannot run."""
    if cfg.model_type not in EAGLE3_ARCHITECTURES:
        raise NotImplementedError(f"vLLM backend: no vLLM EAGLE-3 class for model_type {cfg.model_type!r}")
    dense = EAGLE3_LAYER_TYPE[cfg.model_type]
    family = dense if ec.qk_norm in (None, cfg.qk_norm) else ("qwen3" if ec.qk_norm else "llama")
    target = {k: v for k, v in cfg.to_hf().items() if k not in MOE_FIELDS}
    config = {**target, "model_type": dense, "architectures": [EAGLE3_ARCHITECTURES[family]], "num_hidden_layers": 1,
              "intermediate_size": ec.intermediate_size, "draft_vocab_size": ec.draft_vocab_size or cfg.vocab_size,
              "target_hidden_size": cfg.hidden_size, "torch_dtype": str(dtype).removeprefix("torch."),
              "norm_before_residual": ec.norm_before_residual,
              "num_aux_hidden_states": len(aux_layer_ids(ec.capture_layers)),
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids(ec.capture_layers),
                               "use_aux_hidden_state": True}}
    if max(aux_layer_ids(ec.capture_layers)) >= cfg.num_hidden_layers:
        raise NotImplementedError("vLLM backend: vLLM cannot capture the target's last layer output for EAGLE-3 "
                                  f"(capture layers {ec.capture_layers} on {cfg.num_hidden_layers} layers)")
    return config


def eagle3_form(ec: Eagle3Config, hidden_size: int) -> dict:
    """How the vLLM worker converts streamed tensors of this head (`worker.megatron_spec_join`'s `drafter_form`):
    the arguments of `eagle3_tensors` after the tensors, under the method's name."""
    return {"eagle3": [list(ec.capture_layers), hidden_size]}


def export_eagle3(head: Eagle3Head, out_dir: str | os.PathLike) -> Path:
    cfg, ec = head.target_config, head.eagle_config
    config = eagle3_config(cfg, ec, next(head.parameters()).dtype)
    tensors = eagle3_tensors(head.state_dict(), ec.capture_layers, cfg.hidden_size)
    return write_export(out_dir, config, entries_of(tensors), tensors.__getitem__)


def head_form(head: Eagle3Head) -> list:
    """`eagle3_form` of a head module."""
    return eagle3_form(head.eagle_config, head.target_config.hidden_size)


def export_eagle3_files(path: Path, target: ModelConfig, out_dir, dtype: torch.dtype) -> DrafterExport:
    """`export_eagle3`'s directory from a checkpoint in our layout or a public one, tensor by tensor
    (`export.export_drafter_files`)."""
    from .public import public_layout

    if not (path / "drafter_config.json").is_file() and public_layout(path) is not None:
        return export_public_files(path, target, out_dir, dtype)
    dcfg, files = checked_files(path, target, "eagle3")
    # The head's config as `Eagle3Head` resolves it (intermediate_size 0: the target's).
    ec = Eagle3Config(dcfg.target_num_layers, dcfg.capture_layers, dcfg.intermediate_size or target.intermediate_size,
                      dcfg.draft_vocab_size, dcfg.norm_before_residual, dcfg.qk_norm)
    if ec.draft_vocab_size and "d2t" in files.meta:
        check_d2t(files.get("d2t"), ec.draft_vocab_size, target.vocab_size, f"{path}: d2t")
    H, capture = target.hidden_size, ec.capture_layers
    config = eagle3_config(target, ec, dtype)
    entries = {n: (torch.long if n == "d2t" else loaded_dtype(d, dtype), eagle3_shape(n, shape, capture, H))
               for n, (d, shape) in files.meta.items()}
    return DrafterExport(write_export(out_dir, config, entries,
                                      lambda n: eagle3_tensor(n, as_loaded(files.get(n), dtype), capture, H)),
                         eagle3_form(ec, H))


def export_public_files(path: Path, target: ModelConfig, out_dir, dtype: torch.dtype) -> DrafterExport:
    """A public EAGLE-3 head (speculators / SpecForge layout): checked as `drafters.eagle3.public.load_public_eagle3`
    checks it, then written tensor by tensor the way that head's module would be exported (its fc padded to three
    blocks with zeros and folded back, its offsets turned into our d2t and back), so the bytes are the same."""
    from . import public as pub

    if pub.public_layout(path) is None:
        raise ValueError(f"{path} is not an EAGLE-3 checkpoint in the speculators or SpecForge layout")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"no safetensors weights in EAGLE-3 checkpoint {path}")
    by_name: dict[str, Path] = {}
    for file in weights:  # a name in several files: the last one's, as `load_public_eagle3` reads them
        with safe_open(file, "pt") as f:
            by_name.update({name: file for name in f.keys()})
    files = TensorFiles(by_name)
    H = target.hidden_size
    head = pub.resolve_public_eagle3(path, target, {n: shape for n, (_, shape) in files.meta.items()}, files.get)
    eagle, capture = head.eagle, head.eagle.capture_layers
    ec = Eagle3Config(eagle.target_num_layers, eagle.capture_layers, eagle.intermediate_size or
                      target.intermediate_size, eagle.draft_vocab_size, eagle.norm_before_residual, eagle.qk_norm)

    def loaded(name: str) -> torch.Tensor:
        """The head's tensor `name` as `load_public_eagle3` builds it."""
        if name == "d2t":
            return head.d2t
        if name == "fc.weight":
            return pub.padded_fc(files.get("fc.weight"), H, head.n_aux).to(dtype)
        return files.get(head.source[name]).to(dtype)

    shapes = {ours: files.meta[k][1] for ours, k in head.source.items()}
    shapes["fc.weight"] = (shapes["fc.weight"][0], 3 * H)
    if head.d2t is not None:
        shapes["d2t"] = tuple(head.d2t.shape)
    entries = {n: (torch.long if n == "d2t" else dtype, eagle3_shape(n, shape, capture, H))
               for n, shape in shapes.items()}
    return DrafterExport(write_export(out_dir, eagle3_config(target, ec, dtype), entries,
                                      lambda n: eagle3_tensor(n, loaded(n), capture, H)), eagle3_form(ec, H))


