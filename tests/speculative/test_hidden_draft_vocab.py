"""EAGLE-3 with a draft vocabulary in the engine: drafts are target ids (d2t of the head's choice), sampled q is the
head's distribution scattered into the full target vocabulary, and speculation stays lossless (greedy identity,
exact logprobs, sampled completions distributed as plain decoding)."""

from types import SimpleNamespace

import pytest
import torch

from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.engine.sequence import Sequence
from megatron_spec.drafters.eagle3.model import Eagle3Head
from megatron_spec.drafters.config import SpecConfig
from megatron_spec.drafters.loss import drafter_loss, soft_cross_entropy, teacher_logits
from megatron_spec.drafters.hidden import choose_mapped
from megatron_spec.drafters.registry import drafter_method
from megatron_spec.speculative.sampling import processed_logprobs

from .hidden_reference import reference_hidden_drafts
from .test_engine_spec import PROMPTS, assert_logprobs_equal_full_forward, assert_matches_plain, incremental_drafts

V = 64  # the tiny target's vocabulary

EAGLE3_LOSS = drafter_method("eagle3").online_loss


@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model


def common_ids(target, n: int = 16) -> torch.Tensor:
    """The n ids the target generates most often from PROMPTS (greedy), so drafts are accepted at some positions
    and rejected at others, sorted as train-drafter builds them."""
    outs = LLMEngine(target).generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=30, seed=0))
    counts = torch.bincount(torch.tensor([t for o in outs for t in o.token_ids]), minlength=V)
    return counts.argsort(descending=True, stable=True)[:n].sort().values


def head_with_vocab(target, seed: int = 3, n: int = 16) -> Eagle3Head:
    torch.manual_seed(seed)
    return Eagle3Head.from_target(target, d2t=common_ids(target, n))


def test_choose_mapped_greedy_and_sampled():
    d2t = torch.tensor([1, 4, 9, 16, 25])
    logits = torch.randn(3, 5)
    seqs = [Sequence(i, [1], 4, torch.Generator().manual_seed(i)) for i in range(3)]
    greedy = SimpleNamespace(greedy=True)
    tokens, q = choose_mapped(logits, d2t, 30, greedy, seqs, sample=True)
    assert q is None and tokens.tolist() == d2t[logits.argmax(-1)].tolist()

    params = SimpleNamespace(greedy=False, temperature=0.7, top_k=3, top_p=1.0)
    tokens, q = choose_mapped(logits, d2t, 30, params, seqs, sample=True)
    assert q.shape == (3, 30)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    off_map = torch.ones(30, dtype=torch.bool)
    off_map[d2t] = False
    assert (q[:, off_map] == 0).all()
    torch.testing.assert_close(q[:, d2t], processed_logprobs(logits, 0.7, 3).exp())
    assert torch.isin(tokens, d2t).all() and (q.gather(1, tokens[:, None]) > 0).all()  # drafts have q > 0


@pytest.mark.parametrize("max_num_seqs", [4, 8])
def test_greedy_identity_with_draft_vocab(target, max_num_seqs):
    """Greedy drafts through the map emit exactly the plain engine's tokens, with sequences joining mid-flight."""
    head = head_with_vocab(target)
    params = SamplingParams(temperature=0, max_tokens=30)
    plain = LLMEngine(target, max_num_seqs=max_num_seqs).generate(PROMPTS, params)
    spec = SpecConfig("eagle3", 3)
    fast = LLMEngine(target, max_num_seqs=max_num_seqs, spec=spec, drafter=head).generate(PROMPTS, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in fast] == [o.finish_reason for o in plain]
    drafted = sum(o.spec.get("drafted", 0) for o in fast)
    assert drafted > 0 and sum(o.spec.get("accepted", 0) for o in fast) < drafted


