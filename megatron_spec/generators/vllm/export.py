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

A drafter is exported either from its module (a loop that holds one) or from its checkpoint files
(`export_drafter_files`: a loop that holds no model, where a drafter module on rank 0 would cost GBs at scale). The
files path reads each tensor by name from the memory-mapped safetensors files, converts it as the module path does
(same functions, same arithmetic) and writes it before reading the next, so both paths write the same bytes and
the files path holds one tensor at a time. Either path checks the checkpoint against the policy's config first.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from ...models.config import ModelConfig
from ...drafters.eagle3.model import Eagle3Config, Eagle3Head
from ...models.hf_io import save_pretrained, write_atomically
from ...drafters.mtp.model import MTP, MTPConfig
from .plugin import MTP_ARCHITECTURE

WEIGHTS = "model.safetensors"
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
"""safetensors' dtype names of the tensors an export writes."""

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


def entries_of(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}


def write_safetensors(file: Path, entries: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                      tensor: Callable[[str], torch.Tensor]) -> None:
    """One safetensors file of the tensors named in `entries` (name -> dtype, shape), each fetched by
    `tensor(name)` only when its bytes are written: the header first (`__metadata__` {"format": "pt"}), then the
    data, ordered by element size (largest first, so every tensor starts aligned to its element) and name.
    A fetched tensor whose dtype or shape differs from its entry raises."""
    order = sorted(entries, key=lambda n: (-entries[n][0].itemsize, n))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in order:
        dtype, shape = entries[name]
        size = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            t = tensor(name)
            if (t.dtype, tuple(t.shape)) != entries[name]:
                raise ValueError(f"export of {name}: got {t.dtype} {tuple(t.shape)}, expected {entries[name]}")
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def write_export(out_dir: str | os.PathLike, config: dict, entries, tensor: Callable[[str], torch.Tensor]) -> Path:
    """`out_dir` (atomically) with `config.json` and the tensors of `entries` in one `model.safetensors`."""
    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        write_safetensors(tmp / WEIGHTS, entries, tensor)

    return write_atomically(out_dir, write)


