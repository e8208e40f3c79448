"""The drafter's vLLM directory written from its checkpoint files (`export.export_drafter_files`), as a loop that
holds no model (`backend.trainer=megatron`, `backend.generator=vllm`) writes it: the same bytes as the export of the
loaded module, the same refit conversion, the same refusals before anything is written, no drafter module in the
loop's process, and an engine refit from the trainer's stream that decodes the same greedy tokens as one started
from the loaded modules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_spec.models import from_pretrained
from megatron_spec.drafters.files import load_drafter, save_drafter
from megatron_spec.drafters.eagle3.public import SPECFORGE, SPECULATORS
from megatron_spec.models.hf_io import read_config

from .common import stream, vllm_only

pytestmark = vllm_only

ROOT = Path(__file__).resolve().parents[3]
CKPT = ROOT / "checkpoints"


def ours(name: str):
    return lambda tmp_path, target: CKPT / name


def draft_vocab_head(tmp_path, target):
    """Our layout with a 48-id draft vocabulary (`d2t` saved) and three distinct capture layers."""
    from tests.models.test_eagle3_public import distinct_head

    return save_drafter(distinct_head(target), tmp_path / "ours-draft-vocab", "eagle3", target.config)


def public(layout: str, shipped: bool):
    """A public EAGLE-3 head in `layout`: the shipped head (one fc block, d2t all zero, fp32) or a distinct-layer
    head over a draft vocabulary (bf16, so the export's cast to fp32 is exercised)."""

    def make(tmp_path, target):
        from tests.models.test_eagle3_public import distinct_head, write_public

        if shipped:
            head, dtype = load_drafter(CKPT / "tiny-qwen3-eagle3", target.config), torch.float32
        else:
            head, dtype = distinct_head(target), torch.bfloat16
        return write_public(head, tmp_path / f"{layout}-{shipped}", layout, dtype=dtype)

    return make


CASES = {
    "mtp": ("tiny-qwen3", "mtp", ours("tiny-qwen3-mtp")),
    "moe-mtp": ("tiny-qwen3-moe", "mtp", ours("tiny-qwen3-moe-mtp")),
    "eagle3": ("tiny-qwen3", "eagle3", ours("tiny-qwen3-eagle3")),
    "eagle3-draft-vocab": ("tiny-qwen3", "eagle3", draft_vocab_head),
    "speculators-shipped": ("tiny-qwen3", "eagle3", public(SPECULATORS, True)),
    "specforge-shipped": ("tiny-qwen3", "eagle3", public(SPECFORGE, True)),
    "speculators-distinct": ("tiny-qwen3", "eagle3", public(SPECULATORS, False)),
    "specforge-distinct": ("tiny-qwen3", "eagle3", public(SPECFORGE, False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_files_export_equals_module_export_bit_for_bit(tmp_path, case):
    """Every file of the directory (config.json, model.safetensors) has the bytes of `export_drafter` of the
    module the registry loads (fp32, as `vllm_from_files` loaded it), and the refit conversion is the module's."""
    from megatron_spec.generators.vllm.export import drafter_form, export_drafter, export_drafter_files
    from megatron_spec.drafters.registry import drafter_method

    policy, method, make = CASES[case]
    target = from_pretrained(CKPT / policy)
    src = make(tmp_path, target)
    module = drafter_method(method).load(src, target, "cpu")
    expected = export_drafter(module, tmp_path / "from-module")
    got = export_drafter_files(src, read_config(CKPT / policy), tmp_path / "from-files", method)
    assert sorted(p.name for p in got.path.iterdir()) == sorted(p.name for p in expected.iterdir())
    for f in expected.iterdir():
        assert (got.path / f.name).read_bytes() == f.read_bytes(), f.name
    assert got.form == drafter_form(module)


def test_the_streamed_writer_writes_what_safetensors_writes(tmp_path):
    """`write_safetensors` (one tensor at a time) and safetensors' `save_file` (all at once) give the same bytes
    for an EAGLE-3 export's tensors (fp32 weights and int64 offsets) and a mix of dtypes and an empty tensor."""
    from megatron_spec.drafters.eagle3.export import eagle3_tensors
    from megatron_spec.generators.vllm.export import entries_of, write_safetensors
    from tests.models.test_eagle3_public import distinct_head

    target = from_pretrained(CKPT / "tiny-qwen3")
    head = distinct_head(target)
    mixed = {"b": torch.randn(3, 5), "a": torch.arange(7), "c": torch.randn(2).bfloat16(),
             "m": torch.zeros(4, dtype=torch.bool), "z": torch.randn(2, 3).half(), "e": torch.randn(0, 4)}
    for i, tensors in enumerate((eagle3_tensors(head.state_dict(), head.capture_layers, 128), mixed)):
        save_file(tensors, str(tmp_path / f"ref{i}"), metadata={"format": "pt"})
        write_safetensors(tmp_path / f"ours{i}", entries_of(tensors), tensors.__getitem__)
        assert (tmp_path / f"ours{i}").read_bytes() == (tmp_path / f"ref{i}").read_bytes()


def mismatched(tmp_path):
    """(checkpoint, policy, method, the error's type, a phrase of its message) for each refusal."""
    import shutil

    from tests.models.test_eagle3_public import distinct_head, write_public

    target = from_pretrained(CKPT / "tiny-qwen3")
    no_config = tmp_path / "no-config"
    shutil.copytree(CKPT / "tiny-qwen3-mtp", no_config)
    (no_config / "drafter_config.json").unlink()
    short = tmp_path / "short"
    shutil.copytree(CKPT / "tiny-qwen3-eagle3", short)
    tensors = load_drafter(short, target.config).state_dict()
    tensors.pop("norm.weight")
    save_file(tensors, str(short / "model.safetensors"))
    wide = write_public(distinct_head(target), tmp_path / "wide", SPECULATORS)
    cfg = json.loads((wide / "config.json").read_text())
    cfg["transformer_layer_config"]["hidden_size"] = 256
    (wide / "config.json").write_text(json.dumps(cfg))
    return [(tmp_path / "absent", "tiny-qwen3", "mtp", FileNotFoundError, "does not exist"),
            (no_config, "tiny-qwen3", "mtp", FileNotFoundError, "no drafter_config.json"),
            (CKPT / "tiny-qwen3-moe-mtp", "tiny-qwen3", "mtp", ValueError, "another target architecture"),
            (CKPT / "tiny-qwen3-mtp", "tiny-qwen3", "eagle3", ValueError, "is an 'mtp' drafter"),
            (short, "tiny-qwen3", "eagle3", ValueError, "1 missing tensor(s), e.g. ['norm.weight']"),
            (wide, "tiny-qwen3", "eagle3", ValueError, "hidden_size: checkpoint 256 vs target 128")]


def test_files_that_do_not_fit_are_refused_before_anything_is_written(tmp_path):
    """Missing files, another target, another method, a missing tensor, a public head of another width: each
    raises naming the problem, and no output directory appears."""
    from megatron_spec.generators.vllm.export import export_drafter_files

    for i, (src, policy, method, err, phrase) in enumerate(mismatched(tmp_path)):
        out = tmp_path / f"out{i}"
        with pytest.raises(err) as info:
            export_drafter_files(src, read_config(CKPT / policy), out, method)
        assert phrase in str(info.value), (src, str(info.value))
        assert not out.exists()


def rl_config(tmp_path, method: str, drafter: Path):
    from megatron_spec.rl.config import RLConfig
    from megatron_spec.drafters.config import SpecConfig

    cfg = RLConfig()
    cfg.backend.trainer, cfg.backend.generator = "megatron", "vllm"
    cfg.model.policy, cfg.model.drafter = str(CKPT / "tiny-qwen3"), str(drafter)
    cfg.spec = SpecConfig(method=method, num_speculative_tokens=3, adaptive=False)
    cfg.backend.vllm.max_model_len = 256
    cfg.run.out_dir, cfg.run.threads = str(tmp_path / "run"), 1
    return cfg


class NoEngine(Exception):
    """Raised in place of starting a vLLM engine: the arguments it would have got are recorded."""


@pytest.mark.parametrize("method, drafter", [("mtp", "tiny-qwen3-mtp"), ("eagle3", "tiny-qwen3-eagle3")])
def test_the_loop_process_builds_no_drafter_module(tmp_path, monkeypatch, method, drafter):
    """`vllm_from_files` up to the engine's start: the registry's `load`, `load_drafter` and `load_public_eagle3`
    are never called, no drafter module with a parameter off the meta device is built (the name and shape check
    uses a meta-device skeleton, which holds no storage), and the engine is given the conversion, not a module."""
    import dataclasses

    from megatron_spec.generators.process import vllm_from_files
    from megatron_spec.generators.vllm.generator import VLLMGenerator
    from megatron_spec.drafters.mtp.model import MTP
    from megatron_spec.drafters.eagle3.model import Eagle3Head
    from megatron_spec.drafters import files as drafters
    from megatron_spec.drafters.eagle3 import public as eagle3_public
    from megatron_spec.drafters import registry

    def refuse(*args, **kwargs):
        raise AssertionError("a drafter module was loaded in the loop's process")

    entry = registry.drafter_method(method)
    monkeypatch.setitem(registry._METHODS, method, dataclasses.replace(entry, load=refuse))
    for module, name in ((drafters, "load_drafter"), (eagle3_public, "load_public_eagle3")):
        monkeypatch.setattr(module, name, refuse)
    built = []
    for cls in (MTP, Eagle3Head):
        init = cls.__init__

        def spy(self, *args, _init=init, **kwargs):
            _init(self, *args, **kwargs)
            built.append(sum(p.numel() for p in self.parameters() if not p.is_meta))

        monkeypatch.setattr(cls, "__init__", spy)
    seen = {}

    def no_engine(self, model, spec=None, **kwargs):
        seen.update(kwargs, model=model, spec=spec)
        raise NoEngine

    monkeypatch.setattr(VLLMGenerator, "__init__", no_engine)
    with pytest.raises(NoEngine):
        vllm_from_files(rl_config(tmp_path, method, CKPT / drafter))
    assert built and all(n == 0 for n in built), built  # skeletons only
    assert seen.get("drafter") is None
    expected = {"mtp": None, "eagle3": {"eagle3": [[1, 1, 1], 128]}}[method]
    assert seen["drafter_conversion"] == expected
    assert seen["spec"].model == str(tmp_path / "run" / "vllm" / "drafter")
    assert (Path(seen["spec"].model) / "model.safetensors").is_file()


@pytest.mark.parametrize("method, drafter", [("eagle3", "tiny-qwen3-eagle3")])
def test_an_engine_from_files_refit_from_the_stream_decodes_the_modules_greedy_tokens(tmp_path, method, drafter):
    """The engine `vllm_from_files` starts (drafter written from files, refit conversion from its config), refit
    with the stream a trainer sends (policy and drafter tensors, drafter ones in our naming), decodes the same
    greedy tokens as an engine started from the loaded modules (`from_rl(cfg, model, drafter)`) and refit with the
    same stream: both serve the same fp32 weights, so greedy decoding matches token for token. Greedy tokens are
    the target's whatever the drafter (speculation is lossless), so the per-request speculation counts must match
    too: they are the drafter's, and the shipped head accepts drafts (acceptance length above 1.5; it is 2.3 on
    our engine with these prompts)."""
    from megatron_spec.generators.process import vllm_from_files
    from megatron_spec.generators.vllm import VLLMGenerator
    from megatron_spec.engine.params import SamplingParams
    from megatron_spec.drafters.registry import drafter_method

    target = from_pretrained(CKPT / "tiny-qwen3")
    head = drafter_method(method).load(CKPT / drafter, target, "cpu")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [8, 9, 10, 11, 12], [3, 4], [20, 21, 20, 21, 20]]
    outs = []
    for name, build in (("files", lambda cfg: vllm_from_files(cfg)),
                        ("modules", lambda cfg: VLLMGenerator.from_rl(cfg, target, head))):
        gen = build(rl_config(tmp_path / name, method, CKPT / drafter))
        try:
            assert gen.update_weights(stream(target, head)) > 0
            outs.append([(o.token_ids, o.spec) for o in gen.generate(prompts, params)])
        finally:
            gen.close()
    assert outs[0] == outs[1]
    assert all(len(tokens) == 24 for tokens, _ in outs[0])
    steps = sum(spec["verify_steps"] for _, spec in outs[0])
    assert 1 + sum(spec["accepted"] for _, spec in outs[0]) / steps > 1.5
