"""GRPO on the tiny Qwen3-MoE (8 experts, top-2, 4 layers) with MTP speculative rollouts: the at-scale code path
(Megatron-Core EP / TP / PP training, the MTP head trained jointly as Megatron's MTP layer, resharded export into
the generator every step) at toy size, on this CPU.

    python recipes/tiny_moe_grpo_spec.py                                   # embedded trainer, one process
    torchrun --nproc-per-node 2 recipes/tiny_moe_grpo_spec.py backend.trainer=megatron backend.megatron.ep=2

Needs checkpoints/tiny-qwen3-moe and its MTP head checkpoints/tiny-qwen3-moe-mtp (`megatron-spec train-drafter
--target checkpoints/tiny-qwen3-moe --method mtp --out checkpoints/tiny-qwen3-moe-mtp --save-dtype bfloat16`).
Under torchrun rank 0 generates, trains its shard and logs; the other ranks train theirs
(`megatron_spec.trainers.megatron.launch`). Speculation runs on every step (`spec.adaptive=false`) so each step
measures the MTP head's acceptance length.
"""

import os
import sys

from megatron_spec.rl.backend_config import BackendSection, MegatronSection
from megatron_spec.rl.config import GRPOSection, ModelSection, RLConfig, RunSection
from megatron_spec.drafters.config import SpecConfig
from recipes._common import recipe_main

DRAFTER = "checkpoints/tiny-qwen3-moe-mtp"


def tiny_moe_grpo_spec() -> RLConfig:
    """8 prompts x 8 rollouts per step; one Megatron MTP layer (used when `backend.trainer=megatron`)."""
    return RLConfig(
        model=ModelSection(policy="checkpoints/tiny-qwen3-moe", drafter=DRAFTER, task="tiny"),
        grpo=GRPOSection(prompts_per_step=8, group_size=8, max_tokens=96),
        spec=SpecConfig("mtp", num_speculative_tokens=3, adaptive=False),
        run=RunSection(steps=10, out_dir="runs/tiny_moe", save_every=5, dataset_size=4096, eval_prompts=64,
                       eval_every=0),
        backend=BackendSection(megatron=MegatronSection(mtp_num_layers=1)),
    )


def main(argv: list[str] | None = None) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: rank 0 runs the loop, the other ranks follow it
        from megatron_spec.trainers.megatron.launch import recipe_main as ranks_main

        return ranks_main(lambda: recipe_main(tiny_moe_grpo_spec, argv), argv)
    return recipe_main(tiny_moe_grpo_spec, argv)


if __name__ == "__main__":
    sys.exit(main())
