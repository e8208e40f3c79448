"""Colocated engines of vLLM TP 2 on 4 logical Ray GPUs (`ray.init(num_gpus=4)`: Ray assigns GPU ids, no CUDA runs):
the placement's actors in their bundles, the GPU each engine worker is pointed at, and the refit transport chosen.
Ray runs in a spawned process of its own, so this cluster of GPUs never meets the other tests' CPU cluster."""

import multiprocessing as mp
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

WORKER = "import os, sys; print(os.environ['CUDA_VISIBLE_DEVICES'].split(',')[int(sys.argv[1])])"
"""What a vLLM worker of local rank argv[1] takes: the argv[1]-th GPU its engine's process makes visible."""


class Probe:
    """Stands in for a trainer rank or an engine actor in its slot: the GPU ids Ray gives it and, for an engine,
    the GPU each of its workers (processes it starts, as vLLM's "mp" executor does) lands on."""

    def seen(self, devices=None, workers: int = 0):
        import ray

        from megatron_spec.placement.workers import share_devices

        share_devices(devices)  # what `Engine.__init__` does before vLLM starts its workers
        landed = [subprocess.run([sys.executable, "-c", WORKER, str(w)], capture_output=True, text=True,
                                 check=True).stdout.strip() for w in range(workers)]
        return [str(i) for i in ray.get_gpu_ids()], landed


def _scenario(out):
    import ray
    from ray.util.placement_group import placement_group

    from megatron_spec.placement.bundles import plan
    from megatron_spec.placement.groups import _actor, engine_devices
    from megatron_spec.placement.transport import weight_backend, weight_senders
    from megatron_spec.rl.config import RLConfig

    ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        cfg = RLConfig()
        cfg.backend.placement, cfg.backend.trainer, cfg.backend.generator = "colocated", "megatron", "vllm"
        cfg.backend.generators, cfg.backend.vllm.tensor_parallel_size = 2, 2
        placement = plan(cfg, ray.cluster_resources(), {"megatron": {"tp": 1, "pp": 2, "cp": 1, "dp": 2}})
        pg = placement_group(placement.bundles, strategy="PACK")
        ray.get(pg.ready(), timeout=60)
        trainers = [_actor(Probe, placement.trainer(r), pg).remote() for r in range(placement.trainer_world)]
        trainer_ids = ray.get([t.seen.remote() for t in trainers])
        devices = [engine_devices(placement, pg, j) for j in range(placement.generators)]
        engines = [_actor(Probe, placement.generator(j), pg).remote() for j in range(placement.generators)]
        engine_ids = ray.get([e.seen.remote(devices[j], placement.engine_tp) for j, e in enumerate(engines)])
        backend = weight_backend(placement)
        out.put(("ok", trainer_ids, devices, engine_ids, backend, weight_senders(cfg, backend, placement),
                 [placement.gpu_peer(u) for u in range(4)]))
    except Exception as err:  # reported, not lost in the child
        out.put(("error", repr(err)))
    finally:
        ray.shutdown()


def test_colocated_tp2_engine_workers_take_their_trainer_ranks_gpus_and_refit_through_cuda_ipc():
    """4 Megatron ranks (PP2 x DP2) and 2 engines of TP2 colocated: each trainer rank sees one GPU, all four
    different; engine j's actor sees the GPU of its first worker, and its workers (local ranks 0 and 1, processes
    it starts) land on the GPUs that trainer ranks 2j and 2j + 1 see, the ranks they share a GPU with. Every
    engine worker thus shares a GPU with a trainer rank, so the refit is CUDA IPC with 4 senders, rank u serving
    worker u."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_scenario, args=(out,), daemon=True)
    proc.start()
    result = out.get(timeout=240)
    proc.join(60)
    assert result[0] == "ok", result
    _, trainer_ids, devices, engine_ids, backend, senders, peers = result
    trainer_gpus = [ids for ids, _ in trainer_ids]
    assert all(len(ids) == 1 for ids in trainer_gpus) and len({ids[0] for ids in trainer_gpus}) == 4
    for j, (own, workers) in enumerate(engine_ids):
        peers_gpus = [trainer_gpus[2 * j + w][0] for w in range(2)]
        assert devices[j] == peers_gpus
        assert workers == peers_gpus
        assert own == [peers_gpus[0]]
    assert peers == [0, 1, 2, 3]
    assert (backend, senders) == ("cuda_ipc", 4)

