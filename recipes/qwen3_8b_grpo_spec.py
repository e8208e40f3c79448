"""GRPO on Qwen3-8B with EAGLE-3 speculative rollouts (k=3): the reference system's setting, at scale.

Recommended: 4 nodes x 8 H100 (32 GPUs, as the reference's 32 GB200), colocated. Megatron-Core TP2 PP1 CP1
(DP16: 8B in bf16 with its optimizer state fits 2-way TP with room for 8K-token rollouts); vLLM TP1, 32 engines
(16 GB of weights per GPU leaves most of the 80 GB for KV cache), `spec.vllm()` as vLLM's `speculative_config`;
Ray places one trainer and one generator worker per GPU. The config selects exactly that (`SCALE.backend`:
`backend.trainer=megatron`, `backend.generator=vllm`, colocated), with engines serving a prompt of up to 1024 tokens
plus the 8192 of a rollout. The prompts are DAPO-Math-17k's, scored by math-verify, with groups of equal rewards
left out of the update (DAPO's dynamic sampling); the EAGLE-3 drafter is RedHat's public head for Qwen3-8B
(speculators layout), trained online during RL. Both are hub names, resolved where the job runs.

Running needs `pip install -e .[megatron,vllm,ray]` on the cluster: submit with `--executor ray-slurm`;
`--dryrun` works anywhere. `--tune` replaces this layout by the tuner's best for `--nodes` x `--gpus-per-node`
GPUs of kind `--gpu` (`megatron-spec tune`), and prints it with the predicted stage times.
"""

import sys

from megatron_spec.layout import Layout
from megatron_spec.rl.config import DrafterTrainSection, GRPOSection, ModelSection, RLConfig, RunSection
from megatron_spec.rl.data_config import DataSection
from megatron_spec.drafters.config import SpecConfig
from recipes._common import Scale, recipe_main

SCALE = Scale(nodes=4, gpus_per_node=8, parallel=Layout(tp=2, etp=1, engine=Layout(tp=1, etp=1)), time="04:00:00")

DRAFTER = "RedHatAI/Qwen3-8B-speculator.eagle3"
"""A public EAGLE-3 head for the policy, by hub name (resolved into `model.hub_cache` where the job runs), trained
online during RL."""
DATA = "BytedTsinghua-SIA/DAPO-Math-17k"
"""DAPO's math prompts (chat messages, integer answers scored by math-verify), by hub name."""
MAX_TOKENS = 8192
PROMPT_TOKENS = 1024


def qwen3_8b_grpo_spec() -> RLConfig:
    """64 prompts x 16 rollouts of up to 8K tokens per step, DAPO's asymmetric clip, no KL."""
    return RLConfig(
        model=ModelSection(policy="Qwen/Qwen3-8B", drafter=DRAFTER, task="natural"),
        grpo=GRPOSection(prompts_per_step=64, group_size=16, max_tokens=MAX_TOKENS, lr=1e-6, clip_high=0.28,
                         drop_uniform_groups=True),
        data=DataSection(path=DATA, format="dapo", max_prompt_tokens=PROMPT_TOKENS),
        # the head trains on a row or 8192 positions a step (whose states and draft-vocabulary logits its rank
        # receives), unrolled over each of its k = 3 drafts
        drafter_train=DrafterTrainSection(max_tokens=8192, agreement=False, drafts=3),
        spec=SpecConfig("eagle3", num_speculative_tokens=3, model=DRAFTER),
        run=RunSection(steps=500, out_dir="runs/qwen3_8b", save_every=20, save_every_s=1800, dataset_size=17_000, eval_prompts=30,
                       eval_every=20, threads=8),
        backend=SCALE.backend(max_model_len=PROMPT_TOKENS + MAX_TOKENS),
    )


def main(argv: list[str] | None = None) -> int:
    return recipe_main(qwen3_8b_grpo_spec, argv, scale=SCALE)


if __name__ == "__main__":
    sys.exit(main())
