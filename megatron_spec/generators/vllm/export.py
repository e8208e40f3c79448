"""Our models and drafters in the layouts vLLM loads, and our drafter's refit names in vLLM's naming.

- target / draft model: HF layout as `models.hf_io.save_pretrained` writes it (vLLM's Qwen3 / Llama classes).
- a drafter: its method's layout, written by its folder's `export.py` (the registry entry's `vllm_export` /
  `vllm_export_files`), with the helpers here.

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

from ...drafters.registry import drafter_method, method_of
from ...models.config import ModelConfig
from ...models.hf_io import save_pretrained, write_atomically

WEIGHTS = "model.safetensors"
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
"""safetensors' dtype names of the tensors an export writes."""

def drafter_form(drafter) -> dict | None:
    """The refit conversion of a drafter module's streamed tensors (its method's `vllm_form`), or None (they load
    as they are); None for no drafter."""
    if drafter is None:
        return None
    method = method_of(drafter)
    return None if method.vllm_form is None else method.vllm_form(drafter)


def export_drafter(drafter, out_dir: str | os.PathLike) -> Path:
    """`drafter` (a module) as the directory vLLM loads, in its method's layout (`vllm_export`)."""
    return method_of(drafter).vllm_export(drafter, out_dir)


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


def as_loaded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor as `load_drafter` gives it: floating point in `dtype`, integers as they are."""
    return t.to(dtype) if t.is_floating_point() else t


def loaded_dtype(stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    return dtype if stored.is_floating_point else stored


@dataclass(frozen=True)
class DrafterExport:
    """A drafter directory written for vLLM, and how the worker converts the drafter's streamed refit tensors."""

    path: Path
    """The directory vLLM loads (`SpecConfig.model`)."""
    form: dict | None
    """`worker.megatron_spec_join`'s `drafter_form` (`drafter_form`), None when tensors load as they are."""


def checked_files(path: Path, target: ModelConfig, method: str) -> tuple[object, TensorFiles]:
    """The drafter config and tensor files of the checkpoint `path` in our layout (`drafter_config.json`), checked as
    `files.load_drafter` checks it (kind is `method`, target fingerprint, every name and shape against the drafter's
    meta-device skeleton, which holds no storage) before anything is written."""
    from ...drafters.eagle3.public import public_layout
    from ...drafters.files import DRAFTER_CONFIG, drafter_kind_and_config, head_classes
    from ...models.hf_io import check_state, weight_files

    if not (path / DRAFTER_CONFIG).is_file() and public_layout(path) is not None:
        raise ValueError(f"spec.method is {method!r} but the drafter checkpoint {path} is a public EAGLE-3 head")
    kind, dcfg = drafter_kind_and_config(path, target)
    if kind != method:
        raise ValueError(f"spec.method is {method!r} but the drafter checkpoint {path} is an {kind!r} drafter")
    files = TensorFiles(weight_files(path))
    with torch.device("meta"):
        skeleton = head_classes(kind)[0](target, dcfg)
    check_state(skeleton, files.shapes(), str(path))
    return dcfg, files


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
    that is missing or does not fit `target` raises before anything is written. The method's folder writes it
    (`vllm_export_files`)."""
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"drafter directory {src} does not exist")
    return drafter_method(method).vllm_export_files(src, target, out_dir, dtype)
