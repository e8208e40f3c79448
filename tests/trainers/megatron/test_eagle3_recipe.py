"""The tiny recipe with `backend.trainer=megatron` and `spec.method=eagle3`: the EAGLE-3 head learns online through
the Megatron trainer and the generator drafts with what it learnt (the head reaches it in the refit stream every
step); a frozen control (`drafter_train.online=false`) does not.

Policy checkpoints/tiny-qwen3, 5 steps of 4 prompts x 8 rollouts (up to 64 tokens), one process (world size 1).
The head is a fresh one made by the registry (`train-drafter`'s init: the target's output rows, the rest random)
and trained at lr 3e-3: the shipped checkpoints/tiny-qwen3-eagle3 already agrees with the policy on ~90 % of
first drafts, so 5 steps of it online move its agreement by less than the step-to-step noise of the batches
(measured with the recipe's adaptive k: 0.90, 0.91, 0.89, 0.90, 0.89 online against 0.90, 0.91, 0.90, 0.92, 0.90
frozen). A fresh head starts at the uniform-guess level (loss ~ln 64 = 4.2, agreement ~0.05, acceptance length
~1), far from where it can go.

Both runs share the seed and draft k=3 every step (`spec.adaptive=false`: the controller's timing-based choice of
k would make even step 0 differ), so step 0's rollouts and measurements are identical. Bounds, from one run of each
on the embedded engine (online: loss 4.73, 3.12, 2.60, 1.83, 2.28; first-draft agreement 0.054, 0.10, 0.35, 0.52,
0.38; acceptance length 1.06, 1.12, 1.35, 1.63, 1.56; frozen: agreement 0.032-0.057, acceptance 1.03-1.06) with
margins for batch noise: online, the last two steps' mean loss below 0.6 x step 0's and their mean agreement
above 4 x step 0's; the frozen control's agreement never above 2 x its step 0's (it has nothing to learn from: the
policy moves little at lr 1e-4); and the online run's last two acceptance lengths on average at least 0.2 above
the frozen run's (observed 0.56; the frozen run's own steps vary by 0.04). On vLLM the acceptance lengths were
1.05, 1.14, 1.35, 1.44, 1.33 online and 1.05, 1.05, 1.08, 1.03, 1.05 frozen (gap 0.35; vLLM's step 0 is its own
rollouts, so it differs from the embedded engine's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")

ROOT = Path(__file__).resolve().parents[3]
STEPS = 5
POLICY = "checkpoints/tiny-qwen3"


def fresh_head(out: Path) -> Path:
    import torch

    from megatron_spec.models import from_pretrained
    from megatron_spec.drafters.registry import drafter_method

    torch.manual_seed(0)
    target = from_pretrained(ROOT / POLICY)
    method = drafter_method("eagle3")
    return Path(method.save(method.new(target, None, None), out, target))


def run(out: Path, head: Path, online: bool, generator: str) -> list[dict]:
    args = [sys.executable, "recipes/tiny_grpo_spec.py", "backend.trainer=megatron", f"backend.generator={generator}",
            "spec.method=eagle3", "spec.adaptive=false", f"model.policy={POLICY}", f"model.drafter={head}",
            "model.terms_weights=[]",
            "drafter_train.drafts=1", "drafter_train.replay=1", "drafter_train.minibatches=1", "drafter_train.ema=0",
            "drafter_train.extra_groups=0",
            "drafter_train.lr=3e-3", f"drafter_train.online={str(online).lower()}", "grpo.prompts_per_step=4",
            "grpo.max_tokens=64", "grpo.drop_uniform_groups=false", "grpo.train_groups=0",
            f"run.steps={STEPS}", "run.eval_every=0", "run.save_every=100", "run.loggers=[]",
            "run.resume=false", "run.report=false", f"run.out_dir={out}"]
    done = subprocess.run(args, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def check(online: list[dict], frozen: list[dict]) -> None:
    for name, rows in (("online", online), ("frozen", frozen)):  # shown with a failure (or -s)
        print(name, [(r.get("drafter_loss"), r["drafter_agreement"][0], r["acceptance_length"]) for r in rows])
    assert len(online) == len(frozen) == STEPS
    assert online[0]["acceptance_length"] == frozen[0]["acceptance_length"]  # same seed, same head at step 0
    loss = [r["drafter_loss"] for r in online]
    agree = [r["drafter_agreement"][0] for r in online]
    assert mean(loss[-2:]) < 0.6 * loss[0], loss
    assert mean(agree[-2:]) > 4 * agree[0], agree
    assert all(r.get("drafter_loss") is None for r in frozen)  # frozen: nothing trained
    still = [r["drafter_agreement"][0] for r in frozen]
    assert max(still) <= 2 * still[0], still
    acc_on = mean(r["acceptance_length"] for r in online[-2:])
    acc_off = mean(r["acceptance_length"] for r in frozen[-2:])
    assert acc_on >= acc_off + 0.2, (acc_on, acc_off)


@pytest.mark.megatron_dist
def test_eagle3_learns_online_through_megatron_and_drafts_better(tmp_path):
    """Embedded engine as the generator."""
    head = fresh_head(tmp_path / "head")
    check(run(tmp_path / "online", head, True, "embedded"), run(tmp_path / "frozen", head, False, "embedded"))


@pytest.mark.megatron_dist
@pytest.mark.vllm
def test_eagle3_learns_online_through_megatron_and_vllm_drafts_better(tmp_path):
    """vLLM (CPU) as the generator: the head Megatron trains reaches vLLM's EAGLE-3 drafter every step."""
    pytest.importorskip("vllm")
    head = fresh_head(tmp_path / "head")
    check(run(tmp_path / "online", head, True, "vllm"), run(tmp_path / "frozen", head, False, "vllm"))


@pytest.mark.megatron_dist
def test_a_public_head_trained_through_megatron_is_checkpointed_in_its_layout(tmp_path):
    """A SpecForge-layout head (bf16, three distinct fused layers, 48-id draft vocabulary) trained online by the
    Megatron trainer for one step: the run checkpoint's `drafter/` is that layout with the trained head, as
    `tests/models/test_eagle3_public.check_run_export` states it (the head from the checkpoint's `eagle3` state,
    rounded to bf16)."""
    import torch

    from megatron_spec.models import from_pretrained
    from megatron_spec.drafters.eagle3.public import SPECFORGE
    from tests.models.test_eagle3_public import check_run_export, distinct_head, write_public

    target = from_pretrained(ROOT / POLICY)
    path = write_public(distinct_head(target), tmp_path / "public", SPECFORGE)
    config = tmp_path / "run.yaml"  # the RLConfig defaults, then the overrides below
    config.write_text("run:\n  steps: 1\n")
    args = [sys.executable, "-m", "megatron_spec.cli", "train", "--config", str(config), "backend.trainer=megatron",
            "spec.method=eagle3", "spec.adaptive=false", f"model.policy={POLICY}", f"model.drafter={path}",
            f"spec.model={path}", "drafter_train.lr=1e-2", "grpo.prompts_per_step=2", "grpo.group_size=4",
            "grpo.max_tokens=24", "run.eval_every=0", "run.save_every=1", "run.loggers=[]", "run.resume=false",
            "run.report=false", f"run.out_dir={tmp_path / 'run'}"]
    done = subprocess.run(args, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoints" / "step_000000"
    trained = torch.load(ckpt / "state.pt", weights_only=False)["state"]["eagle3"]["head"]
    check_run_export(path, ckpt / "drafter", trained, SPECFORGE, torch.bfloat16, target)
