"""Resuming a Megatron trainer's run at another parallel layout is allowed (its checkpoints reshard); a change of
what the update computes (the parameters' dtype, the trainer) is not."""

from __future__ import annotations

import pytest

from megatron_spec.rl import checkpoint
from megatron_spec.rl.backend_config import BackendSection, MegatronSection
from megatron_spec.rl.config import RLConfig


def megatron(**sizes) -> RLConfig:
    return RLConfig(backend=BackendSection(trainer="megatron", megatron=MegatronSection(**sizes)))


def test_layout_and_recompute_may_change_on_resume():
    saved = checkpoint.flatten(megatron(ep=2, etp=1, pp=2))
    checkpoint.check_same_config(saved, megatron(ep=4, etp=1, recompute="full"), "run")
    checkpoint.check_same_config(saved, megatron(tp=2, first_stage_layers=None), "run")


@pytest.mark.parametrize("changed", [dict(params_dtype="bfloat16"), dict(mtp_num_layers=1)])
def test_what_the_update_computes_may_not(changed):
    saved = checkpoint.flatten(megatron(ep=2, etp=1, pp=2))
    with pytest.raises(ValueError, match="different config"):
        checkpoint.check_same_config(saved, megatron(ep=2, etp=1, pp=2, **changed), "run")


def test_a_run_without_speculation_resumes():
    """A config whose `spec` section is None resumes: the defaults of a section's fields do not stand in for a
    section that was saved as None."""
    cfg = megatron(ep=2, etp=1)
    cfg.spec = None
    checkpoint.check_same_config(checkpoint.flatten(cfg), cfg, "run")
