"""The operator counts of `benchmarks/sim_cpu/eager.py` against a recount on the real engine and trainer.

`eager.py` states how many operators a forward, a verify step, a draft step, a training pass and an optimizer step
of our code launch; the CPU profile pays a measured cost for each. Those counts are facts of the code, so this test
recounts them (`op_census`, a dispatch-mode counter: deterministic, no timing) on random-weight models and fails
when the code and the table drift apart by more than 3 % (a 64-op accept path that grew by two ops passes; one more
RMSNorm per layer, +9 %, does not). Counted at batch 8, as the table is. Two depths and two families (Qwen3 with
QK-norm, Llama without) pin down the per-layer, per-norm and fixed parts separately.
"""

import dataclasses

import pytest

from megatron_spec.models import preset
from benchmarks.sim_cpu import eager, op_census
from benchmarks.sim_cpu.model import draft_shape as drafter_shape
from benchmarks.sim_cpu.model import target_shape as shape_of

TOL = 0.03
BATCH = 8
QWEN3 = preset("tiny-qwen3")
LLAMA = dataclasses.replace(QWEN3, model_type="llama", qk_norm=False, tie_word_embeddings=True)


def close(counted: float, modelled: float) -> bool:
    return abs(modelled - counted) <= TOL * counted


@pytest.mark.parametrize("cfg", [op_census.with_layers(QWEN3, 2), QWEN3, op_census.with_layers(LLAMA, 3)],
                         ids=["qwen3-2", "qwen3-4", "llama-3"])
def test_engine_step_counts(cfg):
    plain = op_census.engine_step(cfg, BATCH)
    assert close(plain.forward, shape_of(cfg).ops), plain
    assert close(plain.sample, eager.SAMPLE_PLAIN), plain
    k = 3
    for kind, method in (("mtp", "mtp"), ("eagle3", "eagle3")):
        spec = op_census.engine_step(cfg, BATCH, method, k)
        draft = drafter_shape(cfg, kind)
        assert close(spec.forward, plain.forward), (kind, spec)
        # The feature write of the previous verify step happens in `propose`, right before the drafts that read it.
        assert close(spec.propose, k * draft.ops + draft.step_ops), (kind, spec, draft.ops)
        assert close(spec.sample, eager.SAMPLE), (kind, spec)


def test_draft_model_counts():
    spec = op_census.engine_step(QWEN3, BATCH, "draft_model", 3)
    draft = dataclasses.replace(preset("tiny-draft"), vocab_size=QWEN3.vocab_size)
    ops = eager.DRAFTER["model"]
    assert close(spec.propose, 3 * (eager.forward_ops(draft) + ops.per_forward + BATCH * ops.per_seq)), spec


@pytest.mark.parametrize("cfg", [op_census.with_layers(QWEN3, 2), QWEN3, op_census.with_layers(LLAMA, 3)],
                         ids=["qwen3-2", "qwen3-4", "llama-3"])
def test_trainer_counts(cfg):
    """Both passes over one micro-batch (budget 0, separate recompute) and over two (a budget of two 16-token rows,
    recompute folded into the train forward). The totals pin the per-step parts, the differences between the two
    counts the per-micro-batch parts (one more micro-batch, cropped), each to 3 %."""
    one = op_census.trainer_pass(cfg, tokens=16, budget=0, fold=False)
    two = op_census.trainer_pass(cfg, tokens=16, budget=32, fold=True)
    assert (one.micro_batches, two.micro_batches) == (1, 2)
    assert one.param_tensors == eager.param_tensors(cfg)
    assert close(one.logprob, eager.logprob_ops(cfg, 1)), one
    assert close(two.logprob, eager.logprob_ops(cfg, 2)), two
    assert close(two.logprob - one.logprob, eager.logprob_ops(cfg, 2) - eager.logprob_ops(cfg, 1)), (one, two)
    assert close(one.train, eager.train_ops(cfg, 1, fold=False)), one
    assert close(two.train, eager.train_ops(cfg, 2, fold=True)), two
    assert close(two.train - one.train, eager.train_ops(cfg, 2, fold=True) - eager.train_ops(cfg, 1)), (one, two)
    assert close(one.optimizer, eager.OPT_FIXED + eager.OPT_PER_TENSOR * one.param_tensors), one


@pytest.mark.parametrize("cfg", [op_census.with_layers(QWEN3, 2), QWEN3, op_census.with_layers(LLAMA, 3)],
                         ids=["qwen3-2", "qwen3-4", "llama-3"])
def test_shared_prompt_trainer_counts(cfg):
    """The same two passes with the rows' prompts shared in pairs (a prefix pass, then suffix passes): totals to
    3 %, and the operators sharing adds (shared minus unshared on the same layout) to 3 % as well, so the prefix and
    suffix terms are pinned on their own and not hidden inside the much larger unshared count."""
    for budget, fold, n in ((0, False, 1), (32, True, 2)):
        plain = op_census.trainer_pass(cfg, tokens=16, budget=budget, fold=fold, shared=False)
        shared = op_census.trainer_pass(cfg, tokens=16, budget=budget, fold=fold, shared=True)
        assert shared.micro_batches == n
        assert close(shared.logprob, eager.logprob_ops(cfg, n, shared=True)), shared
        assert close(shared.train, eager.train_ops(cfg, n, fold=fold, shared=True)), shared
        assert close(shared.logprob - plain.logprob, eager.logprob_ops(cfg, n, shared=True) - eager.logprob_ops(cfg, n))
        assert close(shared.train - plain.train,
                     eager.train_ops(cfg, n, fold=fold, shared=True) - eager.train_ops(cfg, n, fold=fold))


@pytest.mark.parametrize("cfg", [QWEN3, op_census.with_layers(LLAMA, 3)], ids=["qwen3-4", "llama-3"])
@pytest.mark.parametrize("drafter", ["mtp", "eagle3", "draft_model"])
def test_online_drafter_update_counts(cfg, drafter):
    """The operators an online drafter update adds to a train step (shared prompts, folded recompute), over one
    micro-batch and two, against the same step without it: per step and per micro-batch, to 3 %."""
    kind = "model" if drafter == "draft_model" else drafter
    for budget, n in ((0, 1), (32, 2)):
        plain = op_census.trainer_pass(cfg, budget=budget, fold=True, shared=True)
        online = op_census.trainer_pass(cfg, budget=budget, fold=True, shared=True, drafter=drafter)
        modelled = (eager.train_ops(cfg, n, fold=True, shared=True, drafter=kind)
                    - eager.train_ops(cfg, n, fold=True, shared=True))
        assert close(online.train - plain.train, modelled), (budget, online.train - plain.train, modelled)


def test_logprob_stage_bookkeeping_counts():
    """What the logprob stage does besides the recompute (batch assembly, mismatch metric): per rollout and fixed."""
    eight, sixteen = op_census.batch_assembly(8), op_census.batch_assembly(16)
    assert close(eight, eager.batch_ops(8)), eight
    assert close(sixteen - eight, eager.batch_ops(16) - eager.batch_ops(8)), (eight, sixteen)


@pytest.mark.parametrize("cfg", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_activation_elements(cfg):
    """The elementwise traffic the CPU trainer model charges per token per layer, against a recount (5 %)."""
    counted = op_census.activation_elements(cfg)
    assert abs(eager.activation_elements(cfg) / counted - 1) <= 0.05, counted
