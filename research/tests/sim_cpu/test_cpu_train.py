"""The CPU model of the embedded trainer's micro-batching and folded recompute (`research/sim_cpu/cpu_train.py`).

The simulator restates the trainer's micro-batch rule so that it stays free of torch; these tests hold the two
equal on the lengths the trainer itself would read off a batch, check that the folded recompute leaves the
`logprob` stage only its batch assembly, and that bucketing a long-tailed batch saves about the padding it removes.
All deterministic (the committed CPU profile, no timing).
"""

import random
from pathlib import Path

import pytest
import torch

from research.sim_cpu import counts, cpu_train, model
from research.sim_cpu.cpu_profile import CpuProfile
from research.sim_cpu.measured import COMMITTED_PROFILE
from megatron_spec.rl.config import GRPOSection
from megatron_spec.microbatch import micro_batches as trainer_micro_batches
from megatron_spec.microbatch import sequence_lengths
from megatron_spec.sim.config import LengthDist, SimConfig, TrainParallel, Workload

REPO = Path(__file__).resolve().parents[3]
QWEN3 = model.preset("tiny-qwen3")
HW = CpuProfile.load(REPO / COMMITTED_PROFILE).to_hardware()


def cpu_config(response: LengthDist, prompt_len: int = 10, **kwargs) -> SimConfig:
    workload = Workload(prompts_per_step=8, group_size=8, prompt_len=prompt_len, response=response)
    return model.cpu_config("tiny-qwen3", HW, workload, max_num_seqs=64, **kwargs)


def build(cfg: SimConfig, hw=None):
    return (hw, None, *model.shapes(cfg))


def trainer_lengths(prompt: int, responses: list[int]) -> list[int]:
    """The used lengths the trainer reads off a right-padded batch of these rollouts (`sequence_lengths`)."""
    T = prompt + max(responses)
    mask = torch.zeros(len(responses), T, dtype=torch.bool)
    for i, r in enumerate(responses):
        mask[i, prompt:prompt + r] = True
    return sequence_lengths(mask)


def test_trainer_row_lengths_are_prompt_plus_response():
    """The rows the simulator costs (prompt + response) are the trainer's used lengths of a right-padded batch."""
    rng = random.Random(0)
    for _ in range(120):
        responses = [rng.choice([rng.randint(1, 40), rng.randint(1, 200)]) for _ in range(rng.randint(1, 64))]
        lengths = trainer_lengths(10, responses)
        assert lengths == [10 + r for r in responses]


@pytest.mark.parametrize("budget", [0, 512, 1024, 2048])
def test_workload_micro_batches_are_the_trainers(budget):
    """The simulator's rows (prompt + one length quantile each) go through the trainer's own function unchanged,
    and each modelled micro-batch is padded to its longest row."""
    cfg = cpu_config(LengthDist(mean=40, max_tokens=96, sigma=0.6), micro_batch_tokens=budget)
    lengths = cpu_train.row_lengths(cfg)
    groups = trainer_micro_batches(lengths, budget)
    assert [(b.rows, b.length) for b in cpu_train.trainer_batches(cfg)] == \
        [(len(g), max(lengths[i] for i in g)) for g in groups]
    if budget:
        assert all(b.tokens <= budget or b.rows == 1 for b in cpu_train.trainer_batches(cfg))


def test_defaults_follow_the_trainer():
    """The CPU model stands for the embedded trainer (its defaults); a GPU keeps packing and a recompute pass."""
    cpu = cpu_config(LengthDist(mean=20, max_tokens=96))
    grpo = GRPOSection()
    assert (cpu.micro_batch_tokens, cpu.fold_logprob) == (grpo.micro_batch_tokens, grpo.fold_logprob)
    assert model.CPU_MICRO_BATCH_TOKENS == grpo.micro_batch_tokens
    gpu = SimConfig(model="qwen3-8b", hardware="h100", gpus=8, workload=cpu.workload, train=TrainParallel(dp=8))
    assert (gpu.micro_batch_tokens, gpu.fold_logprob) == (16384, False)
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 0"):
        cpu_config(LengthDist(mean=20, max_tokens=96), micro_batch_tokens=-1)


