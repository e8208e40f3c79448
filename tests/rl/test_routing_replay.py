"""`grpo.routing_replay` on the embedded trainer: a step's rollouts carry their routing into the batch, and the
trainer's forwards (log-prob and train) route every token to the experts the engine routed it to; refused for a
dense policy. The vLLM generator's recorded routing: tests/generators/vllm/test_routing.py."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_spec.engine import SamplingParams
from megatron_spec.models.decoder import CausalLM
from megatron_spec.models.presets import preset
from megatron_spec.models.routing import choices, moe_layers
from megatron_spec.rl.config import GRPOSection, RLConfig
from megatron_spec.generators.embedded import EmbeddedGenerator
from megatron_spec.rl.loop import check_inputs, config_problems, logprob_mismatch, make_batch
from megatron_spec.trainers.embedded import EmbeddedPolicy
from megatron_spec.drafters.config import SpecConfig

SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0)


def near_tie_models(seed: int = 0) -> tuple[CausalLM, CausalLM]:
    """(engine's, trainer's) tiny MoE whose routers nearly tie experts 0 and 1 (gate row 1 = row 0 + 1e-3 noise)
    and differ by another 1e-3 of noise in those rows: the gap between the two experts is then of the order of the
    difference between the two routers, as a near tie is of the order of the difference between an engine's and a
    trainer's numerics, so some tokens go to expert 0 in one and to expert 1 in the other."""
    torch.manual_seed(seed)
    engine = CausalLM(preset("tiny-qwen3-moe")).eval()
    with torch.no_grad():
        for m in moe_layers(engine):
            m.gate.weight.mul_(20)
            m.gate.weight[1] = m.gate.weight[0] + 1e-3 * torch.randn_like(m.gate.weight[0])
            for expert in m.experts:  # experts' outputs of the residual's scale, so a flip shows in the log-probs
                for p in expert.parameters():
                    p.mul_(10)
    trainer = copy.deepcopy(engine)
    with torch.no_grad():
        for m in moe_layers(trainer):
            m.gate.weight[:2] += 1e-3 * torch.randn_like(m.gate.weight[:2])
    return engine, trainer


def rollouts(engine: CausalLM, spec: SpecConfig | None = None):
    """A step's rollouts (4 prompts x 4) from the engine with routing recorded, and their batch."""
    gen = EmbeddedGenerator(engine, spec=spec, record_routing=True)
    prompts = [p for p in ([1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14], [15, 16]) for _ in range(4)]
    outs = gen.generate(prompts, SamplingParams(max_tokens=24, seed=5, ignore_eos=True))
    batch, behaviour = make_batch(prompts, outs)
    return batch, behaviour


def recorded(batch) -> torch.Tensor:
    """[B, T] True where the batch's routing was recorded (every input position of a rollout but its last)."""
    return batch.routing[..., 0, 0] >= 0


def trainer_routing(policy: EmbeddedPolicy, batch, rows: list[int]) -> torch.Tensor:
    """The trainer's last forward's routing (one micro-batch: `rows` of the batch), laid back in batch order,
    sorted per position."""
    out = torch.empty_like(batch.routing)
    out[rows] = choices(policy.model, len(rows), batch.routing.shape[1])
    return out.long().sort(-1).values


def check_replay(trainer: CausalLM, batch, behaviour) -> torch.Tensor:
    """Replaying the batch's routing, `trainer`'s log-prob and train forwards choose the recorded experts at every
    recorded position; routing by itself it chooses others at 5 or more (the crafted ties do flip, so the equality
    is not vacuous), and the mismatch with the engine's log-probs is above 0.25 free and below 0.1 replayed (the
    bounds' reasoning: `test_trainer_routes_every_token_as_the_engine_did`). Returns the replayed log-probs."""
    where = recorded(batch)
    policy = EmbeddedPolicy(trainer, GRPOSection(micro_batch_tokens=0, routing_replay=True), SAMPLING)
    [(rows, _)] = policy.split(batch)
    engine_choice = batch.routing.long().sort(-1).values

    free = copy.copy(batch)
    free.routing = None
    free_lp = policy.logprobs(free)
    flipped = (trainer_routing(policy, batch, rows) != engine_choice).any(-1)[where]
    assert int(flipped.sum()) >= 5  # the crafted ties do flip: the equality below is not vacuous

    replay_lp = policy.logprobs(batch)
    assert torch.equal(trainer_routing(policy, batch, rows)[where], engine_choice[where])
    completion = batch.mask[:, 1:]
    assert logprob_mismatch(replay_lp, behaviour, completion) < 0.1
    assert logprob_mismatch(free_lp, behaviour, completion) > 0.25

    batch.advantages = torch.linspace(-1, 1, len(rows))
    policy.train_step(batch)
    assert torch.equal(trainer_routing(policy, batch, rows)[where], engine_choice[where])
    return replay_lp


