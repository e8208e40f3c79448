"""The GRPO loop end to end on tiny random models: refit, drafter freshness, gradient isolation, exact resume,
greedy losslessness at the RL level, and bad input."""

import copy
import dataclasses
import json
import re

import pytest
import torch

from megatron_spec.drafters.mtp.model import MTP
from megatron_spec.models import CausalLM, preset, save_pretrained
from megatron_spec.drafters.files import save_drafter
from megatron_spec.rl import loop
from megatron_spec.rl.config import DrafterTrainSection, GRPOSection, RLConfig
from megatron_spec.rl.logging import read_metrics
from megatron_spec.refit import buckets
from megatron_spec.rl.task import PromptTask
from megatron_spec.drafters.config import SpecConfig


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    torch.manual_seed(0)
    model = CausalLM(preset("tiny-qwen3"))
    model.config.eos_token_id = 2
    model.reset_parameters(std=0.1)
    save_pretrained(model, root / "policy")
    save_drafter(MTP(model.config), root / "mtp", "mtp", model.config)
    save_pretrained(model, root / "draft")  # a draft model that starts as the policy itself
    return root


def small_cfg(ckpts, out, spec="mtp", **grpo) -> RLConfig:
    cfg = RLConfig()
    cfg.model.policy = str(ckpts / "policy")
    cfg.model.drafter = {"mtp": str(ckpts / "mtp"), "draft_model": str(ckpts / "draft")}.get(spec)
    cfg.spec = SpecConfig(spec, 3) if spec else None
    cfg.grpo = GRPOSection(**{"prompts_per_step": 3, "group_size": 3, "max_tokens": 14, "lr": 3e-3, **grpo})
    cfg.run.out_dir, cfg.run.steps, cfg.run.threads, cfg.run.eval_every = str(out), 3, 1, 0
    cfg.run.save_every, cfg.run.report = 2, False
    return cfg


@pytest.fixture
def shaped_reward(monkeypatch):
    """Random tiny models never solve arithmetic; reward 'contains token 20' instead so updates really happen."""
    monkeypatch.setattr(PromptTask, "reward", lambda self, ids, problem: float(20 in ids))


def test_refit_makes_engine_weights_equal_trainer_weights(ckpts, tmp_path, shaped_reward):
    trainer = loop.Trainer(small_cfg(ckpts, tmp_path))
    trainer.step(0)  # the policy and its drafter have now moved away from the generator's copy
    gen, pol = trainer.generator, trainer.policy
    moved = any(not torch.equal(a, b) for a, b in zip(gen.model.state_dict().values(), pol.model.state_dict().values()))
    assert moved
    nbytes = gen.update_weights(buckets(pol.export_weights(), 64 << 10))
    assert nbytes > 0
    for (n, a), b in zip(gen.model.state_dict().items(), pol.model.state_dict().values()):
        assert torch.equal(a, b), n
    for (n, a), b in zip(gen.drafter.state_dict().items(), pol.drafter.state_dict().values()):
        assert torch.equal(a, b), n


def test_drafter_stays_fresh_and_acceptance_never_drops_to_zero(ckpts, tmp_path, shaped_reward):
    """Draft model distilled online, sampling its drafts: every step's prepare stage refits the generator's drafter
    to exactly the trainer's drafter of that moment, the trainer's drafter then moves (online training), and the
    mean acceptance length stays high (>= 2.5 of at most 4): a drafter lost or left stale after refit would show."""
    cfg = small_cfg(ckpts, tmp_path, spec="draft_model", lr=3e-4)  # a policy step the drafter can follow
    cfg.spec.draft_sampling = True
    trainer = loop.Trainer(cfg)
    for step in range(3):
        snapshot = copy.deepcopy(trainer.policy.drafter.state_dict())
        metrics = trainer.step(step)
        assert metrics["acceptance_length"] >= 2.5
        gen_state = trainer.generator.drafter.state_dict()
        assert all(torch.equal(gen_state[k], snapshot[k]) for k in snapshot)
        moved = trainer.policy.drafter.state_dict()
        assert any(not torch.equal(moved[k], snapshot[k]) for k in snapshot)