def test_fold_leaves_logprob_only_its_bookkeeping():
    dist = LengthDist(mean=22.6, max_tokens=96, sigma=0.3)
    folded, separate = cpu_config(dist, fold_logprob=True), cpu_config(dist, fold_logprob=False)
    _, _, target, drafter = build(folded, HW)
    logprob = cpu_train.logprob_time(folded, HW, target)
    assert logprob == pytest.approx(counts.batch_ops(64) * HW.op_overhead_s)
    assert logprob < 0.003  # ~1.9 ms: 12 operators per rollout
    assert cpu_train.logprob_time(separate, HW, target) > 10 * logprob
    # the train forward is the same forward: one operator more per step (the tensor the log-probs go into)
    extra = cpu_train.train_time(folded, HW, target, drafter) - cpu_train.train_time(separate, HW, target, drafter)
    fold_ops = counts.train_ops(QWEN3, 1, True, True) - counts.train_ops(QWEN3, 1, False, True)
    assert fold_ops == 1 and extra == pytest.approx(fold_ops * HW.op_overhead_s)


def test_gpu_fold_drops_the_recompute_pass():
    from megatron_spec.sim.pipeline import simulate

    w = Workload(prompts_per_step=64, group_size=8, prompt_len=200, response=LengthDist(2000, 8192))
    base = dict(model="qwen3-8b", hardware="h100", gpus=8, workload=w, train=TrainParallel(dp=8))
    separate, folded = simulate(SimConfig(**base)), simulate(SimConfig(**base, fold_logprob=True))
    assert separate.stages["logprob"] > 0 and folded.stages["logprob"] == 0.0
    assert folded.stages["train"] == separate.stages["train"]


def test_bucketing_saves_about_the_padding():
    """A long-tailed batch (64 rollouts, lengths log-normal with sigma 0.6) padded to its longest is about half
    padding. Bucketed at 1024 tokens, products, elementwise traffic and most of attention shrink with the padded
    tokens; a few micro-batches' operators come back. The predicted train time falls by about the padded share
    removed (within 5 points), and a one-micro-batch budget changes nothing."""
    dist = LengthDist(mean=22.6, max_tokens=96, sigma=0.6)
    whole, bucketed = cpu_config(dist, micro_batch_tokens=0), cpu_config(dist, micro_batch_tokens=1024)
    _, _, target, drafter = build(whole, HW)
    token_ratio = cpu_train.padded_tokens(bucketed) / cpu_train.padded_tokens(whole)
    time_ratio = cpu_train.train_time(bucketed, HW, target, drafter) / cpu_train.train_time(whole, HW, target, drafter)
    assert token_ratio < 0.6
    assert abs(time_ratio - token_ratio) < 0.05, (time_ratio, token_ratio)
    one = cpu_config(dist, micro_batch_tokens=100_000)
    assert cpu_train.train_time(one, HW, target, drafter) == cpu_train.train_time(whole, HW, target, drafter)


def test_length_fit_recovers_the_distribution():
    """`LengthDist.fit` from the mean and longest of n quantiles gives back the distribution they came from;
    at the cap it returns the smallest sigma that reaches it."""
    for dist, n in ((LengthDist(mean=22.6, max_tokens=96, sigma=0.3), 64), (LengthDist(200, 4096, 0.8), 256)):
        q = dist.quantiles(n)
        fitted = LengthDist.fit(sum(q) / n, max(q), n, dist.max_tokens)
        assert fitted.sigma == pytest.approx(dist.sigma, rel=1e-6)
        assert fitted.mean == pytest.approx(dist.mean, rel=1e-6)
    capped = LengthDist.fit(30, 96, 64, 96)
    assert max(capped.quantiles(64)) == pytest.approx(96)
    assert max(LengthDist(capped.mean, 96, capped.sigma * 0.95).quantiles(64)) < 96
    assert LengthDist.fit(30, 30, 64, 96).sigma == 0.0


