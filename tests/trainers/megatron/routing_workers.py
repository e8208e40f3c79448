"""What the spawned ranks run for `test_routing_replay.py`: rollouts of our engine on a tiny MoE whose routers nearly
tie two experts, then `MegatronPolicy`'s log-prob and train forwards on them, with and without routing replay, on
a router perturbed as another trainer's numerics would move it; each rank returns the experts its routers chose for
its own rows."""

from __future__ import annotations

import copy

import torch

from megatron_spec.engine import SamplingParams
from megatron_spec.models import CausalLM
from megatron_spec.models.routing import moe_layers
from megatron_spec.rl.config import GRPOSection
from megatron_spec.generators.embedded import EmbeddedGenerator
from megatron_spec.rl.loop import make_batch

from .common import hf_tensors, policy_part, tiny

SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0)
PROMPTS = [p for p in ([1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14]) for _ in range(2)]


def near_tie_models(kind: str) -> tuple[CausalLM, CausalLM]:
    """(engine's, trainer's) model of `common.tiny(kind)`: each router's expert 1 is expert 0 plus 1e-3 noise (a
    near tie), the experts scaled x10 so a flip shows in the log-probs, and the trainer's rows 0-1 moved by another
    1e-3 of noise, so some tokens go to expert 0 in one and to expert 1 in the other."""
    cfg = tiny(kind)
    engine = CausalLM(cfg)
    engine.load_state_dict(policy_part(hf_tensors(cfg, mtp_layers=0)))
    torch.manual_seed(7)
    with torch.no_grad():
        for m in moe_layers(engine):
            m.gate.weight.mul_(20)
            m.gate.weight[1] = m.gate.weight[0] + 1e-3 * torch.randn_like(m.gate.weight[0])
            for p in m.experts.parameters():
                p.mul_(10)
        trainer = copy.deepcopy(engine)
        for m in moe_layers(trainer):
            m.gate.weight[:2] += 1e-3 * torch.randn_like(m.gate.weight[:2])
    return engine, trainer


def replay_run(kind: str, sizes: dict) -> dict:
    """This rank's view: its rows, the engine's routing of the batch, and its routers' choices for its rows (by MoE
    layer index) in the log-prob forward without replay, with it, and in the train forward with it; the log-probs
    with and without, and the engine's."""
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy
    from megatron_spec.trainers.megatron.routing import last_routing

    engine, trainer = near_tie_models(kind)
    outs = EmbeddedGenerator(engine, record_routing=True).generate(
        PROMPTS, SamplingParams(max_tokens=10, seed=3, ignore_eos=True))
    batch, behaviour = make_batch(PROMPTS, outs)
    grpo = GRPOSection(lr=1e-3, micro_batch_tokens=0, share_prompt=False, routing_replay=True)
    policy = MegatronPolicy(trainer, grpo, SAMPLING, Parallelism(**sizes))
    [micro] = policy._micros(batch)  # one micro-batch a rank: its routers' last forward covers all its rows
    rows, length = micro.rows, micro.batch.input_ids.shape[1]

    def chosen() -> dict:
        if not policy.routing:  # a stage of dense layers only
            return {}
        got = last_routing(policy.routing, len(rows), length)
        return {i: got[:, :, j] for j, i in enumerate(sorted(policy.routing))}

    free = copy.copy(batch)
    free.routing = None
    out = {"rows": rows, "length": length, "engine": batch.routing, "behaviour": behaviour, "mask": batch.mask}
    out["free_lp"] = policy.logprobs(free)
    out["free"] = chosen()
    out["replay_lp"] = policy.logprobs(batch)
    out["replay"] = chosen()
    batch.advantages = torch.linspace(-1, 1, len(PROMPTS))
    policy.train_step(batch)
    out["train"] = chosen()
    return out


def two_ranks(rank: int, world: int) -> dict:
    return {(kind, name): replay_run(kind, sizes) for kind in ("moe", "mixed")
            for name, sizes in (("ep2", dict(ep=2, etp=1)), ("pp2", dict(pp=2)))}
