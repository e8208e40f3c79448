"""Refit transports on a local Ray cluster (embedded trainer and engines in actors): the collective refit delivers
the trainer's exact weights to every engine with no `ray.put` and no file written in any actor, and the same spies
see the object-store fallback put its buckets (so they can fail)."""

import pytest
import torch

from tests.rl.test_loop import ckpts, small_cfg  # noqa: F401  (fixtures)

pytestmark = pytest.mark.ray


def _spy(actor):
    """Inside the actor: count ray.put calls and weight-file writes (safetensors, torch.save to a path: torch.save
    to a buffer is how torch pickles a storage, which Ray does for any returned tensor)."""
    import os

    import ray
    import safetensors.torch
    import torch

    calls = {"put": 0, "file": 0}

    def counting(fn, key):
        def wrapped(*args, **kwargs):
            if key == "put" or isinstance(args[1], (str, os.PathLike)):
                calls[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    ray.put = counting(ray.put, "put")
    safetensors.torch.save_file = counting(safetensors.torch.save_file, "file")
    torch.save = counting(torch.save, "file")
    actor._spy_calls = calls


def _calls(actor):
    return dict(actor._spy_calls)


def _perturb(actor, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in actor.policy.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


def _trainer_weights(actor):
    return {k: v.clone() for k, v in actor.policy.model.state_dict().items()}


def _engine_weights(actor):
    return {k: v.clone() for k, v in actor.generator.model.state_dict().items()}


@pytest.mark.parametrize("transport", ["collective", "object_store"])
def test_refit_transport_moves_exact_weights_and_the_spies_see_the_object_store(ray_cluster, ckpts, tmp_path,
                                                                                transport):
    """One trainer rank, two engines (colocated bundles). The trainer's weights are perturbed before each of two
    refits, so an engine that kept old weights fails the equality. Collective: both engines end with the
    trainer's exact tensors, the logged bytes are the policy and drafter in fp32, and no actor called ray.put or
    wrote a weights file, nor did the run directory gain a file. Object store: the same equality, and the spy counts
    the trainer's puts (one per bucket), so a collective refit that used the store would fail."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from megatron_spec.placement.groups import GeneratorGroup, TrainerGroup
    from megatron_spec.placement.bundles import Placement
    from megatron_spec.placement.transport import TRANSPORTS, resolve, sync_metrics

    ray = ray_cluster
    cfg = small_cfg(ckpts, tmp_path)
    cfg.backend.refit_transport = transport
    placement = Placement("colocated", 1, 2, {"CPU": 1.0})
    pg = placement_group(placement.bundles)
    ray.get(pg.ready())
    trainer, generator = TrainerGroup(cfg, placement, pg), GeneratorGroup(cfg, placement, pg)
    try:
        refit = TRANSPORTS[transport](cfg, trainer, generator)
        actors = [trainer.ranks[0], *generator.engines]
        ray.get([a.__ray_call__.remote(_spy) for a in actors])
        files_before = sorted(p for p in tmp_path.rglob("*"))
        for version in (1, 2):
            ray.get(trainer.ranks[0].__ray_call__.remote(_perturb, version))
            metrics = sync_metrics(refit, resolve(refit.start(version)))
            want = ray.get(trainer.ranks[0].__ray_call__.remote(_trainer_weights))
            for engine in generator.engines:
                got = ray.get(engine.__ray_call__.remote(_engine_weights))
                assert all(torch.equal(got[k], want[k]) for k in want), (transport, version)
        assert metrics["weight_sync_transport"] == transport and metrics["weight_sync_gbps"] > 0
        calls = ray.get([a.__ray_call__.remote(_calls) for a in actors])
        assert all(c["file"] == 0 for c in calls)
        if transport == "collective":
            assert all(c["put"] == 0 for c in calls)
            assert sorted(p for p in tmp_path.rglob("*")) == files_before
        else:
            assert calls[0]["put"] >= 2  # at least one bucket per refit
    finally:
        generator.close()
        trainer.close()
        remove_placement_group(pg)
