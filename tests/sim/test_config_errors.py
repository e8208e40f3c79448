"""Bad input fails early with an error that names the violated constraint."""

import pytest

from megatron_spec.sim import GenParallel, LengthDist, SimConfig, Speculation, TrainParallel, Workload, simulate

W = Workload(prompts_per_step=64, group_size=8, prompt_len=200, response=LengthDist(mean=2000, max_tokens=8192))


def cfg(**kw):
    base = dict(model="qwen3-8b", hardware="h100", gpus=8, workload=W, train=TrainParallel(dp=8))
    base.update(kw)
    return SimConfig(**base)


@pytest.mark.parametrize("kw,match", [
    (dict(train=TrainParallel(tp=3, dp=1), gpus=3), "tp=3 does not divide num_attention_heads=32"),
    (dict(model="smollm2-135m", gen=GenParallel(tp=2)), "generation tp=2 does not divide num_attention_heads=9"),
    (dict(gen=GenParallel(tp=2, ep=2)), "needs an MoE model"),
    (dict(train=TrainParallel(pp=64, dp=1), gpus=64), "pp=64 exceeds num_hidden_layers=36"),
    (dict(train=TrainParallel(dp=4)), "train layout tp\\*pp\\*cp\\*dp = 4 GPUs"),
    (dict(policy_lag=1), "policy_lag > 0 needs a disaggregated placement"),
    (dict(colocated=False, gen_gpus=8), "0 < gen_gpus < gpus=8"),
    (dict(gen=GenParallel(tp=4), colocated=False, gen_gpus=6, train=TrainParallel(dp=2)),
     "not a multiple of gen tp=4"),
])
def test_layout_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        cfg(**kw)


def test_moe_expert_parallel_must_divide_experts():
    """Qwen3-30B-A3B has 128 experts: EP=3 cannot split them."""
    with pytest.raises(ValueError, match="ep=3 does not divide num_experts=128"):
        SimConfig(model="qwen3-30b-a3b", hardware="h100", gpus=3, workload=W, train=TrainParallel(ep=3, dp=3))


def test_acceptance_above_k_plus_one():
    with pytest.raises(ValueError, match=r"acceptance length 4.5 exceeds k\+1 = 4"):
        Speculation(k=3, acceptance_length=4.5)


def test_speculation_needs_acceptance():
    with pytest.raises(ValueError, match="needs acceptance_length"):
        Speculation(k=3)
    with pytest.raises(ValueError, match="needs k=3 values"):
        Speculation(k=3, per_position=(0.8, 0.7))


def test_config_that_does_not_fit_in_memory():
    """Qwen3-235B-A22B in BF16 on one-GPU H100 engines: 470 GB of weights on an 80 GB GPU."""
    big = SimConfig(model="qwen3-235b-a22b", hardware="h100", gpus=128, workload=W,
                    train=TrainParallel(tp=2, pp=8, cp=2, ep=16, dp=4), gen=GenParallel(tp=1))
    with pytest.raises(ValueError, match="generation engine does not fit in memory"):
        simulate(big)


def test_trainer_that_does_not_fit_in_memory():
    """An 8B model trained on one H100 needs ~16 bytes/parameter of states: ~130 GB > 80 GB."""
    with pytest.raises(ValueError, match="trainer does not fit in memory"):
        simulate(SimConfig(model="qwen3-8b", hardware="h100", gpus=1, workload=W, train=TrainParallel(dp=1)))


def test_unknown_names():
    with pytest.raises(ValueError, match="unknown hardware"):
        cfg(hardware="tpu")
    with pytest.raises(ValueError, match="neither a preset"):
        cfg(model="no-such-model")
    with pytest.raises(ValueError, match="unknown drafter"):
        Speculation(k=2, acceptance_length=2.0, drafter="magic")
