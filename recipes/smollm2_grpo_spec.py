"""GRPO with history speculative rollouts on SmolLM2-135M-Instruct, natural-language arithmetic prompts.

The real 135M model on a CPU: a small batch and short rollouts. There is no trained drafter for SmolLM2, so the
rollouts speculate with the `history` drafter (suffix lookup over the other rollouts of the same prompt, now and
from earlier steps), which needs no weights. Runs on the embedded engine: `--executor local` (default) or `slurm`.
"""

import sys

from megatron_spec.rl.config import (
    DrafterTrainSection, GRPOSection, ModelSection, RLConfig, RunSection,
)
from megatron_spec.drafters.config import SpecConfig
from recipes._common import recipe_main


def smollm2_grpo_spec() -> RLConfig:
    """4 prompts x 4 rollouts of up to 64 tokens per step; a small learning rate for a pretrained model."""
    return RLConfig(
        model=ModelSection(policy="smollm2-135m", drafter=None, task="natural"),
        grpo=GRPOSection(prompts_per_step=4, group_size=4, max_tokens=64, lr=1e-6),
        spec=SpecConfig("history", num_speculative_tokens=3, adaptive=True),  # on only where it pays
        drafter_train=DrafterTrainSection(online=False),  # history has no weights to train
        run=RunSection(steps=10, out_dir="runs/smollm2", save_every=5, dataset_size=512, eval_prompts=16,
                       eval_every=5),
    )


def main(argv: list[str] | None = None) -> int:
    return recipe_main(smollm2_grpo_spec, argv)


if __name__ == "__main__":
    sys.exit(main())
