"""Public EAGLE-3 checkpoints in our `Eagle3Head`, and back in the layout they came in.

Two layouts are read, each a directory with `config.json` and safetensors weights:

- vLLM speculators: `"speculators_model_type": "eagle3"`, the draft layer's own config under
  `transformer_layer_config`, `draft_vocab_size`, `norm_before_residual` (absent: true, as vLLM reads it), optional
  `eagle_aux_hidden_state_layer_ids`; weights `layers.0.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`,
  `t2d`, optional `embed_tokens.weight`.
- SpecForge / EAGLE: an `architectures` entry naming Eagle3 (`LlamaForCausalLMEagle3`), the draft layer's config at
  the top level, `draft_vocab_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`, optional
  `norm_before_residual` (absent: false); weights `midlayer.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`,
  `t2d`, optional `embed_tokens.weight`.

What the names mean, as vLLM (the engine that serves both) reads them: `d2t[i]` is the offset target id - i of draft
id i (ours holds the target id itself); `t2d` marks the target ids the draft vocabulary covers; an auxiliary layer
id is the layer whose *input* is captured, i.e. our capture layer + 1; `fc` has one H-wide block per distinct
auxiliary layer. Our head always fuses three states, so a head with fewer distinct layers repeats the last one with
zero blocks (the same linear map), and saving sums the blocks of a repeated layer back. A draft vocabulary as large
as the target's (d2t all zero) is our full-vocabulary head.

`load_public_eagle3` keeps what our head does not hold (the config, `t2d`, `embed_tokens`, each tensor's dtype) on
the head as `public`, so `save_public_eagle3` writes an unchanged head back bit for bit and a trained one with only
its trained tensors changed. Our engine drafts with the target's embedding; a checkpoint whose own `embed_tokens`
differs from it would draft differently, so `load_public_eagle3` refuses it when given the target's embedding.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...models.config import ModelConfig
from .model import Eagle3Config, Eagle3Head, check_d2t
from ...models.hf_io import write_atomically

SPECULATORS, SPECFORGE = "speculators", "specforge"
WEIGHTS = "model.safetensors"
_LAYER_PREFIX = {SPECULATORS: "layers.0.", SPECFORGE: "midlayer."}
_KEPT = ("t2d", "embed_tokens.weight")  # tensors our head does not hold, written back as they were
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
"""Draft-layer model types whose attention norms queries and keys (vLLM builds an Eagle3Qwen3 layer for them, an
Eagle3Llama layer without the norms for the others)."""


def public_layout(path: str | os.PathLike) -> str | None:
    """`speculators` or `specforge` when `path` holds a public EAGLE-3 head in that layout, else None."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    cfg = json.loads(file.read_text())
    if cfg.get("speculators_model_type") == "eagle3":
        return SPECULATORS
    if any("eagle3" in a.lower() for a in cfg.get("architectures") or []):
        return SPECFORGE
    return None


def _layer_config(cfg: dict, layout: str) -> dict:
    return cfg["transformer_layer_config"] if layout == SPECULATORS else cfg


