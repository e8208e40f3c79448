"""The pipeline bubble and the MoE dispatcher's traffic in the simulator's train stage."""

from dataclasses import replace

import pytest

from megatron_spec.sim import LengthDist, SimConfig, TrainParallel, Workload
from megatron_spec.sim.bubble import bubble_factor, pipeline_train_time
from megatron_spec.sim.pipeline import build
from megatron_spec.sim.stages import model_parallel_comm_time, policy_train_time


def test_bubble_of_1f1b_interleaved_and_several_calls():
    """m + (pp - 1) slots for m micro-batches (8 on 4 stages: 11 / 8); interleaving 2 chunks halves the fill and
    drain (9.5 / 8); 8 calls of one micro-batch each pay it 8 times (8 + 24 = 32 slots: pp x the work, every
    stage idle but one)."""
    assert bubble_factor(8, 4) == 11 / 8
    assert bubble_factor(8, 4, vpp=2) == 9.5 / 8
    assert bubble_factor(8, 4, calls=8) == 4.0
    assert bubble_factor(5, 1) == 1.0
    assert pipeline_train_time(2.0, pp=2, micro_batches=4) == pytest.approx(1.0 * 5 / 4)
    with pytest.raises(ValueError, match="calls <= micro_batches"):
        bubble_factor(4, 2, calls=5)


W = Workload(prompts_per_step=64, group_size=8, prompt_len=200, response=LengthDist(mean=1500, max_tokens=8192))


