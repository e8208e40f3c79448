"""Speculation counted over the whole RL step: the whole-step gate's decisions from given costs, the whole-step and
gen-stage ratios from given stage times, and a gated plain step that is exactly a `spec=null` step."""

import pytest
import torch

from megatron_spec.rl import loop
from megatron_spec.rl.report import stage_ratios
from megatron_spec.speculative.adaptive import GATE_FIRST, GATE_MAX, WholeStepGate
from megatron_spec.drafters.config import SpecConfig

from .test_loop import ckpts, shaped_reward, small_cfg  # noqa: F401  (fixtures)


def run_gate(gate: WholeStepGate, steps: int, spec_cost, plain_cost, drafter_cost=0.0) -> str:
    """The modes the gate picks over `steps` RL steps of 100 tokens each ('s' speculative, 'p' plain), with each
    mode's gen seconds given per step by `spec_cost(i)` / `plain_cost(i)`."""
    modes = ""
    for i in range(steps):
        on = gate.speculate()
        gen = spec_cost(i) if on else plain_cost(i)
        gate.record(on, gen, drafter_cost if on else 0.0, 100)
        modes += "s" if on else "p"
    return modes


def test_gate_turns_speculation_off_where_the_drafters_training_eats_the_gain():
    """The gen stage 1.25x faster with speculation (0.8 s against 1.0 s), but the drafter's training costs 0.5 s: per
    token 0.013 against 0.010, so after the warm-up (plain), one plain and one speculative step, every step is plain
    except one re-measure of speculation after GATE_FIRST steps and the next after twice that (the interval doubles
    while the decision holds). 50 steps: 3 speculative."""
    gate = WholeStepGate()
    modes = run_gate(gate, 50, lambda i: 0.8, lambda i: 1.0, drafter_cost=0.5)
    first = 3 + GATE_FIRST  # decided after step 2, its third step; re-measured GATE_FIRST steps after that
    second = first + 1 + 2 * GATE_FIRST
    expected = "".join("s" if i in (2, first, second) else "p" for i in range(50))
    assert modes == expected
    assert gate.decided is False and gate.state()["gate_pays"] is False
    assert gate.state()["gate_spec_cost"] == pytest.approx(0.013) and gate.state()["gate_plain_cost"] == 0.010


def test_gate_speculates_where_it_pays_and_backs_off_at_the_margin():
    """With the drafter's training at 0.1 s the same gen gain pays (0.009 < 0.010 / 1.02): every step speculates but
    the warm-up, the first plain measurement and the re-measure of plain decoding GATE_FIRST steps after deciding. At 0.195 s the speculative step
    costs 0.00995, within the 2 % margin of plain decoding's 0.010: the gate runs plain."""
    modes = run_gate(WholeStepGate(), 40, lambda i: 0.8, lambda i: 1.0, drafter_cost=0.1)
    assert modes == "pp" + "".join("p" if i == 3 + GATE_FIRST else "s" for i in range(2, 40))
    modes = run_gate(WholeStepGate(), 20, lambda i: 0.8, lambda i: 1.0, drafter_cost=0.195)
    assert modes == "pps" + "p" * GATE_FIRST + "s" + "p" * (16 - GATE_FIRST)


def test_gate_follows_a_change_and_the_interval_stays_bounded():
    """Speculation costs more until step 20, less afterwards (the drafter's training got cheaper, say): the first
    re-measure after the change switches the gate to speculation for good. The interval never exceeds GATE_MAX."""
    gate = WholeStepGate()
    modes = run_gate(gate, 200, lambda i: 2.0 if i < 20 else 0.5, lambda i: 1.0)
    assert gate.decided is True
    assert modes[-50:] == "s" * 50 or modes[-50:].count("p") <= 50 // GATE_MAX + 1
    assert gate.interval <= GATE_MAX


