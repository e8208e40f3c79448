#!/usr/bin/env bash
# Issue 4, "losslessness at the RL level": every run, report and summary behind the section of that name in
# research/notebook/README.md. Runs one after another (each ~0.5-8 min on 2 shared CPU cores); outputs go to runs/lossless/.
#   bash research/lossless/run_all.sh            # seeds 0-7
#   SEEDS="0 1 2 3" bash research/lossless/run_all.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export MEGATRON_SPEC_NO_PROGRESS=1
SEEDS=${SEEDS:-"0 1 2 3 4 5 6 7"}
R=runs/lossless
mkdir -p $R/logs

run() {  # run NAME OVERRIDES...: the recipe, with every rollout's tokens recorded, timed
  local name=$1; shift
  local t0=$(date +%s.%N)
  python research/lossless/record_rollouts.py "$@" > $R/logs/$name.log 2>&1
  echo "$name $(python -c "import time; print(round(time.time() - $t0, 1))") s" | tee -a $R/logs/walltimes.txt
}

# Speculative runs pin k=3 (spec.adaptive=false): the recipe's adaptive controller would keep speculation off at
# the tiny model's batch of 64, where it does not pay, and the comparison would then test nothing.
# Greedy rollouts, 10 steps: plain and speculative must match exactly.
run greedy_plain_s0 run.steps=10 run.seed=0 grpo.temperature=0 run.out_dir=$R/greedy/plain_s0 spec=null
run greedy_spec_s0  run.steps=10 run.seed=0 grpo.temperature=0 run.out_dir=$R/greedy/spec_s0 spec.adaptive=false
python research/lossless/compare_runs.py $R/greedy/plain_s0 $R/greedy/spec_s0 --json $R/greedy_pair_s0.json

# Sampled rollouts (recipe temperature 1.0), 30 steps, plain and speculative per seed.
for s in $SEEDS; do
  run sampled_plain_s$s run.steps=30 run.seed=$s run.out_dir=$R/sampled/plain_s$s spec=null
  run sampled_spec_s$s  run.steps=30 run.seed=$s run.out_dir=$R/sampled/spec_s$s spec.adaptive=false
done
python research/lossless/summarize.py $R/sampled --seeds "$(echo $SEEDS | tr ' ' ,)" --json $R/sampled_summary.json

# Reports: sampled and greedy runs apart (the report pools every plain run into one band).
first=$(echo $SEEDS | cut -d' ' -f1)
others=$(for s in $SEEDS; do [ $s = $first ] || echo $R/sampled/plain_s$s; done
         for s in $SEEDS; do echo $R/sampled/spec_s$s; done)
megatron-spec report $R/sampled/plain_s$first --compare $others --out $R/report/report.html
megatron-spec report $R/greedy/plain_s0 --compare $R/greedy/spec_s0 --out $R/report_greedy/report.html