def _aux_ids(cfg: dict, layout: str) -> list[int] | None:
    if layout == SPECULATORS:
        return cfg.get("eagle_aux_hidden_state_layer_ids")
    return (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or cfg.get(
        "eagle_aux_hidden_state_layer_ids")


def _weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in EAGLE-3 checkpoint {path}")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _check_layer(layer: dict, target: ModelConfig, path: Path) -> list[str]:
    """Ways the draft layer's shapes differ from the ones our head builds from the target (it shares the target's
    attention shapes and KV-cache layout)."""
    H = target.hidden_size
    heads = layer.get("num_attention_heads", target.num_attention_heads)
    want = {"hidden_size": (layer.get("hidden_size"), H),
            "num_attention_heads": (heads, target.num_attention_heads),
            "num_key_value_heads": (layer.get("num_key_value_heads", heads), target.num_key_value_heads),
            "head_dim": (layer.get("head_dim") or H // heads, target.head_dim),
            "vocab_size": (layer.get("vocab_size", target.vocab_size), target.vocab_size)}
    return [f"{k}: checkpoint {got!r} vs target {exp!r}" for k, (got, exp) in want.items() if got != exp]


@dataclass
class PublicHead:
    """A public EAGLE-3 checkpoint resolved against a target, checked before any layer weight is read."""

    layout: str
    config: dict
    """The checkpoint's config.json."""
    aux: list[int] | None
    """Its auxiliary layer ids (vLLM's numbering), None where the config names none."""
    eagle: Eagle3Config
    offsets: torch.Tensor | None
    """Its `d2t` as stored (target id - draft id), None where it has none."""
    d2t: torch.Tensor | None
    """Our draft id -> target id map, None for the target's full vocabulary."""
    n_draft: int
    n_aux: int
    """States its fc fuses: our head's fc holds three blocks, the missing ones zero."""
    source: dict[str, str]
    """Our head's tensor name -> the checkpoint's."""


def resolve_public_eagle3(path: Path, target: ModelConfig, shapes: dict[str, tuple[int, ...]], get) -> PublicHead:
    """The public EAGLE-3 head in `path` (either layout) against `target`, from its config and its tensors' names and
    `shapes`, reading only small tensors (`get(name)`: `d2t`, `t2d`). ValueError naming every mismatch with the
    target, and any tensor our head would not hold, before a layer weight is used."""
    layout = public_layout(path)
    if layout is None:
        raise ValueError(f"{path} is not an EAGLE-3 checkpoint in the speculators or SpecForge layout")
    cfg = json.loads((path / "config.json").read_text())
    layer = _layer_config(cfg, layout)
    problems = _check_layer(layer, target, path)
    if problems:
        raise ValueError(f"EAGLE-3 checkpoint {path} does not fit the target: " + "; ".join(problems))
    V, H = target.vocab_size, target.hidden_size
    n_draft = int(cfg.get("draft_vocab_size") or layer.get("draft_vocab_size") or V)
    aux = _aux_ids(cfg, layout)
    fc_shape = tuple(shapes["fc.weight"])
    if fc_shape[1] % H or not 1 <= fc_shape[1] // H <= 3:
        raise ValueError(f"{path}: fc.weight {fc_shape} fuses neither 1, 2 nor 3 states of width {H}")
    n_aux = fc_shape[1] // H
    if aux is None:
        if n_aux != 3:
            raise ValueError(f"{path}: fc fuses {n_aux} states and the config names no auxiliary layers")
        capture = Eagle3Config(target.num_hidden_layers).capture_layers
    else:
        if len(aux) != n_aux or len(set(aux)) != len(aux):
            raise ValueError(f"{path}: {len(aux)} auxiliary layer ids {aux} for an fc of {n_aux} blocks")
        capture = tuple(i - 1 for i in aux) + (aux[-1] - 1,) * (3 - n_aux)
    offsets = get("d2t") if "d2t" in shapes else None
    full = n_draft == V and (offsets is None or not bool(offsets.any()))
    d2t = None if full else (offsets.to(torch.long) + torch.arange(n_draft))
    norm_before_residual = cfg.get("norm_before_residual", layout == SPECULATORS)
    eagle = Eagle3Config(target.num_hidden_layers, capture, int(layer.get("intermediate_size") or 0),
                         0 if full else n_draft, bool(norm_before_residual),
                         qk_norm=layer.get("model_type", "llama") in QK_NORM_TYPES)
    if d2t is not None:
        check_d2t(d2t, n_draft, V, f"{path}: d2t")
        t2d = get("t2d") if "t2d" in shapes else None
        if t2d is not None and (t2d.numel() != V or int(t2d.sum()) != n_draft or not bool(t2d.bool()[d2t].all())):
            raise ValueError(f"{path}: t2d does not mark exactly the {n_draft} target ids d2t maps to")
    prefix = _LAYER_PREFIX[layout]
    own = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", *_KEPT}
    unknown = sorted(k for k in shapes if k not in own and not k.startswith(prefix))
    if unknown:
        raise ValueError(f"{path}: tensors our EAGLE-3 head does not hold: {unknown[:5]}")
    source = {f"midlayer.{k[len(prefix):]}": k for k in shapes if k.startswith(prefix)}
    source.update({k: k for k in ("fc.weight", "norm.weight", "lm_head.weight") if k in shapes})
    ours = {name: tuple(shapes[k]) for name, k in source.items()}
    ours["fc.weight"] = (fc_shape[0], 3 * H)
    if d2t is not None:
        ours["d2t"] = tuple(d2t.shape)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Eagle3Head(target, eagle).state_dict().items()}
    bad = sorted(set(expected) ^ set(ours))
    wrong = [k for k in expected if k in ours and ours[k] != expected[k]]
    if bad or wrong:
        raise ValueError(f"{path}: layer tensors do not match the head: missing/unexpected {bad[:5]}, "
                         f"shapes {[(k, ours[k], expected[k]) for k in wrong[:3]]}")
    return PublicHead(layout, cfg, aux, eagle, offsets, d2t, n_draft, n_aux, source)


def padded_fc(fc: torch.Tensor, hidden: int, n_aux: int) -> torch.Tensor:
    """A public head's fc of `n_aux` blocks as our head's three: the missing blocks zero (what a repeated capture
    layer contributes once its states are fused)."""
    return torch.cat(list(fc.split(hidden, dim=1)) + [torch.zeros_like(fc[:, :hidden])] * (3 - n_aux), dim=1)


def load_public_eagle3(path: str | os.PathLike, target: ModelConfig, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu", target_embed: torch.Tensor | None = None) -> Eagle3Head:
    """The public EAGLE-3 head in `path` (either layout) as our `Eagle3Head` for `target`, in eval mode, with
    `head.public` holding what `save_public_eagle3` needs. ValueError naming every mismatch with the target before
    any weight is used (`resolve_public_eagle3`); `target_embed` (the target's embedding) is compared with a
    checkpoint's own."""
    path = Path(path)
    if public_layout(path) is None:
        raise ValueError(f"{path} is not an EAGLE-3 checkpoint in the speculators or SpecForge layout")
    raw = _weights(path)
    pub = resolve_public_eagle3(path, target, {k: tuple(v.shape) for k, v in raw.items()}, raw.__getitem__)
    embed = raw.get("embed_tokens.weight")
    if embed is not None and target_embed is not None and not torch.equal(embed.to(target_embed), target_embed):
        raise ValueError(f"{path}: its embed_tokens differ from the target's embedding, which our engine drafts with")
    ours = {name: raw[k] for name, k in pub.source.items()}
    ours["fc.weight"] = padded_fc(raw["fc.weight"], target.hidden_size, pub.n_aux)
    if pub.d2t is not None:
        ours["d2t"] = pub.d2t
    with torch.device("meta"):
        head = Eagle3Head(target, pub.eagle)
    head.load_state_dict({k: v if k == "d2t" else v.to(dtype) for k, v in ours.items()}, strict=True, assign=True)
    head = head.to(device=device, dtype=dtype).eval()
    head.public = {"layout": pub.layout, "config": pub.config, "aux": pub.aux, "n_aux": pub.n_aux,
                   "n_draft": pub.n_draft, "dtypes": {k: v.dtype for k, v in raw.items()},
                   "kept": {k: raw[k] for k in _KEPT if k in raw},
                   "offsets": None if pub.offsets is None or pub.d2t is not None else pub.offsets}
    return head


def public_tensors(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """The head's tensors by the names, forms and dtypes of the layout it was loaded from (`head.public`)."""
    meta = head.public
    prefix, H = _LAYER_PREFIX[meta["layout"]], head.target_config.hidden_size
    state = {k: v.detach() for k, v in head.state_dict().items()}
    out = {prefix + k[len("midlayer."):]: v for k, v in state.items() if k.startswith("midlayer.")}
    out["norm.weight"], out["lm_head.weight"] = state["norm.weight"], state["lm_head.weight"]
    blocks = state["fc.weight"].split(H, dim=1)
    fused = [blocks[0], *blocks[1:meta["n_aux"]]]
    for extra in blocks[meta["n_aux"]:]:  # the zero blocks of a repeated layer: summed back (exact while zero)
        if bool(extra.any()):
            fused[-1] = fused[-1] + extra
    out["fc.weight"] = torch.cat(fused, dim=1)
    if head.d2t is not None:
        out["d2t"] = head.d2t - torch.arange(head.d2t.numel(), device=head.d2t.device)
    elif meta["offsets"] is not None:
        out["d2t"] = meta["offsets"]
    out.update(meta["kept"])
    if head.d2t is not None and "t2d" in out:
        t2d = torch.zeros_like(out["t2d"], dtype=torch.bool)
        t2d[head.d2t.cpu()] = True
        out["t2d"] = t2d
    return {k: v.to(device="cpu", dtype=meta["dtypes"].get(k, v.dtype)).contiguous() for k, v in out.items()}


def save_public_eagle3(head: Eagle3Head, out_dir: str | os.PathLike) -> Path:
    """Write `head` (loaded by `load_public_eagle3`, trained or not) to `out_dir` in the layout it came in: its
    config as loaded (the capture layers, draft vocabulary and norm placement are the loaded ones, which training
    does not change) and one `model.safetensors`."""
    meta = getattr(head, "public", None)
    if meta is None:
        raise ValueError("this EAGLE-3 head was not loaded from a public layout: save it with save_drafter")
    config = copy.deepcopy(meta["config"])
    tensors = public_tensors(head)

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})

    return write_atomically(out_dir, write)