def test_the_drafters_training_gets_what_generation_saved():
    """Plain decoding at 0.010 s a token: a speculative gen stage of 0.95 s for 100 tokens leaves the drafter's
    training 0.010 / 1.02 * 100 - 0.95 = 0.030 s before the step stops paying; at 0.99 s (within the 2 % margin) it
    leaves nothing and the training is skipped. Before any plain step is priced the training runs unbounded. Once a
    training was measured at 0.5 s (0.005 a token), a step must save more than that to train again, and a step that
    skipped the training is priced with that cost."""
    gate = WholeStepGate(warmup=0)
    assert gate.drafter_budget(0.99, 100) is None
    gate.record(False, 1.0, 0.0, 100)
    assert gate.drafter_budget(0.99, 100) == 0.0
    assert gate.drafter_budget(0.95, 100) == pytest.approx(1.0 / 1.02 - 0.95)
    gate.record(True, 0.8, 0.5, 100)
    assert gate.drafter_cost == 0.005 and gate.drafter_budget(0.8, 100) == 0.0
    assert gate.drafter_budget(0.4, 100) == pytest.approx(1.0 / 1.02 - 0.4)
    gate.record(True, 0.8, 0.0, 100)
    assert gate.costs[True][-1] == pytest.approx(0.013)


def test_a_training_cut_at_its_budget_prices_speculation_as_not_paying():
    """A speculative step of 0.95 s against a plain 1.0 s gets a budget of 1.0 / 1.02 - 0.95 = 0.0304 s; cut just past
    it (0.0314 s, the lower bound it reports) it costs 0.009814 a token, 1.02 times which is 0.01001, not below plain
    decoding's 0.010: the gate decides against speculation, and a step saving no more than that skips the
    training, while one saving far more (0.5 s of generation) trains again."""
    gate = WholeStepGate(warmup=0)
    gate.record(False, 1.0, 0.0, 100)
    budget = gate.drafter_budget(0.95, 100)
    gate.record(True, 0.95, budget + 0.001, 100)
    assert gate.decided is False and gate.cost(True) * gate.margin >= gate.cost(False)
    assert gate.drafter_budget(0.95, 100) == 0.0 and gate.drafter_budget(0.5, 100) > 0


def test_with_generation_beside_the_trainer_a_step_costs_its_longer_side():
    """With an async lag (`beside_s`: the trainer's side of the step) a mode costs max(generation, trainer side +
    drafter training) per token. Generation-bound (plain 1.0 s, speculative 0.6 s + 0.2 s of drafter training beside
    a 0.3 s trainer side): 0.006 against 0.010, speculation pays. Trainer-bound (the trainer side 1.2 s): plain costs
    0.012 and speculation 0.014, as its generation saving hides behind the trainer while its drafter training adds
    to it: speculation does not pay, where the serial sum (0.008 against 0.010) would have said it does."""
    gen_bound = WholeStepGate(warmup=0)
    gen_bound.record(False, 1.0, 0.0, 100, beside_s=0.3)
    gen_bound.record(True, 0.6, 0.2, 100, beside_s=0.3)
    assert list(gen_bound.costs[False]) == pytest.approx([0.010])
    assert list(gen_bound.costs[True]) == pytest.approx([0.006])
    assert gen_bound.decided is True
    trainer_bound = WholeStepGate(warmup=0)
    trainer_bound.record(False, 1.0, 0.0, 100, beside_s=1.2)
    trainer_bound.record(True, 0.6, 0.2, 100, beside_s=1.2)
    assert list(trainer_bound.costs[False]) == pytest.approx([0.012])
    assert list(trainer_bound.costs[True]) == pytest.approx([0.014])
    assert trainer_bound.decided is False
    serial = WholeStepGate(warmup=0)
    serial.record(False, 1.0, 0.0, 100)
    serial.record(True, 0.6, 0.2, 100)
    assert serial.decided is True


def test_a_load_spike_on_a_plain_step_does_not_turn_speculation_on():
    """Speculation costs 1.5x plain decoding; plain step 3 ran 8x slower (another job's load). Priced by the least
    cost of its window, plain decoding keeps its own price and the gate stays plain until its re-measure of
    speculation; a median of the two plain steps then measured (4.5) would have switched to speculation at step 4."""
    modes = run_gate(WholeStepGate(), 3 + GATE_FIRST, lambda i: 1.5, lambda i: 8.0 if i == 3 else 1.0)
    assert modes == "pps" + "p" * GATE_FIRST


