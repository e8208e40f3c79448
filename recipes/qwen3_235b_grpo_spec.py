"""GRPO on Qwen3-235B-A22B (MoE, 128 experts, top-8) with EAGLE-3 speculative rollouts (k=5) and asynchronous GRPO
(policy lag 2), at scale: the configuration of the reference's 2.5x projection.

Recommended: 16 nodes x 8 H100 (128 GPUs), disaggregated: the layout `megatron-spec tune` ranks best for 128 H100
among those the code runs (context parallelism refused, `megatron_spec.layout.support_problems`) with speculation at
k=5 and lag 2 allowed. Trainer on 96 GPUs: Megatron-Core TP2 PP8 CP1 EP4 with sequence parallelism (Megatron-Core
trains MoE layers under TP only with it; ETP1, DP6; the 128 experts 32 per rank; the 94 layers split unevenly over
the 8 stages, 11 on the first and the last, 12 on the six others: `backend.megatron.first_stage_layers` /
`last_stage_layers`, Megatron-Core's `num_layers_in_first_pipeline_stage` / `..._last_...`, checked at import by the
validator the backend and the simulator use, `megatron_spec.layout`). Generation on the other 32: 4 vLLM engines of
TP8 (one node each), `spec.vllm()` as vLLM's `speculative_config`, running up to two policy versions ahead of the
trainer (`backend.async_lag=2`, truncated importance sampling). The config selects exactly that (`SCALE.backend`),
with engines serving a prompt of up to 1024 tokens plus the 8192 of a rollout. 256 prompts x 16 rollouts = 4096
rollouts per step, the batch of the reference's projection. `--tune` picks the tuner's best runnable layout for
another allocation instead.

Projected by the simulator (H100 set calibrated on NeMo-RL's published step times; bf16 trainer with selective
recompute, engines in bf16; response lengths log-normal with the projection's mean and spread under the 8192 cap;
EAGLE-3 acceptance length 4 at k=5, the projection's assumption, trained online), on this layout: 1280 s a step
(generation 1275 s, of it 867 s not hidden behind training; train 312 s), against 3390 s for synchronous
autoregressive GRPO on the same GPUs: 2.65x end to end (speculation alone, synchronous: 1.98x; lag 2 alone:
1.14x). The tuner's fastest synchronous layouts put vLLM engines of TP8 on the trainer's GPUs (1099 s
autoregressive, 725 s with EAGLE-3 k=3); the Ray placement does not run colocated engines of TP > 1 on GPUs, and
an engine of TP1 cannot hold this model, so those are not offered here. The memory audit (`--audit`) finds that
this layout does not fit 80 GB H100s as configured: the 4096 rollouts do not split over DP 6, a 12-layer stage holds
7.7 B parameters (7.25 B of them experts at EP4) whose torch AdamW states are not sharded, and the engines serve
the policy in float32; a dry run prints the audit's table, a launch refuses it.

Running needs `pip install -e .[megatron,vllm,ray]` on the cluster: submit with `--executor ray-slurm`;
`--dryrun` works anywhere; `--rehearsal` runs this file's code path at toy width on the allocation at hand
(`recipes/rehearsal.py`).
"""

import sys

from megatron_spec.layout import check_layout
from megatron_spec.models.presets import preset
from megatron_spec.rl.config import GRPOSection, ModelSection, RLConfig, RunSection
from megatron_spec.spec.config import SpecConfig
from recipes._common import Scale, recipe_main

SCALE = Scale(nodes=16, gpus_per_node=8, tp=2, pp=8, cp=1, ep=4, vllm_tp=8, colocated=False, gen_gpus=32,
              async_lag=2, sequence_parallel=True, time="04:00:00", first_stage_layers=11, last_stage_layers=11)
check_layout(preset("qwen3-235b-a22b"), SCALE.train_layout(), SCALE.nodes * SCALE.gpus_per_node - SCALE.gen_gpus,
             runnable=True)

DRAFTER = "checkpoints/qwen3-235b-a22b-eagle3"
MAX_TOKENS = 8192
PROMPT_TOKENS = 1024


def qwen3_235b_grpo_spec() -> RLConfig:
    """256 prompts x 16 rollouts of up to 8K tokens per step, DAPO's asymmetric clip, no KL."""
    return RLConfig(
        model=ModelSection(policy="Qwen/Qwen3-235B-A22B", drafter=DRAFTER, task="natural"),
        grpo=GRPOSection(prompts_per_step=256, group_size=16, max_tokens=MAX_TOKENS, lr=5e-7, clip_high=0.28),
        spec=SpecConfig("eagle3", num_speculative_tokens=5, model=DRAFTER),
        run=RunSection(steps=300, out_dir="runs/qwen3_235b", save_every=10, save_every_s=1800, dataset_size=17_000, eval_prompts=30,
                       eval_every=10, threads=8),
        backend=SCALE.backend(max_model_len=PROMPT_TOKENS + MAX_TOKENS),
    )


def main(argv: list[str] | None = None) -> int:
    return recipe_main(qwen3_235b_grpo_spec, argv, scale=SCALE)


if __name__ == "__main__":
    sys.exit(main())