def export_target(model, out_dir: str | os.PathLike) -> Path:
    """HF layout, with the weights' dtype in config.json (`torch_dtype`): without it vLLM picks its own default
    (bf16 on CPU), and outputs would no longer be our engine's."""
    path = save_pretrained(model, out_dir)
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = dtype_name(model)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def mtp_config(cfg: ModelConfig, mtp: MTPConfig, dtype: torch.dtype) -> dict:
    """config.json of the MTP drafter directory for target config `cfg`; refuses a layer kind vLLM would not build."""
    n, depths = cfg.num_hidden_layers, mtp.num_layers
    # Our MTP layer copies the trunk's last layer (dense or MoE); vLLM builds layer n + i by the same rule as the
    # trunk's layers (`decoder_sparse_step`, `mlp_only_layers`), which may give the other kind: refuse before any
    # engine.
    if any(cfg.is_moe_layer(n + i) != cfg.is_moe_layer(n - 1) for i in range(depths)):
        raise NotImplementedError(f"vLLM backend: with decoder_sparse_step={cfg.decoder_sparse_step} and "
                                  f"mlp_only_layers={cfg.mlp_only_layers}, vLLM would build an MTP layer of another "
                                  "kind (dense vs MoE) than the trunk's last layer our MTP layer copies")
    # model_type "mtp" is what makes vLLM accept the directory as an MTP drafter; the target's own family is kept
    # in `target_model_type` for our class to build the matching decoder layer.
    return {**cfg.to_hf(), "model_type": "mtp", "target_model_type": cfg.model_type,
            "architectures": [MTP_ARCHITECTURE], "num_nextn_predict_layers": depths,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def export_mtp(drafter: MTP, out_dir: str | os.PathLike) -> Path:
    config = mtp_config(drafter.target_config, drafter.mtp_config, next(drafter.parameters()).dtype)
    tensors = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    return write_export(out_dir, config, entries_of(tensors), tensors.__getitem__)


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
    """How the worker converts streamed tensors of this head (`worker.megatron_spec_join`'s `drafter_form`)."""
    return {"eagle3": [list(ec.capture_layers), hidden_size]}


def export_eagle3(head: Eagle3Head, out_dir: str | os.PathLike) -> Path:
    cfg, ec = head.target_config, head.eagle_config
    config = eagle3_config(cfg, ec, next(head.parameters()).dtype)
    tensors = eagle3_tensors(head.state_dict(), ec.capture_layers, cfg.hidden_size)
    return write_export(out_dir, config, entries_of(tensors), tensors.__getitem__)


def drafter_form(drafter) -> dict | None:
    """The refit conversion of a drafter module's streamed tensors: EAGLE-3's, or None (they load as they are)."""
    if drafter_kind(drafter) == "eagle3":
        return eagle3_form(drafter.eagle_config, drafter.target_config.hidden_size)
    return None


def export_drafter(drafter, out_dir: str | os.PathLike) -> Path:
    kind = drafter_kind(drafter)
    if kind == "mtp":
        return export_mtp(drafter, out_dir)
    if kind == "eagle3":
        return export_eagle3(drafter, out_dir)
    return export_target(drafter, out_dir)



# --- from the drafter's checkpoint files, without a module -------------------------------------------------------

TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class TensorFiles:
    """The tensors of safetensors files by name, memory-mapped: a tensor's bytes are read when it is asked for."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        """name -> the file holding it."""
        self.meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for file in sorted(set(files.values())):
            with safe_open(file, "pt") as f:
                for name in f.keys():
                    if files.get(name) == file:
                        s = f.get_slice(name)
                        self.meta[name] = (TORCH_DTYPES[s.get_dtype()], tuple(s.get_shape()))

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self.files[name], "pt") as f:
            return f.get_tensor(name)

    def shapes(self) -> dict[str, torch.Tensor]:
        """Each tensor as an empty meta tensor of its shape: what `hf_io.check_state` compares."""
        return {n: torch.empty(shape, device="meta") for n, (_, shape) in self.meta.items()}


def _as_loaded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor as `load_drafter` gives it: floating point in `dtype`, integers as they are."""
    return t.to(dtype) if t.is_floating_point() else t


def _loaded_dtype(stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    return dtype if stored.is_floating_point else stored


@dataclass(frozen=True)
class DrafterExport:
    """A drafter directory written for vLLM, and how the worker converts the drafter's streamed refit tensors."""

    path: Path
    """The directory vLLM loads (`SpecConfig.model`)."""
    form: dict | None
    """`worker.megatron_spec_join`'s `drafter_form`: EAGLE-3's conversion, None when tensors load as they are."""


def _export_ours(path: Path, target: ModelConfig, out_dir, dtype: torch.dtype, method: str) -> DrafterExport:
    """Our layout (`drafter_config.json`): checked as `models.load_drafter` checks it (kind, target fingerprint,
    every name and shape against the drafter's meta-device skeleton, which holds no storage, and `d2t`), then
    written tensor by tensor."""
    from ...drafters.files import _KINDS, drafter_kind_and_config
    from ...drafters.eagle3.model import check_d2t
    from ...models.hf_io import check_state, weight_files

    kind, dcfg = drafter_kind_and_config(path, target)
    if kind != method:
        raise ValueError(f"spec.method is {method!r} but the drafter checkpoint {path} is an {kind!r} drafter")
    cls = _KINDS[kind][0]
    files = TensorFiles(weight_files(path))
    with torch.device("meta"):
        skeleton = cls(target, dcfg)
    check_state(skeleton, files.shapes(), str(path))
    del skeleton
    if kind == "mtp":
        config = mtp_config(target, dcfg, dtype)
        entries = {n: (_loaded_dtype(d, dtype), shape) for n, (d, shape) in files.meta.items()}
        return DrafterExport(write_export(out_dir, config, entries,
                                          lambda n: _as_loaded(files.get(n), dtype).contiguous()), None)
    # The head's config as `Eagle3Head` resolves it (intermediate_size 0: the target's).
    ec = Eagle3Config(dcfg.target_num_layers, dcfg.capture_layers, dcfg.intermediate_size or target.intermediate_size,
                      dcfg.draft_vocab_size, dcfg.norm_before_residual, dcfg.qk_norm)
    if ec.draft_vocab_size and "d2t" in files.meta:
        check_d2t(files.get("d2t"), ec.draft_vocab_size, target.vocab_size, f"{path}: d2t")
    H, capture = target.hidden_size, ec.capture_layers
    config = eagle3_config(target, ec, dtype)
    entries = {n: (torch.long if n == "d2t" else _loaded_dtype(d, dtype), eagle3_shape(n, shape, capture, H))
               for n, (d, shape) in files.meta.items()}
    return DrafterExport(write_export(out_dir, config, entries,
                                      lambda n: eagle3_tensor(n, _as_loaded(files.get(n), dtype), capture, H)),
                         eagle3_form(ec, H))


def _export_public(path: Path, target: ModelConfig, out_dir, dtype: torch.dtype) -> DrafterExport:
    """A public EAGLE-3 head (speculators / SpecForge layout): checked as `drafters.eagle3.public.load_public_eagle3`
    checks it, then written tensor by tensor the way that head's module would be exported (its fc padded to three
    blocks with zeros and folded back, its offsets turned into our d2t and back), so the bytes are the same."""
    from ...drafters.eagle3 import public as pub

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


def link_model(src: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    """`out_dir` as the HF model directory `src` for vLLM without loading it: its files linked, its config.json
    with `torch_dtype` = `dtype` (what vLLM serves)."""
    src = Path(src).resolve()
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {src}")
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = dtype

    def write(tmp: Path) -> None:
        for f in src.iterdir():
            if f.is_file() and f.name != "config.json":
                (tmp / f.name).symlink_to(f)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))

    return write_atomically(out_dir, write)


def export_drafter_files(src: str | os.PathLike, target: ModelConfig, out_dir: str | os.PathLike, method: str,
                         dtype: torch.dtype = torch.float32) -> DrafterExport:
    """The drafter checkpoint `src` of speculative method `method`, for target config `target`, written to
    `out_dir` in the layout vLLM loads with its floating-point tensors in `dtype` (what `export_drafter` writes for
    the same drafter loaded in `dtype`), without building the drafter: each tensor is read from the files, converted
    and written on its own. A draft model's files are linked (`link_model`), its vocabulary checked. A checkpoint
    that is missing or does not fit `target` raises before anything is written."""
    from ...drafters.files import DRAFTER_CONFIG, check_draft_model
    from ...drafters.eagle3.public import public_layout
    from ...models.hf_io import read_config

    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"drafter directory {src} does not exist")
    if method == "draft_model":
        check_draft_model(read_config(src), target)
        return DrafterExport(link_model(src, out_dir, str(dtype).removeprefix("torch.")), None)
    if not (src / DRAFTER_CONFIG).is_file() and public_layout(src) is not None:
        if method != "eagle3":
            raise ValueError(f"spec.method is {method!r} but the drafter checkpoint {src} is a public EAGLE-3 head")
        return _export_public(src, target, out_dir, dtype)
    return _export_ours(src, target, out_dir, dtype, method)
