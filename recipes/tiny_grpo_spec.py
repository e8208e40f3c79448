"""GRPO with MTP speculative rollouts on the tiny reference Qwen3 (the README job: minutes on a 2-core CPU).

Needs the tiny policy and its MTP drafter (`megatron-spec pretrain --preset tiny-qwen3 --out checkpoints/tiny-qwen3`,
then `megatron-spec train-drafter --method mtp ...`). Runs on the embedded engine: `--executor local` (default) or
`slurm` (one node); with `backend.placement=colocated` or `disaggregated` on Ray worker groups: `--executor local`
(a local Ray cluster, or the one at RAY_ADDRESS) or `ray-slurm` (slurm/ray.sub, the driver on the head).
"""

import sys
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # recipes/ and launchers/ sit beside the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes._common import recipe_main  # noqa: E402

from megatron_spec.rl.config import RLConfig  # noqa: E402


def tiny_grpo_spec() -> RLConfig:
    """The RLConfig defaults, which are sized for the tiny model."""
    return RLConfig()


def main(argv: list[str] | None = None) -> int:
    return recipe_main(tiny_grpo_spec, argv)


if __name__ == "__main__":
    sys.exit(main())
