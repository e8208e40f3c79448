"""GRPO with MTP speculative rollouts on the deep tiny Qwen3 (the README job: minutes on a 2-core CPU).

Needs the policy and its MTP drafter, both shipped in checkpoints/ and made by the commands in docs/main_job.md
(`megatron-spec pretrain --preset tiny-qwen3-deep ...`, then `megatron-spec train-drafter --method mtp ...`).
Runs on the embedded engine: `--executor local` (default) or `slurm` (one node); with `backend.placement=colocated`
or `disaggregated` on Ray worker groups: `--executor local` (a local Ray cluster, or the one at RAY_ADDRESS) or
`ray-slurm` (slurm/ray.sub, the driver on the head).
"""

import sys
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # recipes/ and launchers/ sit beside the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes._common import recipe_main  # noqa: E402

from megatron_spec.rl.config import GRPOSection, ModelSection, RLConfig, RunSection  # noqa: E402


def tiny_grpo_spec() -> RLConfig:
    """The main job: the deep tiny policy on addition chains of 2-8 terms (rollouts of 13-85 tokens, so the batch
    shrinks to a few long ones), a learning rate at which GRPO fixes the policy's pretrained carry slip within the
    run, and a held-out set large enough to see it (128 problems: +-4.4 points of standard error)."""
    return RLConfig(
        model=ModelSection(policy="checkpoints/tiny-qwen3-deep", drafter="checkpoints/tiny-qwen3-deep-mtp"),
        grpo=GRPOSection(max_tokens=128, lr=1e-4),
        run=RunSection(eval_prompts=128),
    )


def main(argv: list[str] | None = None) -> int:
    return recipe_main(tiny_grpo_spec, argv)


if __name__ == "__main__":
    sys.exit(main())
