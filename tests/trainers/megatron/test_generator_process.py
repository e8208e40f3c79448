"""The embedded generator in a process of its own (`ProcessGenerator`), as a Megatron-trained run uses it: loaded
there from the checkpoint files, refit from a bucketed stream, and generating exactly what the same generator does
in this process (same weights, same seeded sampling: the engine draws from the request's seed, not from a
process-wide state)."""

from __future__ import annotations

import pytest
import torch

from megatron_spec.engine import SamplingParams
from megatron_spec.models.hf_io import save_pretrained
from megatron_spec.rl.config import GRPOSection, ModelSection, RLConfig, RunSection
from megatron_spec.generators.embedded import EmbeddedGenerator
from megatron_spec.refit import buckets, named_weights

PROMPTS = [[1, 5, 9, 3], [1, 7, 2], [1, 5, 9, 3], [4, 4, 8, 1, 6]]


@pytest.fixture()
def run(tmp_path, tiny_model):
    from megatron_spec.generators.process import ProcessGenerator

    policy = save_pretrained(tiny_model, tmp_path / "policy")
    cfg = RLConfig(model=ModelSection(policy=str(policy), task="tiny"), grpo=GRPOSection(prompts_per_step=2),
                   spec=None, run=RunSection(out_dir=str(tmp_path / "run"), threads=1))
    gen = ProcessGenerator.from_rl(cfg)
    yield gen, EmbeddedGenerator(tiny_model, None, None, max_num_seqs=4)
    gen.close()


def same(a, b) -> None:
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]


def test_process_generator_generates_and_refits_as_in_process(run, tiny_model):
    """Greedy and seeded sampling equal the in-process generator's, token for token and log-prob for log-prob;
    after the same refit (every weight moved by noise, sent in 64 kB buckets) they still are, and differ from
    before (the refit reached the other process: bytes loaded = the model's)."""
    gen, local = run
    for params in (SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=1.0, max_tokens=8, seed=3)):
        same(gen.generate(PROMPTS, params), local.generate(PROMPTS, params))
    before = gen.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    g = torch.Generator().manual_seed(5)
    moved = [(n, t + 0.2 * torch.randn(t.shape, generator=g)) for n, t in named_weights(tiny_model)]
    sent = gen.update_weights(buckets(iter(moved), 64 << 10))
    assert sent == local.update_weights(buckets(iter(moved), 64 << 10)) == sum(t.numel() * 4 for _, t in moved)
    gen.sleep()
    gen.wake()
    after = gen.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    same(after, local.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8)))
    assert [o.token_ids for o in after] != [o.token_ids for o in before]


def test_process_generator_reports_a_bad_refit_and_keeps_serving(run, tiny_model):
    """A tensor the generator has no place for fails the refit with the generator's own error (KeyError naming it),
    raised here; the rest of the stream is still read, so the next call is answered normally."""
    gen, local = run
    norm = torch.ones(tiny_model.config.hidden_size)
    stream = [[("model.norm.weight", norm)], [("not.a.weight", torch.ones(3))], [("model.norm.weight", norm)]]
    with pytest.raises(RuntimeError, match="KeyError.*not.a.weight"):
        gen.update_weights(iter(stream))
    params = SamplingParams(temperature=0, max_tokens=4)
    assert len(gen.generate(PROMPTS, params)) == len(PROMPTS)


def test_a_dead_generator_process_is_reported_with_its_exit_code(run, tiny_model):
    """Killed mid-run (as the kernel kills for memory), the generator's process is reported, with its exit code,
    by the next call and by a refit that finds the pipe broken, not as a bare pipe error."""
    gen, _ = run
    gen.proc.kill()
    gen.proc.wait()
    with pytest.raises(RuntimeError, match=r"generator's process exited \(code -9"):
        gen.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2))
    with pytest.raises(RuntimeError, match=r"generator's process exited \(code -9"):
        gen.update_weights(buckets(named_weights(tiny_model), 1 << 10))
