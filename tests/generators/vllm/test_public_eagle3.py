"""vLLM serves an EAGLE-3 head that went through our public-layout path: written in the vLLM speculators layout
(with that project's names and config), loaded into our head, updated online once, exported back in the same
layout. One engine for the module."""

import copy

import pytest
import torch

from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models import from_pretrained
from megatron_spec.drafters.files import load_drafter
from megatron_spec.drafters.eagle3.public import SPECULATORS, load_public_eagle3, save_public_eagle3
from megatron_spec.rl.task import PromptTask
from megatron_spec.drafters.config import SpecConfig
from tests.models.test_eagle3_public import write_public

from .common import vllm_only

pytestmark = vllm_only

POLICY = "checkpoints/tiny-qwen3"
GREEDY = SamplingParams(temperature=0, max_tokens=64)


def test_vllm_serves_the_exported_speculators_head(tmp_path):
    """The shipped tiny EAGLE-3 head through speculators layout -> our head -> one online update (lr 1e-5, on the
    tiny task's own greedy rollouts) -> speculators layout, served by vLLM on 32 arithmetic prompts: vLLM's tokens
    are the plain greedy tokens, and it accepts drafts: more than 1.5 tokens per verify step, which a head whose
    layer, fc or d2t vLLM read wrongly would not reach (its drafts would be rejected, about 1 token per step)."""
    from megatron_spec.generators.vllm import VLLMGenerator
    from megatron_spec.generators.vllm.export import export_target
    from megatron_spec.rl.config import DrafterTrainSection, GRPOSection
    from megatron_spec.interfaces import Batch
    from megatron_spec.trainers.embedded import EmbeddedPolicy

    target = from_pretrained(POLICY)
    task = PromptTask.build("tiny", POLICY, 64, 0, "eval")
    prompts = [task.encode(p) for p in task.problems(0, 32)]
    plain = LLMEngine(target).generate(prompts, GREEDY)
    src = write_public(load_drafter("checkpoints/tiny-qwen3-eagle3", target.config), tmp_path / "public", SPECULATORS,
                       dtype=torch.float32, mapping=False)
    head = load_public_eagle3(src, target.config)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    rows = [p + o.token_ids for p, o in zip(prompts, plain)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, rows)):
        ids[i, :len(r)], mask[i, len(p):len(r)] = torch.tensor(r), True
    policy = EmbeddedPolicy(copy.deepcopy(target), GRPOSection(lr=1e-6), dict(temperature=1.0, top_k=0, top_p=1.0),
                            head, "eagle3", DrafterTrainSection(lr=1e-5))
    policy.train_step(Batch(ids, mask, advantages=torch.zeros(len(rows))))
    assert any(not torch.equal(v, before[k]) for k, v in head.state_dict().items())  # the update happened
    exported = save_public_eagle3(head, tmp_path / "exported")
    export_target(target, tmp_path / "policy")
    gen = VLLMGenerator(str(tmp_path / "policy"), SpecConfig("eagle3", 3, model=str(exported)), max_model_len=512,
                        check_refit=False)
    try:
        theirs = gen.generate(prompts, GREEDY)
    finally:
        gen.close()
    assert [o.token_ids for o in theirs] == [o.token_ids for o in plain]
    per_step = sum(len(o.token_ids) - 1 for o in theirs) / sum(o.spec["verify_steps"] for o in theirs)
    assert per_step > 1.5, per_step