@pytest.mark.parametrize("spec", [None, SpecConfig(method="ngram", num_speculative_tokens=3)],
                         ids=["plain", "ngram"])
def test_trainer_routes_every_token_as_the_engine_did(spec):
    """With replay, the trainer's log-prob forward and its train forward choose the engine's experts at every
    recorded position of every rollout (prompt and completion); without it, the crafted near ties send some of those
    positions elsewhere (observed: 110 of 432), and the engine-vs-trainer log-prob mismatch shows it. With replay
    the log-probs differ from the engine's only through the routers' weights of the same experts (the perturbed
    gate rows move them by ~1 %): observed 0.027, bounded at 0.1; the flips without replay move some token's
    log-prob by 0.51 (bounded below at 0.25). Rounding (~1e-6 on any instruction set or thread count) can move a
    tie the crafted 1e-3 gaps leave only rarely, and the margins to both bounds are ~4x and ~2x."""
    engine, trainer = near_tie_models()
    batch, behaviour = rollouts(engine, spec)
    replay_lp = check_replay(trainer, batch, behaviour)
    torch.testing.assert_close(batch.old_logprobs, replay_lp, rtol=0, atol=1e-6)


def test_batch_routing_rows():
    """Each row holds its rollout's routing from position 0 to its last input, then -1 (padding and the last
    token route freely); a micro-batch selects and crops it with the rows."""
    engine, _ = near_tie_models()
    batch, _ = rollouts(engine)
    lengths = (batch.mask.sum(1) + torch.tensor([5, 3, 6, 2]).repeat_interleave(4)).tolist()
    for row, n in enumerate(lengths):
        assert bool((batch.routing[row, : n - 1] >= 0).all()) and bool((batch.routing[row, n - 1 :] == -1).all())
    mb = batch.select([3, 0], 7)
    assert torch.equal(mb.routing, batch.routing[[3, 0], :7])


def test_routing_replay_refused_for_a_dense_policy():
    cfg = RLConfig()
    cfg.grpo.routing_replay = True
    assert not config_problems(cfg)
    with pytest.raises(ValueError, match="grpo.routing_replay replays the experts of an MoE policy.*is dense"):
        check_inputs(cfg)
    cfg.model.policy = "checkpoints/tiny-qwen3-moe"
    check_inputs(cfg)


def test_routing_replay_refused_with_megatron_recompute_or_sequence_parallelism():
    cfg = RLConfig()
    cfg.grpo.routing_replay, cfg.backend.trainer = True, "megatron"
    assert not config_problems(cfg)
    for field, value in (("recompute", "full"), ("sequence_parallel", True)):
        bad = copy.deepcopy(cfg)
        setattr(bad.backend.megatron, field, value)
        assert any("recompute=none and sequence_parallel=false" in p for p in config_problems(bad))
    interleaved = copy.deepcopy(cfg)
    interleaved.backend.megatron.pp, interleaved.backend.megatron.virtual_pipeline = 2, 2
    assert any("virtual_pipeline=2" in p and "grpo.routing_replay" in p for p in config_problems(interleaved))


def test_a_loop_step_carries_the_rollouts_routing_into_the_update(tmp_path):
    """One step of the loop on the trained tiny MoE with its MTP head (speculating k=3): the batch the trainer gets
    holds the routing of every input position of every rollout (its prompt and all generated tokens but the last),
    -1 elsewhere, and the step's engine-vs-trainer mismatch is fp32 rounding (< 1e-4: both sides compute in fp32 and
    route alike)."""
    from megatron_spec.rl import loop

    cfg = RLConfig()
    cfg.model.policy, cfg.model.drafter = "checkpoints/tiny-qwen3-moe", "checkpoints/tiny-qwen3-moe-mtp"
    cfg.spec = SpecConfig("mtp", 3)
    cfg.grpo = GRPOSection(prompts_per_step=2, group_size=2, max_tokens=12, routing_replay=True)
    cfg.run.out_dir, cfg.run.steps, cfg.run.threads, cfg.run.eval_every, cfg.run.report = str(tmp_path), 1, 1, 0, False
    loop.check_inputs(cfg)
    trainer = loop.Trainer(cfg)
    seen = []
    train_step = trainer.policy.train_step
    trainer.policy.train_step = lambda batch, **kw: seen.append(batch) or train_step(batch, **kw)
    metrics = trainer.step(0)
    [batch] = seen
    B, T = batch.input_ids.shape
    assert batch.routing.shape == (B, T, 4, 2)
    last = batch.mask.int().cumsum(1).argmax(1)  # each row's last generated token
    expected = torch.arange(T)[None] < last[:, None]
    assert torch.equal(batch.routing[..., 0, 0] >= 0, expected)
    assert metrics["logprob_mismatch"] < 1e-4