def test_incremental_drafts_equal_drafts_from_scratch(target):
    """The proposer's cached drafting with a map equals full forwards whose next step embeds the *target* id:
    the reference sees the head's logits scattered into the target vocabulary (-inf off the map)."""
    head = head_with_vocab(target, seed=4)
    head.reset_parameters(std=0.15)

    class FullVocab:
        capture_layers, fuse = head.capture_layers, head.fuse

        def __call__(self, *args):
            state, logits = head(*args)
            full = logits.new_full((*logits.shape[:-1], V), float("-inf"))
            full[..., head.d2t] = logits
            return state, full

    engine = LLMEngine(target, spec=SpecConfig("eagle3", 3), drafter=head)
    for tokens, drafts in incremental_drafts(engine):
        assert set(drafts) <= set(head.d2t.tolist())
        assert drafts == reference_hidden_drafts(target, FullVocab(), tokens, len(drafts))[0]


@pytest.mark.parametrize("draft_sampling", [False, True])
def test_logprobs_equal_full_forward(target, draft_sampling):
    head = head_with_vocab(target)
    kw = dict(temperature=0.8, top_p=0.9)
    spec = SpecConfig("eagle3", 3, draft_sampling=draft_sampling)
    outs = LLMEngine(target, spec=spec, drafter=head).generate(PROMPTS, SamplingParams(max_tokens=20, seed=2, **kw))
    assert sum(o.spec.get("accepted", 0) for o in outs) > 0
    assert_logprobs_equal_full_forward(target, outs, kw)


def test_sampled_completions_match_plain_decoding(target):
    """2000 three-token completions of one prompt, plain vs EAGLE-3 over a 16-id draft vocabulary with sampled
    drafts (q scattered into the 64-id vocabulary enters verification): per position a two-sample chi-square test
    of the token frequencies at the 99.9 % quantile (false alarm 0.001 per assertion, fixed seeds). Tokens outside
    the map can only come from residual or bonus samples, so this checks those paths carry the off-map mass. Power
    control (`assert_matches_plain`): plain decoding at 0.75 times the temperature is rejected at each position
    (power 1 - 1e-10, 1 - 3e-6, 0.998 at positions 0, 1, 2: T = 1, 2000 a side)."""
    head = head_with_vocab(target)
    fast = assert_matches_plain(target, dict(temperature=1.0), SpecConfig("eagle3", 3, draft_sampling=True), head)
    # An untrained head over 16 ids: 170 of 2000 drafts accepted here, so both paths run often.
    assert sum(o.spec.get("accepted", 0) for o in fast) > 50
    assert sum(o.spec.get("accepted", 0) for o in fast) < sum(o.spec.get("drafted", 0) for o in fast)
    off_map = ~torch.isin(torch.arange(V), head.d2t)
    assert sum(int(off_map[o.token_ids].any()) for o in fast) > 0  # off-map tokens were emitted


def test_loss_is_renormalised_restriction_and_reaches_only_the_head(target):
    """The teacher is the target's distribution over the d2t ids, renormalised; full-vocabulary logits passed in
    (the RL step's) and the cheap restricted ones (`teacher_logits`) give the same loss; no target gradient."""
    head = head_with_vocab(target)
    ids = torch.tensor([PROMPTS[0] + [9, 10, 11, 12]])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 8:] = True
    out = target.trunk(ids, capture=head.capture_layers)
    full = target.lm_head(out.hidden)
    restricted = teacher_logits(target, head, out.hidden)
    torch.testing.assert_close(restricted, full[..., head.d2t])
    # Softmax over the restricted logits is p on the map, renormalised.
    p = full.softmax(-1)[..., head.d2t]
    torch.testing.assert_close(restricted.softmax(-1), p / p.sum(-1, keepdim=True))
    loss_full = drafter_loss(EAGLE3_LOSS, target, head, ids, mask, out, full)
    loss_restricted = drafter_loss(EAGLE3_LOSS, target, head, ids, mask, out)
    torch.testing.assert_close(loss_full, loss_restricted)
    loss_full.backward()
    assert all(p.grad is None for p in target.parameters())
    assert head.lm_head.weight.grad is not None and head.lm_head.weight.grad.shape == (16, target.config.hidden_size)
    # A head that already equals the restricted teacher is at the loss's minimum, the teacher's entropy.
    ent = soft_cross_entropy(restricted, restricted, torch.ones(restricted.shape[:2], dtype=torch.bool))
    assert ent.item() == pytest.approx(-(restricted.softmax(-1) * restricted.log_softmax(-1)).sum(-1).mean().item())