def test_drafter_loss_leaves_trunk_gradients_identical(ckpts, tmp_path, shaped_reward):
    """Same batch, same weights: the policy's gradients with online MTP training on equal those without it."""
    on = loop.Trainer(small_cfg(ckpts, tmp_path / "a"))
    cfg_off = small_cfg(ckpts, tmp_path / "b")
    cfg_off.drafter_train.online = False
    off = loop.Trainer(cfg_off)
    on.step(0)
    off.step(0)
    assert on.policy.drafter_trainer.opt is not None and off.policy.drafter_trainer.opt is None
    for (n, a), b in zip(on.policy.model.named_parameters(), off.policy.model.parameters()):
        assert a.grad is not None and torch.equal(a.grad, b.grad), n
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in on.policy.drafter.parameters())


@pytest.mark.parametrize("replay", [1, 3])
def test_resume_continues_exactly(ckpts, tmp_path, shaped_reward, replay):
    """4 steps straight vs 2 steps, stop, resume to 4: identical metrics (rewards, losses, tokens) and weights. With
    `drafter_train.replay=3` the resumed run's first drafter update re-reads steps 0 and 1, which only the checkpoint
    can give it."""
    full = small_cfg(ckpts, tmp_path / "full")
    full.run.steps, full.drafter_train.replay = 4, replay
    loop.train(full)
    part = small_cfg(ckpts, tmp_path / "part")
    part.run.steps, part.drafter_train.replay = 2, replay
    loop.train(part)
    part.run.steps = 4
    loop.train(part)
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "part")
    keys = ["reward_mean", "loss", "gen_tokens", "drafter_loss", "acceptance_length"]
    assert [[m[k] for k in keys] for m in a] == [[m[k] for k in keys] for m in b]
    wa = torch.load(tmp_path / "full/checkpoints/step_000003/state.pt", weights_only=False)["state"]["model"]
    wb = torch.load(tmp_path / "part/checkpoints/step_000003/state.pt", weights_only=False)["state"]["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_greedy_rl_plain_and_speculative_runs_are_identical(ckpts, tmp_path, shaped_reward):
    """Greedy rollouts: plain and speculative (MTP, online) runs give the same trajectories, rewards and losses.
    (Greedy groups are G copies of one rollout, so advantages and losses are zero: the policy itself cannot move
    here; the sampled-rollout comparison over seeds lives in the report's losslessness section.)"""
    runs = {}
    for name, spec in (("plain", None), ("spec", "mtp")):
        cfg = small_cfg(ckpts, tmp_path / name, spec=spec, temperature=0.0)
        loop.train(cfg)
        runs[name] = read_metrics(tmp_path / name)
    keys = ["reward_mean", "loss", "gen_tokens", "response_len_max", "response_len_mean"]
    assert [[m[k] for k in keys] for m in runs["plain"]] == [[m[k] for k in keys] for m in runs["spec"]]
    assert all(m["acceptance_length"] is not None for m in runs["spec"])


@pytest.mark.parametrize("fold", [True, False])
def test_behaviour_logprobs_match_recompute(ckpts, tmp_path, shaped_reward, fold):
    """The engine's per-token logprobs equal the trainer's, from the train forward (folded) or a recompute."""
    metrics = loop.Trainer(small_cfg(ckpts, tmp_path, top_p=0.9, fold_logprob=fold)).step(0)
    assert metrics["logprob_mismatch"] < 1e-4
    assert not metrics["skipped"] and list(metrics["stages"]) == ["data", "prepare", "gen", "logprob", "train"]


def test_folded_logprob_stage_gives_the_recompute_step(ckpts, tmp_path, shaped_reward):
    """Two RL steps with the recompute folded into the train forward and with the separate logprob forward: the
    same losses, mismatch and weights, bit for bit (one update per step, so the two old log-probs are one)."""
    runs = []
    for fold in (True, False):
        trainer = loop.Trainer(small_cfg(ckpts, tmp_path / str(fold), micro_batch_tokens=64, fold_logprob=fold))
        metrics = [trainer.step(s) for s in range(2)]
        runs.append((metrics, trainer.policy.state_dict()))
    (m_fold, s_fold), (m_sep, s_sep) = runs
    keys = ["loss", "logprob_mismatch", "reward_mean", "drafter_loss", "grad_norm"]
    assert [[m[k] for k in keys] for m in m_fold] == [[m[k] for k in keys] for m in m_sep]
    for part in ("model", "drafter"):
        assert all(torch.equal(s_fold[part][k], s_sep[part][k]) for k in s_fold[part]), part


def test_bad_input(ckpts, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        GRPOSection(group_size=1)
    with pytest.raises(ValueError, match="drafter_train.drafts must be >= 1"):
        DrafterTrainSection(drafts=0)
    cfg = small_cfg(ckpts, tmp_path / "a")
    cfg.run.dataset_size = 0
    with pytest.raises(ValueError, match="dataset is empty"):
        loop.train(cfg)
    cfg = small_cfg(ckpts, tmp_path / "b")
    cfg.model.policy = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="policy checkpoint"):
        loop.train(cfg)
    cfg = small_cfg(ckpts, tmp_path / "c")
    cfg.model.drafter = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="needs a drafter checkpoint"):
        loop.train(cfg)
    with pytest.raises(ValueError, match="drafter_train.updates must be >= 1"):
        DrafterTrainSection(updates=0)
    with pytest.raises(ValueError, match="drafter_train.replay must be >= 1"):
        DrafterTrainSection(replay=0)
    with pytest.raises(ValueError, match=r"drafter_train.ema is a decay in \[0, 1\)"):
        DrafterTrainSection(ema=1.0)
    for field, value in (("updates", 4), ("replay", 4), ("minibatches", 4), ("ema", 0.9)):
        cfg = small_cfg(ckpts, tmp_path / "e")
        cfg.backend.trainer = "megatron"
        setattr(cfg.drafter_train, field, value)
        with pytest.raises(ValueError, match="updates, replay and\n?.*minibatches > 1 and ema > 0 are the embedded"):
            loop.train(cfg)
        assert not (tmp_path / "e").exists()  # refused before anything is written
    cfg = small_cfg(ckpts, tmp_path / "e")  # an MTP head (the small config's) trains its first draft only
    cfg.backend.trainer, cfg.drafter_train.drafts = "megatron", 3
    with pytest.raises(ValueError, match="drafter_train.drafts > 1 unrolls an EAGLE-3 head"):
        loop.train(cfg)
    for name, change, message in (
            ("g", lambda c: setattr(c.backend, "trainer", "megatron"), "use it with backend.trainer=embedded"),
            ("h", lambda c: setattr(c.grpo, "drop_uniform_groups", False), "it leaves none out")):
        cfg = small_cfg(ckpts, tmp_path / name)
        cfg.drafter_train.extra_groups = 2
        change(cfg)
        with pytest.raises(ValueError, match=message):
            loop.train(cfg)
        assert not (tmp_path / name).exists()

    cfg = small_cfg(ckpts, tmp_path / "f")
    cfg.model.terms_weights = (1.0,) * 20  # the policy learned far fewer chain lengths than 20
    with pytest.raises(ValueError, match=r"terms_weights needs \d+ non-negative weights .*model.terms_weights"):
        loop.train(cfg)
    assert not (tmp_path / "f").exists()

    def broken(text, answer):
        raise KeyError("boom")

    monkeypatch.setattr("megatron_spec.rl.task.reward", broken)
    with pytest.raises(RuntimeError, match="reward function failed on completion"):
        loop.train(small_cfg(ckpts, tmp_path / "d"))


