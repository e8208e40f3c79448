"""Placement and prompt splitting as plain data (no Ray): bundles for colocated and disaggregated groups, the
resource checks that fail before any actor starts, and GRPO groups kept whole across engines."""

import pytest

from megatron_spec.placement.groups import split_groups
from megatron_spec.placement.bundles import plan, trainer_world
from megatron_spec.rl.config import RLConfig


def cfg_with(**backend) -> RLConfig:
    cfg = RLConfig()
    for k, v in backend.items():
        setattr(cfg.backend, k, v)
    return cfg


def test_colocated_shares_bundles_and_disaggregated_separates_them():
    """Colocated: max(ranks, engines) bundles, trainer rank r and engine r in bundle r with half of it each;
    disaggregated: ranks + engines bundles, engines after the ranks, each with a whole bundle."""
    co = plan(cfg_with(placement="colocated", generators=2), {"CPU": 2.0})
    assert co.bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert [co.trainer(0).bundle, co.generator(0).bundle, co.generator(1).bundle] == [0, 0, 1]
    assert co.generator(1).cpus == 0.5 and co.generator(1).threads == 1
    dis = plan(cfg_with(placement="disaggregated", generators=3), {"CPU": 8.0})
    assert dis.bundles == [{"CPU": 2.0}] * 4
    assert [dis.trainer(0).bundle] + [dis.generator(i).bundle for i in range(3)] == [0, 1, 2, 3]
    assert dis.generator(2).cpus == 2.0 and dis.generator(2).threads == 2
    gpu = plan(cfg_with(placement="colocated", generators=8), {"CPU": 64.0, "GPU": 8.0})
    assert gpu.bundles == [{"CPU": 8, "GPU": 1.0}] * 8 and gpu.trainer(3).gpus == 0.5


def test_megatron_world_and_recipe_layout():
    """Megatron ranks: the recipe layout's TP*PP*CP*DP; without one, the smallest world both the dense (TP*PP*CP)
    and the expert (EP*ETP*PP) layouts divide."""
    cfg = cfg_with(trainer="megatron")
    cfg.backend.megatron.ep = 2
    assert trainer_world(cfg) == 2
    cfg.backend.megatron.tp = 2
    cfg.backend.megatron.etp = 1
    assert trainer_world(cfg) == 2
    cfg.backend.megatron.pp = 3
    assert trainer_world(cfg) == 6
    layout = {"megatron": {"tp": 4, "pp": 4, "cp": 1, "ep": 32, "etp": 1, "dp": 8},
              "vllm": {"engines": 16}, "ray": {"bundle": {"GPU": 1}}}
    p = plan(cfg_with(trainer="megatron", placement="colocated"), {"CPU": 1024.0, "GPU": 128.0}, layout)
    assert (p.trainer_world, p.generators, len(p.bundles)) == (128, 16, 128)
    layout["ray"]["placement"] = "disaggregated"  # a recipe's own placement, when the config leaves it inline
    p = plan(cfg_with(trainer="megatron"), {"CPU": 1024.0, "GPU": 160.0}, layout)
    assert (p.kind, len(p.bundles), p.generator(0).bundle) == ("disaggregated", 144, 128)


def test_resources_the_cluster_lacks_fail_before_any_actor():
    with pytest.raises(ValueError, match="needs 3 GPUs .* separate GPUs.*has 2"):
        plan(cfg_with(placement="disaggregated", generators=2), {"CPU": 8.0, "GPU": 2.0})
    layout = {"megatron": {"tp": 4, "pp": 4, "cp": 1, "dp": 8}, "ray": {"bundle": {"GPU": 1}}}
    with pytest.raises(ValueError, match="needs 128 GPUs.*has 0"):
        plan(cfg_with(trainer="megatron", placement="colocated"), {"CPU": 8.0}, layout)
    meg = cfg_with(trainer="megatron", placement="colocated")
    meg.backend.megatron.ep = 2  # world 2, all data parallel for the dense layers
    meg.grpo.prompts_per_step, meg.grpo.group_size = 3, 3
    with pytest.raises(ValueError, match="9 rollouts .* 2 data-parallel ranks"):
        plan(meg, {"CPU": 2.0})
    with pytest.raises(ValueError, match="colocated or disaggregated"):
        plan(cfg_with(), {"CPU": 2.0})
    with pytest.raises(ValueError, match="backend.generators=3 but the recipe's layout has 16"):
        plan(cfg_with(placement="colocated", generators=3), {"CPU": 2.0}, {"vllm": {"engines": 16}})


def test_split_keeps_grpo_groups_whole():
    """9 groups of 4 over 2 engines: 5 and 4 whole groups, contiguous, covering every prompt once; more engines
    than groups leaves the extra engines idle; prompts that are not whole groups are refused."""
    assert split_groups(36, 4, 2) == [(0, 20), (20, 36)]
    assert split_groups(6, 3, 4) == [(0, 3), (3, 6)]
    for n, g, e in ((64, 8, 3), (12, 3, 5), (8, 8, 1)):
        ranges = split_groups(n, g, e)
        assert ranges[0][0] == 0 and ranges[-1][1] == n and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all((hi - lo) % g == 0 for lo, hi in ranges)
        sizes = [hi - lo for lo, hi in ranges]
        assert max(sizes) - min(sizes) <= g
    with pytest.raises(ValueError, match="not whole groups"):
        split_groups(10, 4, 2)


