"""`grpo.routing_replay` on the Megatron trainer: with it, every recorded position of every rollout goes to the
engine's experts in Megatron-Core's routers (log-prob and train forwards) at EP2 and at PP2 (routers on two stages),
for a model of MoE layers only and one whose first layer is dense (the MoE layer index is not the layer number),
on 2 gloo ranks; without it, the crafted near ties (`routing_workers.near_tie_models`) send some elsewhere."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")

from . import routing_workers as w  # noqa: E402

pytestmark = pytest.mark.megatron_dist


@pytest.fixture(scope="module")
def two():
    from megatron_spec.trainers.megatron.parallel import spawn

    return spawn(w.two_ranks, 2)


@pytest.mark.parametrize("kind", ["moe", "mixed"])
@pytest.mark.parametrize("layout", ["ep2", "pp2"])
def test_megatron_routers_replay_the_engines_experts(two, kind, layout):
    """Per rank, its rows and each MoE layer its stage holds: the replayed forwards' experts equal the engine's at
    every recorded position (sorted: the order of a token's k experts carries nothing); the free forward differs at
    some. The log-prob mismatch with replay is below 0.1 and without it above 2x that (the embedded trainer's test
    has the reasoning for these bounds: same crafting)."""
    layers = set()
    flips = 0
    for rank in two:
        run = rank[kind, layout]
        engine = run["engine"][run["rows"], : run["length"]].long()
        recorded = engine[..., 0, 0] >= 0
        for i, free in run["free"].items():
            want = engine[:, :, i].sort(-1).values[recorded]
            for name in ("replay", "train"):
                assert torch.equal(run[name][i].sort(-1).values[recorded], want), (name, i)
            flips += int((free.sort(-1).values[recorded] != want).any(-1).sum())
            layers.add(i)
        completion = run["mask"][:, 1:]
        replay = float((run["replay_lp"] - run["behaviour"]).abs()[completion].max())
        free = float((run["free_lp"] - run["behaviour"]).abs()[completion].max())
        assert replay < 0.1 and free > 2 * replay, (replay, free)
    assert layers == ({0, 1} if kind == "moe" else {0})
    assert flips > 0


@pytest.mark.parametrize("kind, kw, match", [
    ("dense", {}, "MoE policy; this one is dense"),
    ("moe", {"recompute": "full"}, "recompute=none and sequence_parallel=false"),
])
def test_megatron_policy_refuses_replay_it_cannot_honour(kind, kw, match):
    """Refused in the constructor, before any rank builds or allocates anything (no process group needed)."""
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy
    from megatron_spec.models import CausalLM

    from .common import tiny

    with pytest.raises(ValueError, match=match):
        MegatronPolicy(CausalLM(tiny(kind)), w.GRPOSection(routing_replay=True), w.SAMPLING, Parallelism(), **kw)