def test_terms_weights_set_the_chain_lengths_the_loop_trains_and_evaluates_on(ckpts, tmp_path):
    """All weight on the longest chain the policy learned: every train and held-out problem has that many terms
    (uniform draws give the shortest length about a third of the time, so 60 problems would show one)."""
    from megatron_spec.rl.task import trained_difficulty

    trained = trained_difficulty(str(ckpts / "policy"))
    lengths = trained.max_terms - trained.min_terms + 1
    cfg = small_cfg(ckpts, tmp_path)
    cfg.model.terms_weights = (0.0,) * (lengths - 1) + (1.0,)
    trainer = loop.Trainer(cfg)
    for task in (trainer.task, trainer.eval_task):
        terms = {len(re.findall(r"\d+", p.prompt)) for p in task.problems(0, 60)}
        assert terms == {trained.max_terms}, terms


def test_nan_loss_skips_updates_then_stops_and_keeps_checkpoint(ckpts, tmp_path, shaped_reward, monkeypatch):
    cfg = small_cfg(ckpts, tmp_path)
    cfg.run.steps, cfg.run.save_every = 2, 1
    loop.train(cfg)
    saved = (tmp_path / "checkpoints" / "latest").read_text()
    before = torch.load(tmp_path / "checkpoints" / saved / "state.pt", weights_only=False)["state"]["model"]
    import megatron_spec.trainers.embedded as policy_mod

    monkeypatch.setattr(policy_mod, "policy_loss", lambda *a, **k: (torch.tensor(float("nan"), requires_grad=True), {"clip_frac": 0.0}))
    cfg.run.steps = 10
    with pytest.raises(RuntimeError, match="3 consecutive steps with a non-finite loss"):
        loop.train(cfg)
    metrics = read_metrics(tmp_path)
    assert [m["skipped"] for m in metrics] == [False, False, True, True, True]
    latest = (tmp_path / "checkpoints" / "latest").read_text()
    after = torch.load(tmp_path / "checkpoints" / latest / "state.pt", weights_only=False)["state"]["model"]
    assert all(torch.equal(before[k], after[k]) for k in before)  # skipped updates never touched the weights


