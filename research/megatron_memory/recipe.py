"""The RL job of `run.py`: GRPO on a random Qwen3-MoE with the Megatron trainer (EP2 x PP2 by default) and the
embedded generator, 2 steps of 2 prompts x 2 rollouts of 8 tokens, a checkpoint after each step.

    MM_POLICY=DIR MM_OUT=RUN torchrun --nproc-per-node 4 research/megatron_memory/recipe.py [key=value ...]
"""

import os
import sys

from megatron_spec.rl.backend_config import BackendSection, MegatronSection
from megatron_spec.rl.config import GRPOSection, ModelSection, RLConfig, RunSection
from recipes._common import recipe_main


def megatron_memory() -> RLConfig:
    return RLConfig(
        model=ModelSection(policy=os.environ["MM_POLICY"], task="tiny"),
        grpo=GRPOSection(prompts_per_step=2, group_size=2, max_tokens=8),
        spec=None,
        # saves in the foreground: a background save's host copy of every rank's state would not fit this 24 GB
        # machine beside 4 ranks and the generator (the memory audit counts that copy where it is on)
        run=RunSection(steps=2, out_dir=os.environ["MM_OUT"], save_every=1, eval_every=0, report=False, threads=2,
                       async_save=False),
        backend=BackendSection(trainer="megatron", megatron=MegatronSection(ep=2, pp=2)),
    )


def main(argv: list[str] | None = None) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from megatron_spec.trainers.megatron.launch import recipe_main as ranks_main

        return ranks_main(lambda: recipe_main(megatron_memory, argv), argv)
    return recipe_main(megatron_memory, argv)


if __name__ == "__main__":
    sys.exit(main())
