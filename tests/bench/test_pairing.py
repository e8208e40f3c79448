"""How the benchmarks pair the two engines they compare: `bench rollout` steps them in turn (which must change
nothing they compute), `bench engine` runs them back to back and takes the median of the pairs' ratios."""

import pytest
import torch

from megatron_spec.bench.rollout import interleaved
from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.drafters.config import SpecConfig


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


def test_bench_engine_against_hf_samples_and_pairs_its_repeats(tiny_model, tmp_path):
    """`bench engine` at T=1 against HF `generate` (its default) runs, and each cell's speed-up is the median of the
    repeats' paired ratios, inside their range, while tokens/s are best-of: both engines' figures are consistent
    with the milliseconds per step they report. (Sampling against HF once failed before any timing: `do_sample`
    was passed twice.)"""
    from megatron_spec.bench import engine as bench_engine
    from megatron_spec.models import save_pretrained

    save_pretrained(tiny_model, tmp_path / "tiny")
    result = bench_engine.run(str(tmp_path / "tiny"), [1, 3], new_tokens=6, prompt_len=5, repeats=3)
    assert [(r["batch"], r["temperature"]) for r in result["rows"]] == [(1, 1.0), (3, 1.0)]
    for r in result["rows"]:
        low, high = r["speedup_range"]
        assert low <= r["speedup"] <= high
        for side in ("ours", "hf"):
            assert abs(r[f"{side}_tok_s"] * r[f"{side}_ms_step"] / 1000 - r["batch"]) < 1e-9


def test_bench_engine_no_kernels_peer_is_our_engine_without_them(tiny_model, tmp_path, monkeypatch):
    """`--peer no-kernels` times our engine against itself with the fused kernels off: the kernels run in our
    side's forwards only. Each generate of 6 tokens is 6 forwards (a prefill, 5 decodes) of 4 layers, and our side
    runs a warm-up plus 3 repeats per batch size: 2 x 4 x 6 x 4 = 192 whole-layer kernel calls (every forward
    here has at most 15 rows, so each layer is one `decoder_layer` call); had the peer used them too, 384."""
    from megatron_spec import kernels
    from megatron_spec.bench import engine as bench_engine
    from megatron_spec.models import save_pretrained

    calls = []
    layer = kernels.decoder_layer
    monkeypatch.setattr(kernels, "decoder_layer", lambda *args: calls.append(1) or layer(*args))
    save_pretrained(tiny_model, tmp_path / "tiny")
    result = bench_engine.run(str(tmp_path / "tiny"), [1, 3], new_tokens=6, prompt_len=5, repeats=3,
                              peer="no-kernels")
    assert result["peer"] == "no-kernels" and len(result["rows"]) == 2
    assert len(calls) == 2 * 4 * 6 * tiny_model.config.num_hidden_layers


def test_measure_runs_every_warm_rollout_on_both_engines_before_the_timed_one(tiny_model):
    """`bench rollout`'s RL cell warms each fresh engine with several earlier steps (`--rl-warm`), as an RL engine
    lives across steps: every warm rollout runs on both engines, in order, before the timed rollout, which is
    stepped by `interleaved` and not through `generate`. Fails if a warm rollout is skipped, run on one engine only
    or after the timed one (or if only the first of the list ran, as when `measure` took a single one)."""
    from megatron_spec.bench.rollout import measure

    calls = []

    def make(name):
        engine = LLMEngine(tiny_model, max_num_seqs=4)
        generate = engine.generate
        engine.generate = lambda prompts, params: calls.append((name, params.seed)) or generate(prompts, params)
        return engine

    prompts = [list(range(3 + i, 9 + i)) for i in range(3)]
    warm = [(prompts, SamplingParams(temperature=1.0, max_tokens=4, seed=s)) for s in (11, 12, 13)]
    row = measure(lambda: make("spec"), lambda: make("plain"), prompts,
                  SamplingParams(temperature=1.0, max_tokens=4, seed=5), 1, warm)
    assert calls == [(name, s) for s in (11, 12, 13) for name in ("spec", "plain")]
    assert row["ratios"] and row["ratios"][0] > 0


def test_bench_rollout_refuses_no_warm_step_before_loading_anything():
    """`--rl-warm 0` would time an RL cell's rollout on engines that have not run the step before it: a clear error
    before any model is loaded (the target path does not exist here)."""
    import argparse

    from megatron_spec.bench.rollout import add_arguments, main

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--rl-warm", "0", "--target", "/nonexistent/model"])
    with pytest.raises(SystemExit, match="--rl-warm must be at least 1"):
        main(args)


def test_loop_pairs_refuses_a_fixed_k_without_speculation(capsys):
    """`benchmarks/loop_pairs.py --fixed-k K` times an engine drafting K tokens with the loop's own drafter beside
    the loop's; with `spec=null` there is no drafter to give it, and the benchmark says so before any model loads
    or any step runs (exit 2, argparse's usage error)."""
    from benchmarks.loop_pairs import main

    with pytest.raises(SystemExit) as exit_:
        main(["--fixed-k", "3", "spec=null", "run.out_dir=/nonexistent/never_written"])
    assert exit_.value.code == 2
    assert "--fixed-k needs the job to speculate (spec is null)" in capsys.readouterr().err
