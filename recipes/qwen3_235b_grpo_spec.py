"""GRPO on Qwen3-235B-A22B (MoE, 128 experts, top-8) with EAGLE-3 speculative rollouts (k=5) and asynchronous GRPO
(policy lag 2), at scale: the configuration of the reference's 2.5x projection.

Recommended: 16 nodes x 8 H100 (128 GPUs), disaggregated, the split that fits 80 GB a GPU by the memory audit
(`--audit`). Trainer on 64 GPUs: Megatron-Core TP2 PP8 CP1 EP8 with sequence parallelism (Megatron-Core trains MoE
layers under TP only with it; ETP1, DP4, expert-DP 1: the 128 experts 16 per rank), the distributed optimizer
(fp32 masters and moments sharded over DP) and full recompute; the 94 layers split 12 on the first stage, 10 on
the last (it also holds the output layer) and 12 on the six others (`backend.megatron.first_stage_layers` /
`last_stage_layers`, checked at import by `megatron_spec.layout`). Generation on the other 64: 8 vLLM engines of
TP8 (one node each) serving the bf16 checkpoint files, `spec.vllm()` as vLLM's `speculative_config`, running up to
two policy versions ahead of the trainer (`backend.async_lag=2`, truncated importance sampling). The config selects
exactly that (`SCALE.backend`), with engines serving a prompt of up to 1024 tokens plus the 8192 of a rollout.
256 prompts x 16 rollouts = 4096 rollouts per step, the batch of the reference's projection, of DAPO-Math-17k's
prompts scored by math-verify, groups of equal rewards left out of the update (DAPO's dynamic sampling); the
EAGLE-3 drafter is NVIDIA's public head for Qwen3-235B-A22B, trained online. Both are hub names, resolved where the
job runs. A trainer of 96 GPUs
(the other split of 128 into whole nodes) allows EP4 at most at PP8, and a stage's 7.25 B expert parameters then
fit 80 GB under no optimizer setting without offload. `--tune` picks the tuner's best runnable layout for another
allocation instead.

Projected by the simulator (H100 set calibrated on NeMo-RL's published step times; engines in bf16; response lengths
log-normal with the projection's mean and spread under the 8192 cap; drafter trained online): 2.34x over
synchronous plain decoding at k=5, the tuner's k under the assumption of an EAGLE-3 acceptance length of 4 at k=5
(per-position acceptance 0.834), and 2.34x over per-position acceptance 0.5-0.9 with the tuner's k (2-6): training
bounds the step. The step times and the sensitivity table are in the at-scale guide (docs/guide/at-scale.md);
`megatron-spec simulate ... --sensitivity` prints the table.

Running needs `pip install -e .[megatron,vllm,ray]` on the cluster: submit with `--executor ray-slurm`;
`--dryrun` works anywhere; `--rehearsal` runs this file's code path at toy width on the allocation at hand
(`recipes/rehearsal.py`).
"""

import sys

from megatron_spec.layout import Layout, check_layout
from megatron_spec.models.presets import preset
from megatron_spec.rl.config import DrafterTrainSection, GRPOSection, ModelSection, RLConfig, RunSection
from megatron_spec.rl.data_config import DataSection
from megatron_spec.drafters.config import SpecConfig
from recipes._common import Scale, recipe_main

SCALE = Scale(nodes=16, gpus_per_node=8, async_lag=2, time="04:00:00", recompute="full",
              parallel=Layout(tp=2, pp=8, cp=1, ep=8, etp=1, sequence_parallel=True, first_stage_layers=12,
                              last_stage_layers=10, engine=Layout(tp=8, etp=1), engines=8, colocated=False))
check_layout(preset("qwen3-235b-a22b"), SCALE.parallel, SCALE.nodes * SCALE.gpus_per_node - SCALE.gen_gpus,
             runnable=True)

DRAFTER = "nvidia/Qwen3-235B-A22B-Eagle3"
"""A public EAGLE-3 head for the policy, by hub name (resolved into `model.hub_cache` where the job runs), trained
online during RL."""
DATA = "BytedTsinghua-SIA/DAPO-Math-17k"
"""DAPO's math prompts (chat messages, integer answers scored by math-verify), by hub name."""
MAX_TOKENS = 8192
PROMPT_TOKENS = 1024


def qwen3_235b_grpo_spec() -> RLConfig:
    """256 prompts x 16 rollouts of up to 8K tokens per step, DAPO's asymmetric clip, no KL."""
    return RLConfig(
        model=ModelSection(policy="Qwen/Qwen3-235B-A22B", drafter=DRAFTER, task="natural"),
        grpo=GRPOSection(prompts_per_step=256, group_size=16, max_tokens=MAX_TOKENS, lr=5e-7, clip_high=0.28,
                         drop_uniform_groups=True),
        data=DataSection(path=DATA, format="dapo", max_prompt_tokens=PROMPT_TOKENS),
        # the head trains on a row or 8192 positions a step (whose states and draft-vocabulary logits its rank
        # receives) on its first draft: unrolled over more drafts it would not fit the last stage (`--audit`)
        drafter_train=DrafterTrainSection(max_tokens=8192, agreement=False),
        spec=SpecConfig("eagle3", num_speculative_tokens=5, model=DRAFTER),
        run=RunSection(steps=300, out_dir="runs/qwen3_235b", save_every=10, save_every_s=1800, dataset_size=17_000, eval_prompts=30,
                       eval_every=10, threads=8),
        # a step takes about half an hour at this size, and Megatron's ranks wait for rank 0 through one
        backend=SCALE.backend(max_model_len=PROMPT_TOKENS + MAX_TOKENS, init_timeout_s=4200.0),
    )


def main(argv: list[str] | None = None) -> int:
    return recipe_main(qwen3_235b_grpo_spec, argv, scale=SCALE)


if __name__ == "__main__":
    sys.exit(main())
