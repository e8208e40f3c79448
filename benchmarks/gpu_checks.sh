#!/usr/bin/env bash
# The GPU checks and GPU figures in one script, for a short lease on a GPU machine. Nothing is installed: the
# package runs from the checkout through PYTHONPATH with the CUDA torch already there (megatron-core, if importable,
# adds Megatron-Core's GPU tests to the tier). Parts, each under its own time limit, the next running whatever the
# last did:
#   tier   the GPU tier (.ci/tier-gpu: the main job on CUDA, greedy identity, sampled losslessness, log-probs vs the
#          CPU, the CUDA IPC refit between two processes, the NCCL start-up path, Megatron-Core's forward / backward /
#          GRPO step on the GPU, in bf16 with the distributed optimizer and recompute); figures in gpu_scale.json
#   ipc    `benchmarks/refit_cuda_ipc.py`: a colocated refit over CUDA IPC against the gloo weight group, 2 GiB
#   bench  `bench rollout --device cuda` on the main job's policy and MTP head, and n-gram (speculative vs plain)
#   loop   the tiny MoE recipe through the RL loop with the Megatron trainer on the GPU (bf16, Megatron-Core's
#          distributed optimizer, selective recompute), 3 steps, its per-step memory in moe_megatron_gpu.jsonl
#   main   the main job on CUDA for MAIN_STEPS steps (default 8), speculative then plain (`spec=null`), same seed,
#          summarised with the whole-step ratio beside the gen stage's (main_job_gpu.json)
#   trace  the controller against plain decoding in one process (`research/adaptive_ab.py --device cuda`), each
#          step timed by kind: a fixed batch of 64 (where `bench rollout` found it at 0.86x) and the main job's shape
# Usage: [PARTS="tier bench main"] [MAIN_STEPS=8] bash benchmarks/gpu_checks.sh OUT_DIR
# Logs, JSONs and each main-job run's metrics.jsonl land in OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash benchmarks/gpu_checks.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
PY=${PYTHON:-python3}
PARTS=" ${PARTS:-tier bench main} "
MAIN_STEPS=${MAIN_STEPS:-8}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi -L
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

if [[ $PARTS == *" tier "* ]]; then
  echo "== GPU tier =="
  timeout 240 env PYTHON="$PY" MEGATRON_SPEC_GPU_RECORD="$out/gpu_scale.json" bash .ci/tier-gpu 2>&1 \
    | tee "$out/gpu_tier.log"
fi

if [[ $PARTS == *" ipc "* ]]; then
  echo "== refit over CUDA IPC vs gloo, two processes on one GPU =="
  timeout 150 $PY benchmarks/refit_cuda_ipc.py --gib 2 --out "$out/refit_cuda_ipc.json" 2>&1 | tee "$out/ipc.log"
fi

if [[ $PARTS == *" bench "* ]]; then
  echo "== bench rollout on the GPU =="
  # Two warm RL rollouts, not the default six: a GPU step here is ~6 ms of launches, and the part must fit 120 s.
  timeout 120 $PY -m megatron_spec.cli bench rollout --device cuda --threads 8 \
    --target checkpoints/tiny-qwen3-deep-careful --drafters mtp ngram --batch 1 8 64 --k 3 adaptive --repeats 2 \
    --rl-prompts 8 --group 8 --rl-k 3 adaptive --rl-warm 2 --out "$out/bench_rollout_gpu_tiny_deep_careful.json" 2>&1 \
    | tee "$out/bench_rollout.log"
fi

if [[ $PARTS == *" loop "* ]]; then
  echo "== the RL loop with the Megatron trainer on the GPU =="
  timeout 150 $PY recipes/tiny_moe_grpo_spec.py backend.trainer=megatron run.device=cuda run.steps=3 run.report=false \
    run.out_dir=/tmp/moe_megatron_gpu backend.megatron.params_dtype=bfloat16 backend.megatron.optimizer=megatron \
    backend.megatron.recompute=selective backend.megatron.mtp_num_layers=0 spec=null 2>&1 | grep -v '^{' | tail -n 12
  cp /tmp/moe_megatron_gpu/metrics.jsonl "$out/moe_megatron_gpu.jsonl" 2>/dev/null
fi

if [[ $PARTS == *" main "* ]]; then
  echo "== the main job on the GPU, $MAIN_STEPS steps, speculative then plain =="
  for spec in mtp plain; do
    extra=(); [ "$spec" = plain ] && extra=(spec=null)
    timeout $((60 + 6 * MAIN_STEPS)) $PY recipes/tiny_grpo_spec.py run.device=cuda run.steps="$MAIN_STEPS" \
      run.report=false run.out_dir="/tmp/main_job_$spec" "${extra[@]}" 2>&1 | grep -v '^{' | tail -n 8
    cp "/tmp/main_job_$spec/metrics.jsonl" "$out/main_job_gpu_$spec.jsonl" 2>/dev/null
  done
  $PY - "$out" <<'PYEOF' 2>&1 | tee "$out/main_job_gpu.txt"
import json, sys
from megatron_spec.rl.logging import read_metrics
from megatron_spec.rl.report import stage_ratios
spec, plain = read_metrics("/tmp/main_job_mtp"), read_metrics("/tmp/main_job_plain")
ratios = stage_ratios(plain, spec)
ratios["eval_accuracy"] = {k: [[m["step"], m["eval_accuracy"]] for m in rows if m.get("eval_accuracy") is not None]
                           for k, rows in (("spec", spec), ("plain", plain))}
print(json.dumps(ratios, indent=1))
json.dump(ratios, open(sys.argv[1] + "/main_job_gpu.json", "w"), indent=1)
PYEOF
fi

if [[ $PARTS == *" trace "* ]]; then
  echo "== the controller traced on the GPU =="
  timeout 120 $PY research/adaptive_ab.py --device cuda --threads 8 --rounds 4 --prompts 64 --samples 1 \
    --max-tokens 64 --ignore-eos --out "$out/adaptive_ab_gpu_b64.json" 2>&1 | tail -n 40
  timeout 120 $PY research/adaptive_ab.py --device cuda --threads 8 --rounds 4 \
    --out "$out/adaptive_ab_gpu_main_shape.json" 2>&1 | tail -n 40
fi