def moe_cfg(gpus: int = 16, **kw) -> SimConfig:
    return SimConfig(model="qwen3-30b-a3b", hardware="h100", gpus=gpus, workload=W,
                     train=TrainParallel(**{"pp": 2, "ep": 8, "dp": gpus // 2, **kw}))


def test_dispatcher_traffic_and_interleaving_move_the_train_stage():
    """allgather moves ep / top_k = 8 / 8 of alltoall's bytes for Qwen3-30B-A3B (top-8) at EP8, so equal; at EP16
    (ep / top_k = 2) twice; interleaving (vpp 2) only shrinks the train stage."""
    cfg = moe_cfg()
    hw, cal, target, _ = build(cfg)
    a2a = model_parallel_comm_time(cfg, hw, cal, target, passes=3)
    gather = model_parallel_comm_time(replace(cfg, moe_dispatcher="allgather"), hw, cal, target, passes=3)
    assert target.top_k == 8 and a2a > 0 and gather == pytest.approx(a2a)
    wide = moe_cfg(gpus=32, ep=16)
    a2a16 = model_parallel_comm_time(wide, hw, cal, target, passes=3)
    assert model_parallel_comm_time(replace(wide, moe_dispatcher="allgather"), hw, cal, target,
                                    passes=3) == pytest.approx(2 * a2a16)
    assert policy_train_time(moe_cfg(vpp=2), hw, cal, target) < policy_train_time(cfg, hw, cal, target)


@pytest.mark.parametrize("kw, message", [(dict(vpp=2, pp=1), "needs pp > 1"), (dict(vpp=0), "vpp must be >= 1")])
def test_bad_virtual_stages_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        TrainParallel(**kw)


def test_unknown_dispatcher_is_refused():
    with pytest.raises(ValueError, match="moe_dispatcher must be alltoall or allgather"):
        SimConfig(model="qwen3-30b-a3b", hardware="h100", gpus=16, workload=W, train=TrainParallel(dp=16),
                  moe_dispatcher="flex")


def test_235b_train_stage_variants():
    """The projection's trainer on 512 H100 (44 micro-batches per DP rank, PP8): one call per step has bubble
    (44 + 7) / 44; one call per micro-batch pays pp = 8 (every stage idle but one), so its stage is longer by the
    compute times 8 / 1.159 - 1; interleaving only shortens it; allgather at EP16 with top-8 moves twice the
    dispatcher's bytes, so it only lengthens it."""
    from megatron_spec.sim.projection import projection_config
    from megatron_spec.sim.train_stage import train_stage_report, variants

    cfg = projection_config("h100", 512)
    rows = {label.split(",")[0]: (seconds, bubble) for label, seconds, bubble in variants(cfg)}
    trainer, per_micro = rows["one schedule call per step"], rows["one schedule call per micro-batch"]
    assert cfg.packed_micro_batches == 44 and trainer[1] == pytest.approx(51 / 44) and per_micro[1] == 8.0
    assert per_micro[0] > 4 * trainer[0]
    assert rows["interleaved stages"][0] < trainer[0] < rows["allgather dispatcher"][0]
    assert "TP2 PP8 EP16 DP32, 44 micro-batches" in train_stage_report("h100", 512)


def test_one_f_one_b_op_by_op():
    """Uniform costs give the slot count (m + pp - 1)(f + b): 8 micro-batches on 4 stages at f 1, b 2 take 33.
    Two stages, forwards 1 and 2, backwards 1, exchange 0.5, worked by hand: stage 0 runs F0 [0, 1], F1 [1, 3];
    stage 1 F0 [1.5, 2.5], B0 [2.5, 3.5], F1 [3.5, 5.5], B1 [5.5, 6.5]; stage 0 B0 [4, 5], B1 [7, 8]: 8.0."""
    from megatron_spec.sim.bubble import one_f_one_b, p2p_exchange_s

    assert one_f_one_b([[1.0] * 8] * 4, [[2.0] * 8] * 4) == 33.0
    assert one_f_one_b([[1.0, 2.0]] * 2, [[1.0, 1.0]] * 2, [0.5, 0.5]) == 8.0
    assert p2p_exchange_s(51200, 146e-6, 2.3e9, messages=2) == pytest.approx(2 * 146e-6 + 51200 / 2.3e9)
    with pytest.raises(ValueError, match="exchange times"):
        one_f_one_b([[1.0, 2.0]] * 2, [[1.0, 1.0]] * 2, [0.5])


RECORDS = __import__("pathlib").Path(__file__).resolve().parents[2] / "research" / "records"


def _pp2_from_pp1(pp1: dict, micro_batches: list, path: str) -> float:
    from megatron_spec.sim.bubble import cpu_pipeline_s

    return cpu_pipeline_s(pp1["schedule"], pp1["step"] - pp1["schedule"], micro_batches, hidden=128, pp=2,
                          one_call=path == "one_call")


def test_pp2_train_stage_against_the_schedule_record():
    """The tiny MoE's PP2 train step (`benchmarks/megatron_schedule.py`, `research/records/megatron_schedule.json`:
    17 micro-batches of 21-96 tokens, timed with no other job) predicted from its PP1 run: 1F1B op by op over the
    micro-batches' tokens with each gloo exchange (shape and activation, 146 us a message, 2.30 GB/s), and the
    step's time outside the schedule kept whole, is within 15 % on both paths (-9.2 % one call, -8.0 % one call per
    shape), and equals what the benchmark's own prediction recorded beside its measurement. (The same model was
    -16.5 / -13.8 % on a run at load 4-6, where the two ranks also waited for cores:
    `test_pp2_stages_are_even_and_the_gap_is_waiting`.)"""
    import json

    record = json.loads((RECORDS / "megatron_schedule.json").read_text())
    one = record["pp1"]["one_call"]
    pp1 = {"schedule": one["schedule_min_s"], "step": one["min_s"]}
    errors = {path: _pp2_from_pp1(pp1, record["pp2"]["micro_batches"], path) / record["pp2"][path]["min_s"] - 1
              for path in ("one_call", "per_shape")}
    assert all(abs(e) < 0.15 for e in errors.values()), errors
    for path, error in errors.items():
        assert error == pytest.approx(record["sim_pp2"][path]["error"], abs=1e-9), path


def test_pp2_stages_are_even_and_the_gap_is_waiting():
    """`research/records/pp_stage_busy.json` (the same PP2 run timed per rank, load 4 on 2 cores): the two stages
    are even (each rank's busy seconds within 1 % of the other's and 6 % of half the PP1 run's), which is what
    splitting each micro-batch's cost evenly over the stages assumes. The model is -14.3 % (one call) and -14.7 %
    (per shape) on that run, within 15 %; what it misses sits in the ranks' waiting: 60-67 ms inside the one-call
    schedule."""
    import json

    record = json.loads((RECORDS / "pp_stage_busy.json").read_text())
    pp1, ranks = record["pp1"]["one_call"], record["pp2_by_rank"]
    busy = [r["one_call"]["busy"] for r in ranks]
    assert abs(busy[0] / busy[1] - 1) < 0.01 and all(1.0 < b / (pp1["busy"] / 2) < 1.07 for b in busy)
    share = pp1["forward"] / pp1["busy"]
    errors = {}
    for path in ("one_call", "per_shape"):
        from megatron_spec.sim.bubble import cpu_pipeline_s

        predicted = cpu_pipeline_s(pp1["schedule"], pp1["step"] - pp1["schedule"], record["pp1"]["micro_batches"],
                                   hidden=128, pp=2, one_call=path == "one_call", forward_share=share)
        errors[path] = round(predicted / max(r[path]["step"] for r in ranks) - 1, 3)
    assert errors == {"one_call": -0.143, "per_shape": -0.147}
    assert all(0.06 <= r["one_call"]["waiting_and_p2p"] <= 0.067 for r in ranks)