def test_resume_with_different_config_is_refused(ckpts, tmp_path, shaped_reward):
    cfg = small_cfg(ckpts, tmp_path)
    cfg.run.steps = 2
    loop.train(cfg)
    cfg.grpo.lr = 1e-2
    with pytest.raises(ValueError, match="different config.*grpo.lr"):
        loop.train(cfg)
    assert (tmp_path / "checkpoints" / "latest").is_file()


def test_a_checkpoint_older_than_a_field_resumes_at_its_default():
    """A checkpoint saved before `drafter_train.replay` existed has no such key: it resumes with replay 1 (how it
    ran) and is refused with replay 8, naming the field."""
    from megatron_spec.rl import checkpoint

    cfg = RLConfig()
    saved = {k: v for k, v in checkpoint.flatten(cfg).items() if k != "drafter_train.replay"}
    checkpoint.check_same_config(saved, cfg, "run")
    cfg.drafter_train.replay = 8
    with pytest.raises(ValueError, match="drafter_train.replay: saved 1, now 8"):
        checkpoint.check_same_config(saved, cfg, "run")


def test_fresh_run_in_a_used_directory_sets_the_earlier_run_aside(ckpts, tmp_path, shaped_reward):
    """`run.resume=false` into a directory that holds a 4-step run, then a 2-step run there: the directory holds
    only the new run (2 metrics records, its own checkpoints, none of the old run's later steps that a reader would
    take as the new run's), and the earlier run is in previous/1 byte for byte. A third start goes to previous/2."""
    cfg = small_cfg(ckpts, tmp_path)
    cfg.run.steps = 4
    loop.train(cfg)
    old_metrics = (tmp_path / "metrics.jsonl").read_bytes()
    old_ckpt = (tmp_path / "checkpoints/step_000003/state.pt").read_bytes()
    cfg.run.steps, cfg.run.resume = 2, False
    loop.train(cfg)
    assert [m["step"] for m in read_metrics(tmp_path)] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert (tmp_path / "previous/1/metrics.jsonl").read_bytes() == old_metrics
    assert (tmp_path / "previous/1/checkpoints/step_000003/state.pt").read_bytes() == old_ckpt
    loop.train(cfg)
    assert sorted(p.name for p in (tmp_path / "previous").iterdir()) == ["1", "2"]
    assert [m["step"] for m in read_metrics(tmp_path / "previous/2")] == [0, 1]


