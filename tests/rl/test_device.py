"""`run.device`: its validation before anything is loaded or written, resume across devices, and a GRPO step whose
every tensor lives on the model's device (checked on a CPU by `tests/device_guard.DeviceGuard`)."""

import pytest
import torch

from megatron_spec.rl import checkpoint, loop
from megatron_spec.rl.config import RunSection
from megatron_spec.rl.overrides import apply_overrides
from megatron_spec.interfaces import Batch

from ..device_guard import DeviceGuard
from .test_loop import ckpts, shaped_reward, small_cfg  # noqa: F401  (fixtures)


@pytest.mark.parametrize("bad", ["gpu", "cpu:0", "cuda:x", "cuda:", "CUDA"])
def test_device_spelling_is_checked_by_the_config(bad):
    with pytest.raises(ValueError, match="run.device must be"):
        RunSection(device=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_fails_before_any_model_or_file(ckpts, tmp_path, monkeypatch):  # noqa: F811
    """`run.device=cuda` on a CPU-only torch: a ValueError naming the fix, before the policy is read and before the
    run directory exists."""
    cfg = apply_overrides(small_cfg(ckpts, tmp_path / "run"), ["run.device=cuda"])
    monkeypatch.setattr("megatron_spec.models.from_pretrained", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(ValueError, match="torch sees no CUDA device.*run.device=cpu"):
        loop.train(cfg)
    assert not (tmp_path / "run").exists()


def test_ray_placements_refuse_a_device_they_do_not_honour(ckpts, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = apply_overrides(small_cfg(ckpts, tmp_path / "run"), ["run.device=cuda", "backend.placement=colocated"])
    with pytest.raises(ValueError, match="colocated placement"):
        loop.check_inputs(cfg)


def test_device_is_not_part_of_a_checkpoints_identity(ckpts, tmp_path):  # noqa: F811
    """A run saved on the CPU may resume with run.device=cuda (and back): only the device differs."""
    saved = checkpoint.flatten(small_cfg(ckpts, tmp_path))
    checkpoint.check_same_config(saved, apply_overrides(small_cfg(ckpts, tmp_path), ["run.device=cuda:0"]), tmp_path)


@pytest.mark.parametrize("fold", [True, False])
def test_grpo_step_makes_every_tensor_on_the_model_device(ckpts, tmp_path, shaped_reward, fold):  # noqa: F811
    """The trainer built and one step run (refit, speculative rollouts, logprob, policy + online MTP update, the KL
    reference) under the guard: nothing made on the host meets the model's tensors; the batch stays on the host
    for the loop, which only reads it there."""
    cfg = small_cfg(ckpts, tmp_path, kl_coef=0.1, fold_logprob=fold)
    with DeviceGuard():
        trainer = loop.Trainer(cfg)
        metrics = trainer.step(0)
    assert metrics["logprob_mismatch"] < 1e-5 and metrics["kl"] is not None


def test_guard_catches_a_trainer_that_forgets_to_move_its_batch(ckpts, tmp_path, shaped_reward, monkeypatch):  # noqa: F811
    """The guard can fail on the trainer's path: a batch left on the host reaches the model's embedding."""
    monkeypatch.setattr(Batch, "to", lambda self, device: self)
    with DeviceGuard() as guard:
        trainer = loop.Trainer(small_cfg(ckpts, tmp_path))
        with pytest.raises(AssertionError, match="host tensor"):
            trainer.step(0)
    assert "trainers/embedded.py" in guard.violations[0]
