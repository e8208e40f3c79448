"""`bench rollout`'s pairing: the two engines of a repeat run step by step in turn, and that changes nothing they
compute."""

import torch

from megatron_spec.bench.rollout import interleaved
from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.spec.config import SpecConfig


def test_interleaved_rollouts_are_each_engines_own_generate(tiny_model):
    """A speculative and a plain engine stepped in turn emit exactly what each emits from `generate` alone (same
    tokens, log-probs and speculation counts, sampled at T=1 with a max_num_seqs that forces queueing), and each
    is charged only its own seconds: every engine gets a positive time, and the two add up to at most the wall
    time of the whole call. Fails if the interleaving shared state between the engines (a step of one advancing
    the other) or timed one engine's steps to the other."""
    import time

    prompts = [list(range(3 + i, 9 + 2 * i)) for i in range(6)]
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=5)

    def engines():
        spec = SpecConfig("ngram", 3, prompt_lookup_min=1)
        return [LLMEngine(tiny_model, max_num_seqs=4, spec=spec), LLMEngine(tiny_model, max_num_seqs=4)]

    alone = [e.generate(prompts, params) for e in engines()]
    t0 = time.perf_counter()
    spent, together = interleaved(engines(), prompts, params)
    wall = time.perf_counter() - t0
    assert together == alone
    assert any(c.spec for c in together[0]) and not any(c.spec for c in together[1])
    assert min(spent) > 0 and sum(spent) <= wall
    assert not torch.is_inference_mode_enabled()
