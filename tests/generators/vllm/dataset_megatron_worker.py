"""Run by `test_dataset_megatron.py` in its own process (the Megatron trainer makes a one-rank process group there):
two GRPO steps of SmolLM2-135M from a DAPO-layout parquet file with `backend.trainer=megatron` and
`backend.generator=vllm`, recording what the test checks as JSON: each step's prompts, completions, rewards and
metrics, the order of the file's problems and whether the policy's weights moved.

    python -m tests.generators.vllm.dataset_megatron_worker DATA.parquet RUN_DIR OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from megatron_spec.models.hub import resolve_config
from megatron_spec.rl.config import RLConfig
from megatron_spec.rl.loop import Trainer, check_inputs
from megatron_spec.rl.overrides import apply_overrides

PROMPTS, GROUP = 2, 4


def weights(policy) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in policy.export_weights()}


def main(data: str, run_dir: str, out: str) -> None:
    cfg = apply_overrides(RLConfig(), [
        "model.policy=smollm2-135m", "model.drafter=null", "model.task=natural", "spec=null", f"data.path={data}",
        "backend.trainer=megatron", "backend.generator=vllm", "backend.vllm.max_model_len=512",
        f"grpo.prompts_per_step={PROMPTS}", f"grpo.group_size={GROUP}", "grpo.max_tokens=16",
        "grpo.micro_batch_tokens=0", "grpo.lr=1e-4", "run.eval_prompts=2", "run.threads=2", f"run.out_dir={run_dir}"])
    cfg = resolve_config(cfg)  # the built-in name becomes SmolLM2's converted directory, which Megatron reads
    check_inputs(cfg)
    torch.manual_seed(0)
    trainer = Trainer(cfg)
    record = {"policy": cfg.model.policy, "steps": []}
    rollouts, score = trainer.rollouts, trainer.score

    def seen_rollouts(step, prompts):
        record["steps"].append({"prompts": prompts})
        made = rollouts(step, prompts)
        record["steps"][-1]["completions"] = [o.token_ids for o in made.outs]
        return made

    def seen_score(problems, outs):
        rewards = score(problems, outs)
        record["steps"][-1].update(answers=[p.answer for p in problems], rewards=rewards.tolist())
        return rewards

    trainer.rollouts, trainer.score = seen_rollouts, seen_score
    try:
        before = weights(trainer.policy)
        record["metrics"] = [trainer.step(s) for s in range(2)]
        after = weights(trainer.policy)
        record["moved"] = sorted(n for n in before if not torch.equal(before[n], after[n]))
        record["eval_answers"] = [p.answer for p in trainer.eval_task.items]
        record["train_answers"] = [p.answer for p in trainer.task.items]
    finally:
        trainer.close()
    with open(out, "w") as f:
        json.dump(record, f, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
