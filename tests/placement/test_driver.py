"""The RL loop on Ray worker groups, at toy size on a local 2-CPU cluster, with the embedded trainer and engines in
actors: the synchronous Ray run is the in-process run exactly, async GRPO keeps its lag bound and corrects for it,
a killed engine is replaced with its prompts re-issued, and a dead trainer stops the run with its checkpoint
intact and a resume command that works."""

import hashlib
import json

import pytest
import torch

from megatron_spec.placement.driver import RayTrainer
from megatron_spec.placement.groups import TrainerDied
from megatron_spec.rl import loop
from megatron_spec.rl.config import RolloutCorrection
from megatron_spec.rl.logging import read_metrics
from tests.rl.test_loop import ckpts, shaped_reward, small_cfg  # noqa: F401  (fixtures)
from tests.trainers.megatron.common import sharded_tensors

pytestmark = pytest.mark.ray

SAME = ["reward_mean", "loss", "gen_tokens", "drafter_loss", "acceptance_length", "grad_norm", "clip_frac",
        "logprob_mismatch", "response_len_mean", "response_len_max", "drafter_agreement"]
"""The metrics a run computes (not its timings); equal means the same rollouts, losses and updates."""


def ray_cfg(ckpts, out, placement="colocated", generators=1, lag=0, steps=3):
    cfg = small_cfg(ckpts, out)
    cfg.backend.placement, cfg.backend.generators, cfg.backend.async_lag = placement, generators, lag
    cfg.run.steps, cfg.run.report = steps, False
    return cfg


def final_weights(run_dir):
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return torch.load(run_dir / "checkpoints" / latest / "state.pt", weights_only=False)["state"]


def test_sync_ray_run_is_the_inline_run_exactly(ray_cluster, ckpts, tmp_path, shaped_reward):
    """async_lag=0, one engine, same seed: colocated and disaggregated Ray runs log the inline run's metrics (rewards,
    losses, tokens, acceptance, the engine-vs-trainer log-prob mismatch) exactly and end with the same weights,
    policy and drafter: the stages are the loop's own, the weights cross the object store unchanged, and each actor
    computes with one thread as the inline run does. Each step also logs the sync's bytes (the policy and drafter
    in fp32, the engines' served dtype, counted once per step), seconds, GB/s and transport (the collective
    default), and lag 0."""
    runs = {}
    for placement in ("inline", "colocated", "disaggregated"):
        loop.train(ray_cfg(ckpts, tmp_path / placement, placement))
        runs[placement] = read_metrics(tmp_path / placement)
    inline = [[m[k] for k in SAME] for m in runs["inline"]]
    assert all(m["logprob_mismatch"] < 1e-4 for m in runs["inline"])
    for placement in ("colocated", "disaggregated"):
        assert [[m[k] for k in SAME] for m in runs[placement]] == inline, placement
        a, b = final_weights(tmp_path / "inline"), final_weights(tmp_path / placement)
        for part in ("model", "drafter"):
            assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), (placement, part)
        tensors = {t.untyped_storage().data_ptr(): t for part in ("model", "drafter") for t in a[part].values()}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())  # a tied head counted once
        for m in runs[placement]:
            assert m["policy_lag"] == 0 and m["generator_restarts"] == 0 and m["weight_sync_s"] > 0
            assert m["weight_sync_bytes"] == nbytes and m["weight_sync_transport"] == "collective"
            assert m["weight_sync_gbps"] == pytest.approx(nbytes / m["weight_sync_s"] / 1e9)


