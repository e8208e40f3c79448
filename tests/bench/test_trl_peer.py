"""TRL's GRPOTrainer as the peer of `bench step`: it must be configured like our run (same prompt ids, prompts x
group completions per step in PromptTask's order, at most max tokens each, our reward), not merely run.

The TRL tests skip with a reason when TRL is not installed (`pip install 'megatron-spec[peer]'`); the skip logic
of `bench step` itself is tested either way."""

import argparse
import sys

import pytest
import torch

from megatron_spec.bench import trl_peer
from megatron_spec.models import CausalLM, preset, save_pretrained
from megatron_spec.rl.config import GRPOSection, RLConfig
from megatron_spec.rl.task import PromptTask


@pytest.fixture
def trl():
    return pytest.importorskip("trl", reason="TRL is not installed; `pip install 'megatron-spec[peer]'` adds it")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    torch.manual_seed(0)
    model = CausalLM(preset("tiny-qwen3"))
    model.config.eos_token_id = 2
    model.reset_parameters(std=0.1)
    return save_pretrained(model, tmp_path_factory.mktemp("ckpt") / "policy")


def small_cfg(policy) -> RLConfig:
    cfg = RLConfig()
    cfg.model.policy, cfg.model.drafter, cfg.spec = str(policy), None, None
    cfg.grpo = GRPOSection(prompts_per_step=2, group_size=2, max_tokens=5)
    cfg.run.threads = 1
    return cfg


def test_tokenizer_gives_our_ids(trl):
    task = PromptTask.build("tiny", "unused", 512, 0)
    tokenizer = trl_peer.hf_tokenizer()
    problems = task.problems(0, 512)
    trl_peer.check_tokenizer(tokenizer, task, problems)  # raises on the first prompt whose ids differ
    for p in problems[:32]:
        completion = task.tokenizer.encode(p.solution, eos=True)
        assert tokenizer.decode(completion, skip_special_tokens=True) == task.decode(completion) == p.solution
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' renames, called from TRL's code
def test_one_trl_step_is_our_workload(trl, policy, tmp_path):
    cfg = small_cfg(policy)
    g = cfg.grpo
    seen = []

    def spy(fn):
        def accuracy(completions, completion_ids, index, **kwargs):
            seen.append((kwargs["prompts"], [list(map(int, ids)) for ids in completion_ids], list(index)))
            return fn(completions=completions, completion_ids=completion_ids, index=index, **kwargs)
        return accuracy

    timer = trl_peer.step_timer()
    trainer = trl_peer.make_trainer(cfg, 1, str(tmp_path), callbacks=[timer], reward=spy)
    assert next(trainer.model.parameters()).dtype == torch.float32
    assert trainer.args.beta == g.kl_coef == 0 and trainer.args.learning_rate == g.lr
    trainer.train()

    assert len(timer.times) == 1 and len(seen) == 1  # one optimizer step, one scored generation batch
    prompts, completions, index = seen[0]
    problems = PromptTask.build("tiny", str(policy), cfg.run.dataset_size, cfg.run.seed).problems(0, g.prompts_per_step)
    assert index == [i for i in range(g.prompts_per_step) for _ in range(g.group_size)]  # our order, G each
    assert prompts == [problems[i].prompt for i in index]
    assert len(completions) == g.prompts_per_step * g.group_size
    assert all(1 <= len(ids) <= g.max_tokens for ids in completions)
    assert all(0 <= t < 64 for ids in completions for t in ids)
    log = next(h for h in trainer.state.log_history if "completions/max_length" in h)
    assert log["completions/max_length"] <= g.max_tokens


def test_peer_skips_or_fails_by_name_without_trl(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError
    args = argparse.Namespace(no_peer=False, peer=None, steps=2)
    skipped = trl_peer.run_peer(args, None, {}, None)
    assert "megatron-spec[peer]" in skipped["skipped"]
    with pytest.raises(ImportError, match=r"megatron-spec\[peer\]"):
        trl_peer.run_peer(argparse.Namespace(no_peer=False, peer="trl", steps=2), None, {}, None)
    assert trl_peer.run_peer(argparse.Namespace(no_peer=True, peer="trl", steps=2), None, {}, None)["skipped"] == "--no-peer"
