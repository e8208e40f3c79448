"""MoE routing: the engine records the experts of every input position of a rollout, and a forward under
`replayed` routes to the experts it is given."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models.decoder import CausalLM
from megatron_spec.models.presets import preset
from megatron_spec.models.routing import choices, moe_layers, replayed
from megatron_spec.drafters.config import SpecConfig

MARGIN = 1e-2
"""A position is compared only where the reference forward's k-th and (k+1)-th router logits are at least this far
apart. The engine's forward (cached attention, packed GEMMs, another batch shape) and a plain forward agree to
~1e-5 relative in fp32 on any x86 instruction set and thread count, and the logits here are O(1-10), so a choice can
only differ within ~1e-4 of a tie; with the gate scaled up (`sharp_moe`) closer calls are rare, and the test requires
98 % of positions to be compared."""


def sharp_moe(seed: int = 0) -> CausalLM:
    """The tiny MoE, randomly initialised, with its routers' logits scaled x20 (probabilities far from uniform, so
    the top-k has a clear margin almost everywhere)."""
    torch.manual_seed(seed)
    model = CausalLM(preset("tiny-qwen3-moe")).eval()
    with torch.no_grad():
        for m in moe_layers(model):
            m.gate.weight.mul_(20)
    return model


def reference(model: CausalLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain forward's sorted top-k per input position but the last [n-1, layers, k], and the margin of each
    choice [n-1, layers]: the k-th router logit less the (k+1)-th."""
    layers, states = moe_layers(model), []
    hooks = [m.register_forward_pre_hook(lambda mod, args: states.append(args[0])) for m in layers]
    with torch.no_grad():
        model.trunk(torch.tensor([ids]))
        for h in hooks:
            h.remove()
        picked = choices(model, 1, len(ids))[0, :-1].long().sort(-1).values
        margins = []
        for m, x in zip(layers, states):
            top = m.gate(x.reshape(-1, x.shape[-1])).float().topk(m.top_k + 1).values
            margins.append(top[:, -2] - top[:, -1])
    return picked, torch.stack(margins, 1)[:-1]


@pytest.mark.parametrize("how", ["plain", "draft_model", "ngram"])
def test_engine_records_every_input_positions_experts(how):
    """Each completion's routing has one row per input position (prompt + completion - 1), equal to a plain forward
    over the whole sequence: prompts shared by several rollouts (one prefill forward, copied), plain decode steps, and
    verification forwards whose accepted drafts keep their rows (a greedy draft model equal to the policy accepts
    every draft; ngram's mostly rejected ones must leave no row)."""
    model = sharp_moe()
    spec = drafter = None
    if how == "draft_model":
        spec, drafter = SpecConfig(method="draft_model", num_speculative_tokens=3), copy.deepcopy(model)
    elif how == "ngram":
        spec = SpecConfig(method="ngram", num_speculative_tokens=3)
    engine = LLMEngine(model, spec=spec, drafter=drafter, record_routing=True)
    prompts = [[1, 2, 3, 4, 5, 6]] * 3 + [[7, 8, 9, 10]] * 2
    params = SamplingParams(max_tokens=30, seed=1, temperature=0.0 if how == "draft_model" else 1.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    if how == "draft_model":
        assert sum(o.spec["accepted"] for o in outs) == sum(o.spec["drafted"] for o in outs) > 0
    compared = total = 0
    for prompt, out in zip(prompts, outs):
        ids = prompt + out.token_ids
        assert out.routing.dtype == np.int16 and out.routing.shape == (len(ids) - 1, 4, 2)
        picked, margin = reference(model, ids)
        clear = margin > MARGIN
        assert torch.equal(torch.from_numpy(out.routing).long().sort(-1).values[clear], picked[clear])
        compared, total = compared + int(clear.sum()), total + clear.numel()
    assert compared >= 0.98 * total


def test_no_routing_unless_asked():
    model = sharp_moe()
    out = LLMEngine(model).generate([[1, 2, 3]], SamplingParams(max_tokens=4, seed=0))[0]
    assert out.routing is None


def test_replay_routes_to_the_given_experts():
    """Under `replayed`, every position not marked -1 goes to the given experts (other than its own, here), the -1
    positions to their own top-k; replaying a forward's own routing gives that forward's output bit for bit."""
    model = sharp_moe()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        free_out = model(ids)
        own = choices(model, 2, 9)
        forced = (own.long() + 1) % 8  # never the expert the router picked
        forced[1, 4:] = -1
        with replayed(model, forced.to(torch.int16)):
            model(ids)
            got = choices(model, 2, 9).long()
        assert all(m.replay is None for m in moe_layers(model))
        assert torch.equal(got[0], forced[0]) and torch.equal(got[1, :4], forced[1, :4])
        with replayed(model, own):
            assert torch.equal(model(ids), free_out)


def test_replay_keeps_the_routers_gradient():
    """The replayed experts' weights are this router's probabilities of them, so the router still learns."""
    model = sharp_moe().train()
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(4))
    forced = torch.zeros(1, 7, 4, 2, dtype=torch.int16)
    forced[..., 1] = 5
    with replayed(model, forced):
        model(ids).sum().backward()
    assert all(m.gate.weight.grad is not None and m.gate.weight.grad.abs().sum() > 0 for m in moe_layers(model))


def test_replay_checks_the_layer_count():
    model = sharp_moe()
    with pytest.raises(ValueError, match="3 MoE layers, the model has 4"):
        with replayed(model, torch.zeros(1, 2, 3, 2, dtype=torch.int16)):
            pass


def test_in_flight_refit_records_the_new_weights_routing():
    """An in-flight refit recomputes the running sequences' states under the new weights, which every later token
    reads: their routing is then recorded again, so a completion's routing is the new weights' plain forward's at
    every position (where the margin is clear, as above), not the old weights' for the positions before the switch."""
    from tests.engine.test_inflight import engine_with, generate_with_refit

    model_a, model_b = sharp_moe(0), sharp_moe(1)
    engine, _ = engine_with(model_a)
    engine.record_routing = True
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    outs, at = generate_with_refit(engine, None, prompts, SamplingParams(max_tokens=12, seed=2, ignore_eos=True),
                                   3, model_b)
    assert all(0 < t < 12 for t in at)
    compared = total = 0
    for prompt, out in zip(prompts, outs):
        ids = prompt + out.token_ids
        picked, margin = reference(model_b, ids)
        old, _ = reference(model_a, ids)
        clear = margin > MARGIN
        got = torch.from_numpy(out.routing).long().sort(-1).values
        assert torch.equal(got[clear], picked[clear]) and not torch.equal(got, old)
        compared, total = compared + int(clear.sum()), total + clear.numel()
    assert compared >= 0.98 * total