def test_gate_state_restores_its_decisions_exactly():
    """A gate saved after 20 steps of the schedule where speculation stops paying at step 20 (state through a
    torch.save round trip, as a checkpoint holds it) and restored into a new gate picks, for the next 60 steps, the
    very modes the uninterrupted gate picks, and ends in the same state; a new gate left unrestored picks others
    (its warm-up and first measurements)."""
    import io

    def spec_cost(i):
        return 0.5 if i < 20 else 2.0

    whole = WholeStepGate()
    run_gate(whole, 20, spec_cost, lambda i: 1.0)
    buf = io.BytesIO()
    torch.save(whole.state_dict(), buf)
    restored, fresh = WholeStepGate(), WholeStepGate()
    buf.seek(0)
    restored.load_state_dict(torch.load(buf, weights_only=False))
    later = [lambda i, f=f: f(i + 20) for f in (spec_cost, lambda i: 1.0)]
    expected = run_gate(whole, 60, *later)
    assert run_gate(restored, 60, *later) == expected
    assert restored.state_dict() == whole.state_dict()
    assert run_gate(fresh, 60, *later) != expected


def test_a_resumed_run_continues_its_gate(ckpts, tmp_path, shaped_reward):  # noqa: F811
    """The checkpoint holds the gate: a gated run of 3 steps (warm-up, plain, speculative) saved at its last step,
    resumed for a fourth, starts that step with the saved gate (2 steps priced, one cost per mode) and ends it with
    3 priced; a gate not restored would spend step 3 on its warm-up (0 priced)."""
    from megatron_spec.rl import checkpoint

    cfg = small_cfg(ckpts, tmp_path / "run")
    cfg.spec = SpecConfig("mtp", 3, adaptive=True)
    loop.train(cfg)
    saved = checkpoint.load_latest(tmp_path / "run")["gate"]
    assert saved["steps"] == 2 and saved["warmup"] == 0 and [len(saved["costs"][m]) for m in (False, True)] == [1, 1]
    seen = []

    class Seen(loop.Trainer):
        def step(self, step):
            seen.append(self.gate.state_dict())
            return super().step(step)

    cfg.run.steps = 4
    loop.run(cfg, Seen)
    assert seen[0] == saved and len(seen) == 1
    assert checkpoint.load_latest(tmp_path / "run")["gate"]["steps"] == 3


def test_gate_refuses_a_step_without_tokens():
    gate = WholeStepGate(warmup=0)
    with pytest.raises(ValueError, match="0 tokens"):
        gate.record(True, 1.0, 0.0, 0)


def test_stage_ratios_from_given_stage_times():
    """Two steps: plain gen 3 + 3, other stages 1 + 1 (whole 8); spec gen 2 + 2, train 2 + 3 incl. the drafter's
    1 + 2 s (whole 9). Gen stage 6 / 4 = 1.5x, whole step 8 / 9, plain gen share 6 / 8; the second spec step ran
    plainly (gated)."""
    plain = [{"step": 0, "stages": {"gen": 3.0, "train": 1.0}}, {"step": 1, "stages": {"gen": 3.0, "train": 1.0}}]
    spec = [{"step": 0, "stages": {"gen": 2.0, "train": 2.0}, "drafter_s": 1.0, "speculate": True},
            {"step": 1, "stages": {"gen": 2.0, "train": 3.0}, "drafter_s": 2.0, "speculate": False}]
    r = stage_ratios(plain, spec)
    assert r["gen_ratio"] == 1.5 and r["step_ratio"] == pytest.approx(8 / 9) and r["plain_gen_share"] == 0.75
    assert r["drafter_s"] == 3.0 and r["plain_steps_gated"] == 1 and r["steps"] == 2
    with pytest.raises(ValueError, match="no step"):
        stage_ratios(plain, [{"step": 5, "stages": {"gen": 1.0}}])


