"""GRPO on Qwen3-235B-A22B (MoE, 128 experts, top-8) with EAGLE-3 speculative rollouts (k=3), at scale.

Recommended: 16 nodes x 8 H100 (128 GPUs), colocated; NeMo-RL's GRPO Qwen3-235B performance recipe without its
context parallelism, which the Megatron trainer does not run (`megatron_spec.layout.support_problems`): Megatron-Core
TP2 PP8 CP1 EP16 (ETP1, DP8; the 128 experts 8 per rank; the 94 layers split unevenly over the 8 stages, 11 on the
first and the last, 12 on the six others: Megatron-Core's `num_layers_in_first_pipeline_stage` / `..._last_...`,
`backend.megatron.first_stage_layers` / `last_stage_layers` here, checked at import by the same validator the backend
and the simulator use, `megatron_spec.layout`); vLLM TP16, 8 engines of two nodes each, with `spec.vllm()` as vLLM's
`speculative_config`; Ray places one trainer and one generator worker per GPU. The simulator's memory model fits
it on 80 GB H100s. `--tune` picks the tuner's best runnable layout instead (it searches engine TP up to 8).
The config selects exactly that (`SCALE.backend`: `backend.trainer=megatron`, `backend.generator=vllm`,
colocated), with engines serving a prompt of up to 1024 tokens plus the 8192 of a rollout.
256 prompts x 16 rollouts = 4096 rollouts per step, the batch of the reference's 235B projection. Weight sync
gathers the TP/PP/EP shards into HF names in buckets (policy and drafter).

Running needs `pip install -e .[megatron,vllm,ray]` on the cluster: submit with `--executor ray-slurm`;
`--dryrun` works anywhere.
"""

import sys

from megatron_spec.layout import check_layout
from megatron_spec.models.presets import preset
from megatron_spec.rl.config import GRPOSection, ModelSection, RLConfig, RunSection
from megatron_spec.spec.config import SpecConfig
from recipes._common import Scale, recipe_main

SCALE = Scale(nodes=16, gpus_per_node=8, tp=2, pp=8, cp=1, ep=16, vllm_tp=16, time="04:00:00",
              first_stage_layers=11, last_stage_layers=11)
check_layout(preset("qwen3-235b-a22b"), SCALE.train_layout(), SCALE.nodes * SCALE.gpus_per_node, runnable=True)

DRAFTER = "checkpoints/qwen3-235b-a22b-eagle3"
MAX_TOKENS = 8192
PROMPT_TOKENS = 1024


def qwen3_235b_grpo_spec() -> RLConfig:
    """256 prompts x 16 rollouts of up to 8K tokens per step, DAPO's asymmetric clip, no KL."""
    return RLConfig(
        model=ModelSection(policy="Qwen/Qwen3-235B-A22B", drafter=DRAFTER, task="natural"),
        grpo=GRPOSection(prompts_per_step=256, group_size=16, max_tokens=MAX_TOKENS, lr=5e-7, clip_high=0.28),
        spec=SpecConfig("eagle3", num_speculative_tokens=3, model=DRAFTER),
        run=RunSection(steps=300, out_dir="runs/qwen3_235b", save_every=10, dataset_size=17_000, eval_prompts=30,
                       eval_every=10, threads=8),
        backend=SCALE.backend(max_model_len=PROMPT_TOKENS + MAX_TOKENS),
    )


def main(argv: list[str] | None = None) -> int:
    return recipe_main(qwen3_235b_grpo_spec, argv, scale=SCALE)


if __name__ == "__main__":
    sys.exit(main())