@pytest.mark.parametrize("lag", [1, 2])
def test_async_lag_is_bounded_and_corrected(ray_cluster, ckpts, tmp_path, shaped_reward, lag):
    """Generators run ahead by at most `lag` versions. The schedule is deterministic: step s trains on rollouts of
    version max(0, s - lag), so policy_lag is exactly min(s, lag) per step, never above the bound; off-policy steps
    carry the behaviour log-probs into the loss (is_clip_frac is logged, which only the importance-weighted loss
    computes) and do not report a mismatch, on-policy ones report it ~0. Two engines, so each step's rollouts come
    from both (their versions agree, since they are synced together). Lagged steps log their importance ratios;
    with lag 2 the correction is the geometric mean's with a rejection band (`grpo.rollout_correction`, the old
    log-probs recomputed before the update), which logs what it masked."""
    cfg = ray_cfg(ckpts, tmp_path, "disaggregated", generators=2, lag=lag, steps=4)
    if lag == 2:
        cfg.grpo.fold_logprob = False
        cfg.grpo.rollout_correction = RolloutCorrection(level="geometric", reject_low=0.9, reject_high=1.1)
    loop.train(cfg)
    metrics = read_metrics(tmp_path)
    assert [m["policy_lag"] for m in metrics] == [min(s, lag) for s in range(4)]
    for m in metrics:
        if m["policy_lag"]:
            assert m["logprob_mismatch"] is None and 0.0 <= m["is_clip_frac"] <= 1.0
            assert 0 < m["is_ratio_min"] <= m["is_ratio_mean"] <= m["is_ratio_max"]
            tokens, seqs = m["is_masked_tokens_frac"], m["is_masked_seqs_frac"]
            assert (tokens, seqs) == (0.0, 0.0) if lag == 1 else (tokens > 0) == (seqs > 0)  # whole rows
            if seqs == 1.0:  # every sequence rejected: nothing left in the loss
                assert m["loss"] == 0.0
        else:
            assert m["logprob_mismatch"] < 1e-4 and "is_clip_frac" not in m and "is_ratio_mean" not in m
        assert not m["skipped"] and m["gen_tokens"] > 0
    if lag == 2:  # two versions behind, the band around 1 rejects (seeded run: 1, 1 and 2/3 of the sequences)
        assert any(m.get("is_masked_seqs_frac", 0) > 0 for m in metrics)


def test_killed_engine_is_replaced_and_its_prompts_reissued(ray_cluster, ckpts, tmp_path, shaped_reward):
    """Two engines; engine 1 ends its process inside `generate` of step 1 (after computing, before answering). The
    step completes with all 9 rollouts, one restart logged, and with exactly the metrics of the same run without
    the fault: the replacement gets the step's weights and the dead engine's prompts with the same seeds."""
    runs = []
    for crash in (False, True):
        trainer = RayTrainer(ray_cfg(ckpts, tmp_path / str(crash), generators=2))
        try:
            metrics = [trainer.step(0)]
            if crash:
                trainer.generator.engines[1].arm_crash.remote("generate")
            metrics.append(trainer.step(1))
        finally:
            trainer.close()
        runs.append(metrics)
    clean, faulty = runs
    assert [m["generator_restarts"] for m in faulty] == [0, 1]
    assert [[m[k] for k in SAME] for m in faulty] == [[m[k] for k in SAME] for m in clean]
    assert faulty[1]["response_len_mean"] * 9 == faulty[1]["gen_tokens"]  # 9 = 3 prompts x 3 rollouts


