"""The tiny MoE recipe under torchrun with the Megatron trainer (EP2 on 2 gloo ranks) against the embedded trainer:
the issue's "done" command, 2 steps each (~1 minute each on 2 cores).

Same checkpoints, seed and prompts, so step 0's rollouts are identical (the generator starts from the same
weights); then:
- grad norm and the MTP head's loss equal to rel 1e-4: the GRPO gradient is the same sum in another order, and
  the jointly trained Megatron MTP layer computes the embedded drafter's soft cross-entropy;
- the loss equal within 1e-3: its GRPO part is equal, its MoE load-balancing part (router_aux_loss_coef 1e-3 x
  4 layers x a Switch loss of ~1 each: ~4e-3) is a statistic of each micro-batch's tokens, and EP's data-parallel
  ranks cut the batch into other micro-batches than the embedded length buckets (observed difference 3.3e-4);
- acceptance length above 2 on every step, from the MTP head exported by Megatron into the generator each step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")

pytestmark = pytest.mark.megatron_dist

ROOT = Path(__file__).resolve().parents[3]
RECIPE = "recipes/tiny_moe_grpo_spec.py"
STEPS = 2


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_torchrun_megatron_ep2_matches_the_embedded_trainer(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", RECIPE,
                "backend.trainer=megatron", "backend.megatron.ep=2"]
    out_m, out_e = tmp_path / "megatron", tmp_path / "embedded"
    common = [f"run.steps={STEPS}", "run.resume=false", "run.report=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for args, out in (([sys.executable, RECIPE], out_e), (torchrun, out_m)):
        done = subprocess.run([*args, *common, f"run.out_dir={out}"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    emb, meg = metrics(out_e), metrics(out_m)
    assert len(emb) == len(meg) == STEPS
    e, m = emb[0], meg[0]
    assert m["reward_mean"] == e["reward_mean"] and m["acceptance_length"] == e["acceptance_length"]
    assert m["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-4)
    assert m["drafter_loss"] == pytest.approx(e["drafter_loss"], rel=1e-4)
    assert abs(m["loss"] - e["loss"]) <= 1e-3
    assert m["moe_aux_loss"] > 0 and m["loss"] == pytest.approx(m["grpo_loss"] + m["moe_aux_loss"], rel=1e-9)
    assert all(r["acceptance_length"] > 2 for r in meg)