def test_a_gated_plain_step_is_a_spec_null_step(ckpts, tmp_path, shaped_reward):  # noqa: F811
    """The gate's warm-up step runs plainly: the same rollouts (tokens and behaviour log-probs) and loss as the
    `spec=null` run of the seed, no drafting, and no drafter training or agreement (no `drafter_s`); the next step
    is plain too (it prices plain decoding), the third speculates (acceptance measured) and trains the drafter."""
    gated = small_cfg(ckpts, tmp_path / "gated")
    gated.spec = SpecConfig("mtp", 3, adaptive=True)
    plain = small_cfg(ckpts, tmp_path / "plain", spec=None)
    torch.manual_seed(0)
    a = loop.Trainer(gated)
    assert a.gate is not None
    torch.manual_seed(0)
    b = loop.Trainer(plain)
    assert b.gate is None
    ma, mb = a.step(0), b.step(0)
    assert ma["speculate"] is False and ma["acceptance_length"] is None and "drafter_s" not in ma
    assert ma["gen_tokens"] == mb["gen_tokens"] and ma["loss"] == mb["loss"] and ma["reward_mean"] == mb["reward_mean"]
    assert a.generator.engine.controller is not None  # the configured engine is back after the plain step
    a.gate.margin = 1e-9  # whatever the speculative gen stage costs here, let its drafter train
    assert a.step(1)["speculate"] is False  # the plain step the gate prices plain decoding by
    m2 = a.step(2)
    assert m2["speculate"] is True and m2["acceptance_length"] is not None and m2["drafter_s"] > 0


def test_report_shows_the_whole_step_beside_the_gen_stage_and_what_the_gate_did(tmp_path):
    """A spec run whose gen stage is 2x its plain pair's (5 s against 10 s of 15.6 s) but whose train stage is 8 s
    longer (the drafter's training): whole step 15.6 / 18.6, plain gen share 10 / 15.6; its gate ran every step
    plainly but one, whose drafter training it cut at its budget, and said speculation did not pay, which the page
    states with the counts."""
    import json

    from megatron_spec.rl import report

    from .test_report import STEPS, write_run

    plain = write_run(tmp_path / "plain", spec=False, seed=0, reward=0.5)
    spec = write_run(tmp_path / "spec", spec=True, seed=0, reward=0.5, gen_s=5.0)
    rows = [json.loads(line) for line in (spec / "metrics.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        r["stages"]["train"] += 8.0
        r.update(drafter_s=8.0, speculate=i == 1, gate_pays=False, gate_spec_cost=0.013, gate_plain_cost=0.010,
                 drafter_cut=i == 1)
    (spec / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pair = report.whole_step_pairs(report.load_runs([plain, spec]))[0]
    assert pair["gen_ratio"] == 2.0 and pair["step_ratio"] == pytest.approx(15.6 / 18.6)
    assert pair["plain_gen_share"] == pytest.approx(10 / 15.6) and pair["plain_steps_gated"] == STEPS - 1
    page = report.write_report([spec, plain], tmp_path / "r.html").read_text()
    section = page.split("<h2>Whole step</h2>")[1].split("<h2>")[0]
    assert "<td>0.641</td><td>2.000</td><td>0.839</td>" in section
    assert f"so the gate ran {STEPS - 1} of {STEPS} steps plainly" in section
    assert "; 1 of its 1 speculative steps stopped the drafter's training once it had taken what" in section
    # each run's gen share over the steps it ran plainly: all of the plain run's, all but one of the gated run's
    assert f"<td>plain</td><td>{STEPS}</td><td>0.641</td>" in section
    assert f"<td>spec</td><td>{STEPS - 1}</td>" in section
    alone = report.write_report([plain], tmp_path / "alone.html").read_text()
    assert f"<td>plain</td><td>{STEPS}</td><td>0.641</td>" in alone.split("<h2>Whole step</h2>")[1]