def test_grpo_learns_the_rewarded_behaviour(ckpts, tmp_path, monkeypatch):
    """Reward = share of completion tokens equal to 20 (a random model emits it ~1/64 of the time). Ten GRPO steps
    at lr 3e-3 must raise the sampled share of token 20 at least three-fold: the loss's sign, the advantage
    alignment with rollouts and the logprob/mask alignment all have to be right for that."""
    monkeypatch.setattr(PromptTask, "reward", lambda self, ids, problem: ids.count(20) / max(len(ids), 1))
    cfg = small_cfg(ckpts, tmp_path, spec=None, prompts_per_step=4, group_size=6, max_tokens=16)
    cfg.run.steps = 10
    loop.train(cfg)
    rewards = [m["reward_mean"] for m in read_metrics(tmp_path)]
    assert sum(rewards[-2:]) > 3 * sum(rewards[:2]) + 0.02


def test_every_run_leaves_its_report(ckpts, tmp_path, shaped_reward, monkeypatch):
    """The run writes report.html with its plots when it ends, also when it stops on an error (whose own exception
    still reaches the caller); the report names each step's figures (it is built from metrics.jsonl)."""
    cfg = small_cfg(ckpts, tmp_path / "ok")
    cfg.run.report, cfg.run.steps = True, 2
    loop.train(cfg)
    page = (tmp_path / "ok" / "report.html").read_text()
    assert 'src="report_plots/reward_accuracy.png"' in page and 'src="report_plots/acceptance.png"' in page
    assert {p.name for p in (tmp_path / "ok" / "report_plots").iterdir()} >= {"reward_accuracy.png", "stage_times.png",
                                                                              "acceptance.png"}
    import megatron_spec.trainers.embedded as policy_mod

    def boom(*a, **k):
        raise RuntimeError("trainer died")

    bad = small_cfg(ckpts, tmp_path / "bad")
    bad.run.report, bad.run.steps = True, 3
    calls = {"n": 0}
    real = policy_mod.EmbeddedPolicy.train_step

    def second_fails(self, batch):
        calls["n"] += 1
        return boom() if calls["n"] == 2 else real(self, batch)

    monkeypatch.setattr(policy_mod.EmbeddedPolicy, "train_step", second_fails)
    with pytest.raises(RuntimeError, match="trainer died"):
        loop.train(bad)
    assert "report_plots/reward_accuracy.png" in (tmp_path / "bad" / "report.html").read_text()


def test_report_without_matplotlib_is_a_table_and_a_hint(ckpts, tmp_path, shaped_reward, monkeypatch):
    """A trimmed install without matplotlib still gets a report: the summary table and a one-line hint."""
    cfg = small_cfg(ckpts, tmp_path)
    cfg.run.steps = 1
    loop.train(cfg)
    import megatron_spec.rl.report as report_mod

    monkeypatch.setattr(report_mod, "have_matplotlib", lambda: False)
    page = report_mod.write_report([tmp_path], tmp_path / "r.html").read_text()
    assert "Plots need matplotlib" in page and "<table" in page and "<img" not in page
    assert not (tmp_path / "r_plots").exists()


def test_the_policy_is_evaluated_as_loaded_before_the_first_update(ckpts, tmp_path, shaped_reward):
    """`eval_accuracy_before` (logged with step 0) is the greedy held-out accuracy of the checkpoint itself: a
    Trainer built on it and never stepped gives the same number, while step 0's own eval (after an update at lr
    3e-3) differs. A resumed run does not log it again."""
    cfg = small_cfg(ckpts, tmp_path / "run")
    cfg.run.eval_every, cfg.run.eval_prompts, cfg.run.steps = 1, 32, 2
    loop.train(cfg)
    rows = read_metrics(tmp_path / "run")
    torch.manual_seed(cfg.run.seed)
    untrained = loop.Trainer(cfg)
    try:
        expected = untrained.evaluate()
    finally:
        untrained.close()
    assert rows[0]["eval_accuracy_before"] == expected
    assert rows[0]["eval_accuracy"] != expected
    cfg.run.steps = 3
    loop.train(cfg)
    assert "eval_accuracy_before" not in read_metrics(tmp_path / "run")[2]
