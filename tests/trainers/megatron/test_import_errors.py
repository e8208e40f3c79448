"""Bad checkpoints and bad splits fail before any tensor is copied, with messages that name the mismatch. These
checks run before the importer needs a process group, so they run in-process on a stand-in model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from .common import hf_tensors, policy_part, save_hf_dir, tiny

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")


def stand_in(cfg, mtp_layers=0):
    """What `import_hf` reads from a model before it touches parameters."""
    return SimpleNamespace(hf_config=cfg, config=SimpleNamespace(mtp_num_layers=mtp_layers or None))


def test_checkpoint_for_another_architecture_is_rejected(tmp_path):
    from megatron_spec.trainers.megatron.importer import import_hf

    ckpt = save_hf_dir(tiny("dense"), policy_part(hf_tensors(tiny("dense"))), tmp_path / "ckpt")
    mismatch = r"config does not match the requested architecture: .*num_key_value_heads: checkpoint .* 2 != requested 4"
    with pytest.raises(ValueError, match=mismatch):
        import_hf(stand_in(tiny("dense", num_key_value_heads=4)), ckpt)
    with pytest.raises(ValueError, match=r"model_type: checkpoint .* 'qwen3' != requested 'qwen3_moe'"):
        import_hf(stand_in(tiny("moe")), ckpt)


def test_missing_shard_is_named(tmp_path):
    from megatron_spec.trainers.megatron.importer import import_hf

    cfg = tiny("dense")
    ckpt = save_hf_dir(cfg, policy_part(hf_tensors(cfg)), tmp_path / "ckpt", max_shard_bytes=64 * 1024)
    shards = sorted(ckpt.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=f"shard.*{shards[1].name}.*missing"):
        import_hf(stand_in(cfg), ckpt)


def test_checkpoint_without_the_requested_mtp_layers_is_rejected(tmp_path):
    from megatron_spec.trainers.megatron.importer import import_hf

    cfg = tiny("moe")
    ckpt = save_hf_dir(cfg, policy_part(hf_tensors(cfg)), tmp_path / "ckpt")
    message = r"does not hold the tensors of qwen3_moe with 2 layers \+ 1 MTP layer\(s\): \d+ missing tensor\(s\), e.g. \['mtp"
    with pytest.raises(ValueError, match=message):
        import_hf(stand_in(cfg, mtp_layers=1), ckpt)


def test_split_that_does_not_divide_fails_before_any_process_group():
    from megatron_spec.trainers.megatron.parallel import Parallelism, init_model_parallel

    with pytest.raises(ValueError, match="tp=2 does not divide the query groups"):
        init_model_parallel(Parallelism(tp=2), tiny("dense", num_key_value_heads=1))
    with pytest.raises(ValueError, match="ep=3 does not divide num_experts=4"):
        init_model_parallel(Parallelism(ep=3), tiny("moe"))


def test_missing_megatron_core_names_the_extra(monkeypatch):
    import builtins

    import megatron_spec.trainers.megatron as backend

    real_import = builtins.__import__

    def no_megatron(name, *args, **kwargs):
        if name == "megatron.core" or name.startswith("megatron.core."):
            raise ImportError("No module named 'megatron'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_megatron)
    with pytest.raises(ImportError, match=r"pip install -e \.\[megatron\]"):
        backend.require_megatron()