def test_engine_of_tensor_parallel_size_2_is_one_tied_bundle():
    """vLLM TP2: an engine's two device units are one bundle (Ray places a bundle on one node). CPU, colocated with
    two Megatron ranks (EP2) and one engine: one bundle of both CPUs, both ranks and the engine in it, the engine
    with the two ranks' halves. GPUs, disaggregated: two 1-GPU trainer bundles, then 2-GPU engine bundles whose
    engine takes both GPUs; the GPU count check counts TP. (Colocated on GPUs: one bundle per GPU, the next test.)"""
    cfg = cfg_with(placement="colocated", trainer="megatron", generator="vllm")
    cfg.backend.megatron.ep, cfg.backend.vllm.tensor_parallel_size = 2, 2
    co = plan(cfg, {"CPU": 2.0})
    assert co.bundles == [{"CPU": 2.0}]
    assert [co.trainer(0).bundle, co.trainer(1).bundle, co.generator(0).bundle] == [0, 0, 0]
    assert (co.trainer(1).cpus, co.generator(0).cpus) == (0.5, 1.0)
    cfg.backend.placement, cfg.backend.generators = "disaggregated", 2
    dis = plan(cfg, {"CPU": 48.0, "GPU": 6.0})
    assert dis.bundles == [{"CPU": 8, "GPU": 1.0}] * 2 + [{"CPU": 16, "GPU": 2.0}] * 2
    assert [dis.generator(1).bundle, dis.generator(1).gpus, dis.trainer(1).gpus] == [3, 2.0, 1.0]
    with pytest.raises(ValueError, match="needs 6 GPUs .*2 engines of 2 GPU"):
        plan(cfg, {"CPU": 40.0, "GPU": 5.0})


def test_colocated_engines_of_tensor_parallel_size_2_take_one_bundle_per_gpu():
    """Colocated on GPUs, 4 Megatron ranks (PP2 x DP2) and 2 engines of vLLM TP2: four 1-GPU bundles; trainer rank
    r and worker r (engine r // 2, local rank r % 2) share bundle r, each with half its GPU; an engine's actor sits
    in its first worker's bundle. An engine of TP 4 on nodes of 3 GPUs is refused before any actor starts (its
    workers are one actor's processes, on one node)."""
    cfg = cfg_with(placement="colocated", trainer="megatron", generator="vllm", generators=2)
    cfg.backend.vllm.tensor_parallel_size = 2
    layout = {"megatron": {"tp": 1, "pp": 2, "cp": 1, "dp": 2}}
    p = plan(cfg, {"CPU": 32.0, "GPU": 4.0, "node:10.0.0.1": 1.0}, layout)
    assert p.per_gpu and p.bundles == [{"CPU": 8, "GPU": 1.0}] * 4
    assert [p.trainer(r).bundle for r in range(4)] == [0, 1, 2, 3]
    assert [p.engine_bundles(j) for j in range(2)] == [[0, 1], [2, 3]]
    assert [(p.generator(j).bundle, p.generator(j).gpus) for j in range(2)] == [(0, 0.5), (2, 0.5)]
    assert [p.gpu_peer(u) for u in range(4)] == [0, 1, 2, 3]
    cfg.backend.generators, cfg.backend.vllm.tensor_parallel_size = 1, 4
    with pytest.raises(ValueError, match="tensor_parallel_size=4 on nodes of 3 GPUs"):
        plan(cfg, {"CPU": 48.0, "GPU": 6.0, "node:10.0.0.1": 1.0, "node:10.0.0.2": 1.0}, layout)


def test_cpu_colocation_keeps_its_tied_bundle_and_gloo():
    """On CPUs nothing changes: an engine of TP2 is one bundle with the trainer ranks it shares, its actor sees
    its workers' devices itself (no GPU list to hand down), and the refit travels over gloo."""
    from megatron_spec.placement.groups import engine_devices
    from megatron_spec.placement.transport import weight_backend
    from megatron_spec.rl.config import RLConfig

    cfg = RLConfig()
    cfg.backend.placement, cfg.backend.trainer, cfg.backend.generator = "colocated", "megatron", "vllm"
    cfg.backend.vllm.tensor_parallel_size = 2
    p = plan(cfg, {"CPU": 2.0}, {"megatron": {"tp": 1, "pp": 2, "cp": 1, "dp": 1}})
    assert not p.per_gpu and p.bundles == [{"CPU": 2.0}] and p.engine_bundles(0) == [0, 0]
    assert engine_devices(p, None, 0) is None and weight_backend(p) == "gloo"


@pytest.mark.parametrize("override, message", [
    ("backend.refit_transport=files", "backend.refit_transport must be one of collective, object_store"),
    ("backend.init_timeout_s=0", "backend.init_timeout_s must be > 0"),
    ("backend.vllm.tensor_parallel_size=0", "backend.vllm.tensor_parallel_size must be >= 1"),
    ("backend.vllm.sleep_level=3", "backend.vllm.sleep_level must be 1 or 2"),
])
def test_refit_and_engine_settings_are_checked(override, message):
    """Bad values of the refit / start-up / engine settings fail when the config is built, naming the key."""
    from megatron_spec.rl.overrides import apply_overrides

    with pytest.raises(ValueError, match=message):
        apply_overrides(RLConfig(), [override])