def test_dead_trainer_stops_with_checkpoint_intact_and_resume_works(ray_cluster, ckpts, tmp_path, shaped_reward,
                                                                    capsys):
    """Checkpoint after step 1, then the trainer rank dies inside step 2's update: the run stops with TrainerDied,
    prints the resume command, and leaves the step-1 checkpoint byte for byte as it was (still `latest`). The
    printed command, run as is, resumes at step 2 and finishes step 3."""
    from megatron_spec.cli import main

    cfg = ray_cfg(ckpts, tmp_path, steps=2)
    cfg.run.save_every = 1
    loop.train(cfg)
    ckpt = tmp_path / "checkpoints" / "step_000001" / "state.pt"
    digest = hashlib.sha256(ckpt.read_bytes()).hexdigest()

    def doomed(c):
        trainer = RayTrainer(c)
        trainer.policy.ranks[0].arm_crash.remote("train_step")
        return trainer

    cfg.run.steps = 4
    with pytest.raises(TrainerDied) as err:
        loop.run(cfg, doomed)
    command = f"megatron-spec train --config {tmp_path}/config.yaml"
    assert command in str(err.value) and f"{tmp_path}/checkpoints/step_000001" in str(err.value)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert hashlib.sha256(ckpt.read_bytes()).hexdigest() == digest
    capsys.readouterr()
    assert main(command.split()[1:]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert [m["step"] for m in read_metrics(tmp_path)] == [0, 1, 2, 3]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000003"


def test_trainer_ranks_form_one_process_group(ray_cluster, ckpts):
    """Two trainer ranks join one gloo group (their all-reduce of ones gives 2) before building the policy, which
    is how a Megatron policy finds torch.distributed initialised; both export the same initial weights."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from megatron_spec.placement.groups import TrainerGroup
    from megatron_spec.placement.bundles import Placement

    placement = Placement("disaggregated", 2, 0, {"CPU": 1.0})
    pg = placement_group(placement.bundles)
    ray_cluster.get(pg.ready())
    group = TrainerGroup(small_cfg(ckpts, "unused"), placement, pg)
    try:
        assert group.joined == 2
        refs = [ray_cluster.get(r.export.remote(1 << 20)) for r in group.ranks]
        assert refs[0][1] == refs[1][1] > 0 and len(refs[0][0]) > 0 and refs[1][0] == []  # rank 0 publishes
    finally:
        group.close()
        remove_placement_group(pg)


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory):
    from megatron_spec.models import CausalLM, preset, save_pretrained

    root = tmp_path_factory.mktemp("moe")
    torch.manual_seed(0)
    model = CausalLM(preset("tiny-qwen3-moe"))
    model.config.eos_token_id = 2
    model.reset_parameters(std=0.1)
    save_pretrained(model, root / "policy")
    return root / "policy"


def test_megatron_ranks_in_actors_train_and_refit_the_engine(ray_cluster, ckpts, moe_policy, tmp_path,
                                                             shaped_reward):
    """Megatron-Core trainer with EP=2 as two Ray actors in one gloo group (rank 0 called, rank 1 following),
    colocated with an engine, on a tiny MoE. Step 0's rollouts are sampled with the weights the Megatron trainer
    exported into the engine; they equal the in-process embedded run's (same tokens, same rewards) only if that
    export maps every tensor back to the checkpoint's exactly. Every step's engine-vs-trainer log-prob mismatch
    stays below 1e-4, which after step 0 holds only if the updated weights reached the engine intact (a stale or
    mis-mapped tensor shows at once: the policy moved by lr 3e-3). The losses themselves are not compared: they
    were 0.4 % apart here (both include their MoE load-balancing term, accounted per micro-batch and, in Megatron,
    per data-parallel rank); trainer parity belongs to the Megatron backend's tests."""
    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'megatron-spec[megatron]'")
    runs = {}
    for trainer, placement in (("embedded", "inline"), ("megatron", "colocated")):
        cfg = ray_cfg(ckpts, tmp_path / trainer, placement, steps=2)
        cfg.model.policy, cfg.model.drafter, cfg.spec = str(moe_policy), None, None
        cfg.grpo.prompts_per_step, cfg.grpo.group_size = 2, 4  # 8 rollouts: whole halves for the 2 DP ranks
        cfg.backend.trainer = trainer
        cfg.backend.megatron.ep = 2
        loop.train(cfg)
        runs[trainer] = read_metrics(tmp_path / trainer)
    emb, meg = runs["embedded"], runs["megatron"]
    assert [emb[0][k] for k in ("gen_tokens", "reward_mean")] == [meg[0][k] for k in ("gen_tokens", "reward_mean")]
    assert all(m["logprob_mismatch"] < 1e-4 for m in meg) and not any(m["skipped"] for m in meg)
    # Colocated: before each refit the trainer released its gradients (none before the first update), and both
    # sides' memory is logged every step.
    assert [m["trainer_offload"]["offload_freed_grad_mb"] > 0 for m in meg] == [False, True]
    assert all(m["trainer_offload"]["trainer_rss_mb_offloaded"] > 0 for m in meg)
    assert all(len(m["engine_memory"]["engine_peak_rss_mb"]) == 1 for m in meg)
    assert "trainer_offload" not in emb[0] and "engine_memory" not in emb[0]


def test_megatron_ranks_in_actors_write_and_resume_a_sharded_checkpoint(ray_cluster, ckpts, moe_policy, tmp_path,
                                                                        shaped_reward):
    """Under Ray a Megatron trainer's checkpoint is Megatron-Core's distributed one, written by every rank actor:
    `policy/` holds `torch_dist` shard files of both ranks (`__<rank>_<n>.distcp`) and the run's `state.pt` keeps
    no weights (it is far smaller than the fp32 policy). Saving every step, steps 0 and 1 are written in the
    background (each rank actor's writer process during the next step, finalized by the driver at the next save,
    which logs `save_background_s`) and step 2, the last, in the foreground.

    The run cut back to step 1's background checkpoint resumes, and its step 2 equals the straight run's exactly
    (loss, grad norm, reward, log-prob mismatch) and ends in the same step-2 checkpoint, every tensor (weights and
    both Adam moments) bitwise. Then a run going on from step 2 loses trainer rank 0 while step 3's background
    write is in flight (its process ends right after handing its shards to its writer): the run stops with
    TrainerDied, no `step_000003` is named, `latest` still names step 2 and its files are byte for byte as they
    were, whole tensors and all."""
    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'megatron-spec[megatron]'")
    import shutil

    out = tmp_path / "run"

    def cfg_for(run_dir, steps: int):
        cfg = ray_cfg(ckpts, run_dir, "colocated", steps=steps)
        cfg.model.policy, cfg.model.drafter, cfg.spec = str(moe_policy), None, None
        cfg.grpo.prompts_per_step, cfg.grpo.group_size = 2, 4
        cfg.backend.trainer, cfg.backend.megatron.ep = "megatron", 2
        cfg.run.resume, cfg.run.save_every, cfg.run.async_save = True, 1, True
        return cfg

    loop.train(cfg_for(out, 3))
    straight = read_metrics(out)
    assert [sorted(k for k in m if k.startswith("save_")) for m in straight] == [
        ["save_blocking_s"], ["save_background_s", "save_blocking_s"], ["save_background_s", "save_blocking_s"]]
    ckpts_dir = out / "checkpoints"
    assert (ckpts_dir / "latest").read_text().strip() == "step_000002"
    for step in (1, 2):  # a background save and a foreground one
        shards = [p.name for p in (ckpts_dir / f"step_{step:06d}" / "policy").iterdir() if p.name.endswith(".distcp")]
        assert {name.split("_")[2] for name in shards} == {"0", "1"}, shards
    policy_bytes = sum(p.stat().st_size for p in moe_policy.glob("*.safetensors"))
    assert (ckpts_dir / "step_000001" / "state.pt").stat().st_size < policy_bytes / 4
    final = sharded_tensors(ckpts_dir / "step_000002")
    assert any(k.startswith("exp_avg_sq.") for k in final) and any(k.startswith("weights.") for k in final)

    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000002")
    (cut / "checkpoints" / "latest").write_text("step_000001")
    loop.train(cfg_for(cut, 3))
    resumed = read_metrics(cut)
    keys = ["step", "loss", "grad_norm", "reward_mean", "logprob_mismatch", "gen_tokens"]
    assert [m["step"] for m in resumed] == [0, 1, 2]
    assert [resumed[2][k] for k in keys] == [straight[2][k] for k in keys]
    again = sharded_tensors(cut / "checkpoints" / "step_000002")
    assert sorted(again) == sorted(final) and all(torch.equal(again[k], final[k]) for k in final)

    before = {p: p.read_bytes() for p in (cut / "checkpoints" / "step_000002").rglob("*") if p.is_file()}

    def doomed(c):
        trainer = RayTrainer(c)
        trainer.policy.ranks[0].arm_crash.remote("save_sharded")
        return trainer

    with pytest.raises(TrainerDied):
        loop.run(cfg_for(cut, 5), doomed)
    assert (cut / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert not (cut / "checkpoints" / "step_000003").exists()
    assert {p: p.read_bytes() for p in (cut / "checkpoints" / "step_000002").rglob("*") if p.is_file()} == before
    loaded = sharded_tensors(cut / "checkpoints" / "step_000002")
    assert all(torch.equal(loaded[k], final[k]) for k in final)


def test_megatron_pipeline_stages_each_send_their_own_weights(ray_cluster, ckpts, moe_policy, tmp_path,
                                                             shaped_reward):
    """Megatron-Core trainer with PP=2 as two Ray actors, colocated with one engine: the refit has two senders (one
    per stage) whose bytes add up to the refit's, the busier sending less than the whole model, and neither rank
    receives anything (with TP = EP = 1 a stage gathers nothing, and no stage sends to another). The engine's
    log-probs match the trainer's below 1e-4 on every step, which holds only if both stages' weights reached it
    intact after each update (the policy moves by lr 3e-3 a step)."""
    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'megatron-spec[megatron]'")
    cfg = ray_cfg(ckpts, tmp_path, "colocated", steps=2)
    cfg.model.policy, cfg.model.drafter, cfg.spec = str(moe_policy), None, None
    cfg.grpo.prompts_per_step, cfg.grpo.group_size = 2, 4
    cfg.backend.trainer, cfg.backend.megatron.pp = "megatron", 2
    loop.train(cfg)
    logged = read_metrics(tmp_path)
    assert len(logged) == 2 and all(m["logprob_mismatch"] < 1e-4 for m in logged)
    for m in logged:
        assert m["weight_sync_senders"] == 2 and m["weight_sync_received_bytes_max"] == 0
        assert m["weight_sync_bytes"] / 2 <= m["weight_sync_sender_bytes_max"] < m["weight_sync_bytes"]
        assert m["weight_sync_wait_s"] >= 0
