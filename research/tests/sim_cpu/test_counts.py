"""The shape the CPU model assumes of our code's operator counts, checked exactly on the code itself.

`research/sim_cpu/counts.py` takes every operator count from a census of the real engine and trainer, fitting
each to two censuses: a step's drafting as fixed + k x per draft forward (+ sequences x per sequence), a
trainer pass as fixed + n x per micro-batch (each micro-batch after the first cropped to its shorter longest row),
the logprob stage's batch assembly as fixed + rows x per rollout. So no count is hand-kept and an engine change
moves the prediction rather than breaking a test. What can break is the shape: these tests predict a third census
from the two-point fit and require it exactly (operator counts are integers; no tolerance), on Qwen3 (QK-norm) and
Llama (no QK-norm, tied embeddings) layer stacks. One more micro-batch, draft or rollout must cost what the fit
says, to the operator.
"""

import dataclasses

import pytest

from research.sim_cpu import counts, op_census
from research.sim_cpu.counts import Affine
from megatron_spec.models import preset

QWEN3 = preset("tiny-qwen3")
LLAMA = op_census.with_layers(dataclasses.replace(QWEN3, model_type="llama", qk_norm=False,
                                                  tie_word_embeddings=True), 3)


@pytest.mark.parametrize("cfg", [QWEN3, LLAMA], ids=["qwen3", "llama"])
@pytest.mark.parametrize("fold, shared, drafter", [(False, False, None), (True, True, None), (True, True, "mtp")],
                         ids=["separate", "folded-shared", "online-mtp"])
def test_trainer_counts_are_affine_in_micro_batches(cfg, fold, shared, drafter):
    """Three micro-batches of two rows (used lengths 16, 14, 12: each one after the first cropped, as sorted
    long-tailed batches are) launch what the fit through one and two micro-batches predicts. As in the two-batch
    census, each micro-batch holds rows of two different prompts (rows 2i and 2i+1 share one): with shared prompts
    a micro-batch's count depends on how many prompt groups it gathers, which the fit takes as it finds it. Six
    rows hold three prompts, one more than the fit's censuses: the per-group term (the prefix pass's work per
    distinct prompt, counted on a third census) must account for it exactly."""
    three = op_census.trainer_pass(cfg, batch=6, budget=32, fold=fold, shared=shared,
                                   drafter=counts.METHOD.get(drafter), ends=[16, 14, 16, 12, 14, 12])
    assert three.micro_batches == 3
    groups = 3  # six rows, prompts shared in pairs (when shared)
    assert three.train == counts.train_ops(cfg, 3, fold, shared, drafter, groups=groups)
    if not fold:
        assert three.logprob == counts.logprob_ops(cfg, 3, shared, groups=groups)
    c = counts._trainer(counts._key(cfg), fold, shared, drafter)
    assert (c.train_group > 0) == shared


@pytest.mark.parametrize("kind", ["mtp", "eagle3", "model"])
def test_drafting_counts_are_affine_in_k(kind):
    """A verify step at k=4 drafts what the fit through k=2 and k=3 predicts; the target forward and the
    verification do not depend on k, and the target forward not on the batch (8 or 16 sequences)."""
    c = counts.engine(QWEN3, kind)
    four = op_census.engine_step(QWEN3, counts.BATCH, counts.METHOD[kind], 4)
    assert four.propose == c.draft_step + 4 * (c.draft_forward + counts.BATCH * c.draft_seq)
    assert (four.forward, four.sample) == (c.forward, c.sample)
    assert op_census.engine_step(QWEN3, 2 * counts.BATCH).forward == c.forward
    assert (c.draft_seq > 0) == (kind == "model")


def test_batch_assembly_is_affine_in_rollouts():
    assert op_census.batch_assembly(24) == counts.batch_ops(24)
    assert counts._assembly().per > 0


def test_affine_fit_and_refusals():
    assert Affine.through(1, 10, 3, 16)(5) == 22
    moe = preset("tiny-qwen3-moe")
    with pytest.raises(ValueError, match="dense models only"):
        counts.engine(moe)