def trunk_positions(cfg: SimConfig, share: bool) -> int:
    """Positions the real trainer's trunk computes in one `logprobs` pass over a batch with the workload's row
    lengths (rounded), each group of 8 rollouts holding one prompt."""
    from megatron_spec.models import CausalLM
    from megatron_spec.interfaces import Batch
    from megatron_spec.trainers.embedded import EmbeddedPolicy

    w = cfg.workload
    lengths = [round(n) for n in cpu_train.row_lengths(cfg)]
    ids = torch.randint(3, cfg.model_config.vocab_size, (len(lengths), max(lengths)),
                        generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for r, n in enumerate(lengths):
        ids[r, : w.prompt_len] = ids[r - r % w.group_size, : w.prompt_len]
        mask[r, w.prompt_len : n] = True
    model = CausalLM(cfg.model_config)
    seen = []
    trunk = model.trunk
    model.trunk = lambda ids, *a, **k: seen.append(ids.numel()) or trunk(ids, *a, **k)
    grpo = GRPOSection(micro_batch_tokens=cfg.micro_batch_tokens, share_prompt=share)
    EmbeddedPolicy(model, grpo, dict(temperature=1.0, top_k=0, top_p=1.0)).logprobs(Batch(ids, mask, torch.zeros(64)))
    return sum(seen)


@pytest.mark.parametrize("budget", [0, 1024])
def test_shared_prompt_positions_are_the_trainers(budget):
    """With shared prompts the trunk computes each group's prompt once (a prefix pass) and each micro-batch only its
    rows' completions, padded to its longest: the simulator's position count equals what the real trainer's trunk
    is handed (counted by wrapping `CausalLM.trunk`), to 2 % (the trainer sees lengths rounded to whole tokens,
    which moves each micro-batch's longest by up to half a token: ~1 % here); without sharing,
    the padded rows. On this workload (10-token prompts, responses ~23) sharing removes about a quarter."""
    dist = LengthDist(mean=22.6, max_tokens=96, sigma=0.3)
    shared = cpu_config(dist, micro_batch_tokens=budget, share_prompt=True)
    plain = cpu_config(dist, micro_batch_tokens=budget, share_prompt=False)
    assert cpu_train.padded_tokens(shared) == pytest.approx(trunk_positions(shared, True), rel=0.02)
    assert cpu_train.padded_tokens(plain) == pytest.approx(trunk_positions(plain, False), rel=0.02)
    assert 0.15 < 1 - cpu_train.padded_tokens(shared) / cpu_train.padded_tokens(plain) < 0.35


def test_shared_prompt_settings():
    """On by default where the embedded trainer has it on; never for MoE (the trainer keeps the router's
    load-balancing statistic per rollout) or without repeated prompts; refused for a GPU trainer, which packs."""
    dist = LengthDist(mean=20, max_tokens=96)
    assert cpu_config(dist).share_prompt is GRPOSection().share_prompt is True
    assert cpu_train.shares_prompt(cpu_config(dist))
    moe = model.cpu_config("tiny-qwen3-moe", HW, cpu_config(dist).workload, max_num_seqs=64)
    assert not cpu_train.shares_prompt(moe)
    single = cpu_config(dist)
    single.workload = Workload(prompts_per_step=8, group_size=1, prompt_len=10, response=dist)
    assert not cpu_train.shares_prompt(single)
    with pytest.raises(ValueError, match="share_prompt describes the embedded trainer"):
        SimConfig(model="qwen3-8b", hardware="h100", gpus=8, workload=single.workload, train=TrainParallel(dp=8),
                  share_prompt=True)


def test_trainer_operators_cost_train_op_s():
    """A profile with the trainer's own per-operator cost charges every operator of the train step at it, and
    nothing else changes; a profile from before it existed charges `op_overhead_s`."""
    import dataclasses

    cfg = cpu_config(LengthDist(mean=22.6, max_tokens=96, sigma=0.3))
    _, _, target, _ = build(cfg, HW)
    assert HW.train_op_s == HW.op_overhead_s  # the committed profile predates the figure
    slower = dataclasses.replace(HW, train_op_s=HW.op_overhead_s + 1e-6)
    extra = cpu_train.train_time(cfg, slower, target, None) - cpu_train.train_time(cfg, HW, target, None)
    assert extra == pytest.approx(1e-6 * cpu_train.train_step_ops(cfg, target))
    assert cpu_train.logprob_time(cfg, slower, target) == cpu_train.logprob_time(cfg, HW, target)
