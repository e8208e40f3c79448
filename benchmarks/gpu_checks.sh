#!/usr/bin/env bash
# The GPU checks and GPU figures in one script, for a short lease on a GPU machine. Nothing is installed: the
# package runs from the checkout through PYTHONPATH with the CUDA torch already there (megatron-core, if importable,
# adds Megatron-Core's GPU tests to the tier). Parts, each under its own time limit, the next running whatever the
# last did:
#   tier   the GPU tier (.ci/tier-gpu: the main job on CUDA, greedy identity, sampled losslessness, log-probs vs the
#          CPU, Megatron-Core's forward / backward / GRPO step on the GPU)
#   bench  `bench rollout --device cuda` on the main job's policy and MTP head, and n-gram (speculative vs plain)
#   main   the main job on CUDA for MAIN_STEPS steps (default 8), speculative then plain (`spec=null`), same seed
#   trace  the controller against plain decoding in one process (`research/adaptive_ab.py --device cuda`), each
#          step timed by kind: a fixed batch of 64 (where `bench rollout` found it at 0.86x) and the main job's shape
# Usage: [PARTS="tier bench main"] [MAIN_STEPS=8] bash benchmarks/gpu_checks.sh OUT_DIR
# Logs, JSONs and each main-job run's metrics.jsonl land in OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/gpu_checks.sh OUT_DIR}
mkdir -p "$out"
PY=${PYTHON:-python3}
PARTS=" ${PARTS:-tier bench main} "
MAIN_STEPS=${MAIN_STEPS:-8}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi -L
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

if [[ $PARTS == *" tier "* ]]; then
  echo "== GPU tier =="
  timeout 300 env PYTHON="$PY" bash .ci/tier-gpu 2>&1 | tee "$out/gpu_tier.log"
fi

if [[ $PARTS == *" bench "* ]]; then
  echo "== bench rollout on the GPU =="
  # Two warm RL rollouts, not the default six: a GPU step here is ~6 ms of launches, and the part must fit 120 s.
  timeout 120 $PY -m megatron_spec.cli bench rollout --device cuda --threads 8 \
    --target checkpoints/tiny-qwen3-deep-careful --drafters mtp ngram --batch 1 8 64 --k 3 adaptive --repeats 2 \
    --rl-prompts 8 --group 8 --rl-k 3 adaptive --rl-warm 2 --out "$out/bench_rollout_gpu_tiny_deep_careful.json" 2>&1 \
    | tee "$out/bench_rollout.log"
fi

if [[ $PARTS == *" main "* ]]; then
  echo "== the main job on the GPU, $MAIN_STEPS steps, speculative then plain =="
  for spec in mtp plain; do
    extra=(); [ "$spec" = plain ] && extra=(spec=null)
    timeout $((60 + 6 * MAIN_STEPS)) $PY recipes/tiny_grpo_spec.py run.device=cuda run.steps="$MAIN_STEPS" \
      run.report=false run.out_dir="/tmp/main_job_$spec" "${extra[@]}" 2>&1 | grep -v '^{' | tail -n 8
    cp "/tmp/main_job_$spec/metrics.jsonl" "$out/main_job_gpu_$spec.jsonl" 2>/dev/null
  done
fi

if [[ $PARTS == *" trace "* ]]; then
  echo "== the controller traced on the GPU =="
  timeout 120 $PY research/adaptive_ab.py --device cuda --threads 8 --rounds 4 --prompts 64 --samples 1 \
    --max-tokens 64 --ignore-eos --out "$out/adaptive_ab_gpu_b64.json" 2>&1 | tail -n 40
  timeout 120 $PY research/adaptive_ab.py --device cuda --threads 8 --rounds 4 \
    --out "$out/adaptive_ab_gpu_main_shape.json" 2>&1 | tail -n 40
fi
