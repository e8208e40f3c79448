"""The Megatron trainer at scale, on 2 gloo ranks: sharded load from the HF files, bf16 with fp32 masters,
distributed checkpoints that resume at another layout, and an interrupted save.

Tolerances of the resume tests are `test_policy.py`'s (fp32; loss, clip fraction, grad norm rel 1e-5; weights
|diff| <= 2 x lr x steps and mean |diff| <= 1e-6), for the same reasons: the resumed run computes the same sums
at another layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")

from . import scale_workers as w  # noqa: E402
from .test_policy import REL, W_MAX, W_MEAN, close_weights, same_metrics  # noqa: E402

pytestmark = pytest.mark.megatron_dist


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    from megatron_spec.trainers.megatron.parallel import spawn

    return spawn(w.sharded_load, 2, str(tmp_path_factory.mktemp("load")))


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
@pytest.mark.parametrize("kind, layout", [(k, n) for k, ls in w.LOAD_LAYOUTS.items() for n in ls])
def test_sharded_load_equals_full_load_bitwise(loads, dtype, kind, layout):
    """Each rank's parameters read slice by slice from the (multi-file) safetensors equal, bit for bit, those cut
    from the full tensors in memory: policy and 2 MTP layers, TP2 (QKV groups, gate/up chunks, padded vocab rows,
    row-split columns), PP2 (stage offsets), EP2 (each rank its experts)."""
    for rank in loads:
        files, memory = rank[dtype, kind, layout]
        assert sorted(files) == sorted(memory)
        different = [n for n in files if not torch.equal(files[n], memory[n])]
        assert not different, different[:3]


@pytest.fixture(scope="module")
def precision():
    from megatron_spec.trainers.megatron.parallel import spawn

    return spawn(w.bf16_vs_fp32, 1)[0]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bf16_training_tracks_fp32(precision, kind):
    """3 steps in bf16 (fp32 masters) against fp32, from the same weights and batches.

    - The parameters are bf16 and equal to their fp32 masters rounded to bf16, exactly: the update lives in
      the masters, the model computes with their rounding.
    - Log-probs before each step: bf16 keeps 8 significant bits (relative rounding <= 2^-9 per op); the logits of
      these 2-layer models are O(1), so each carries an error of a few 1e-3 after some tens of rounded ops, and a
      log-softmax over 96 tokens at most doubles it: |diff| <= 0.05 bounds it with margin, while a wrong update
      (a missing master, a sign error) moves the step-3 log-probs by ~0.1-1.
    - Masters after 3 steps: Adam moves each element by about lr per step whatever the gradient's size, so bf16
      gradients change an element's path only where the gradient's sign flips under rounding: |diff| <= 2 x lr x
      3 (the worst case) and the mean |diff| <= lr / 4 (most signs agree; a lost update would give ~lr).
    """
    fp32, bf16 = precision[kind, "float32"], precision[kind, "bfloat16"]
    for n, p in bf16["params"].items():
        assert p.dtype == torch.bfloat16 and bf16["masters"][n].dtype == torch.float32
        assert torch.equal(p, bf16["masters"][n].to(torch.bfloat16)), n
    for a, b in zip(fp32["logprobs"], bf16["logprobs"]):
        assert (a - b).abs().max() <= 0.05
    lr = 1e-3
    diffs = torch.cat([(fp32["masters"][n] - bf16["masters"][n]).abs().flatten() for n in fp32["masters"]])
    assert diffs.max() <= 2 * lr * 3
    assert diffs.mean() <= lr / 4
    moved = torch.cat([(fp32["masters"][n] - fp32["params"][n]).abs().flatten() for n in fp32["masters"]])
    assert moved.max() == 0  # fp32: the masters are the parameters themselves
    for m in bf16["metrics"]:
        assert m["skipped"] is False and torch.isfinite(torch.tensor(m["loss"]))


def test_recompute_reruns_what_it_names_and_changes_nothing():
    """`recompute=full` runs each decoder layer's forward again in the backward (2 steps x 2 micro-batches: 4
    forwards without, 8 with), `selective` only the core attention; the losses and gradient norms are the same
    to the last bit (the recomputed forward is the same function of the same inputs, dropout being 0)."""
    from megatron_spec.trainers.megatron.parallel import spawn

    runs = spawn(w.recompute_runs, 1)[0]
    none, selective, full = runs["none"], runs["selective"], runs["full"]
    assert none["calls"] == {"layer": 4, "core_attention": 4}
    assert selective["calls"] == {"layer": 4, "core_attention": 8}
    assert full["calls"] == {"layer": 8, "core_attention": 8}
    for other in (selective, full):
        for a, b in zip(none["metrics"], other["metrics"]):
            assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])


def test_token_budget_micro_batches_equal_full_padding_with_fewer_pads():
    """PP2 and DP2 (micro-batches in lockstep): packed by token budget, each padded only to its own longest row,
    against every row padded to the batch's length. Padding sits after a row's last token, which a causal model
    never reads back, and carries no loss; the GRPO sums are the same terms grouped otherwise (and at PP2 spread
    over several schedule calls, whose 1 / calls weighting `run_schedule` undoes). So loss, grad norm, clip fraction
    and the weights after 2 steps agree to `test_policy.py`'s fp32 tolerances (rel 1e-5; weights |diff| <= 2 x lr x
    steps, mean <= 1e-6), while the padded positions drop: rows of 5-12 tokens padded to 12 leave 28 positions
    empty, the packing (24-token budget) 5 at PP2 and 12 at DP2 (each rank's half of a slot padded to its longest)."""
    from megatron_spec.trainers.megatron.parallel import spawn

    for rank in spawn(w.packed_vs_padded, 2):
        for layout in ("pp2", "dp2"):
            packed, padded = rank[layout, True], rank[layout, False]
            for a, b in zip(padded["metrics"], packed["metrics"]):
                same_metrics(a, b)
                assert b["pad_tokens"] <= a["pad_tokens"] / 2, (layout, a["pad_tokens"], b["pad_tokens"])
            for a, b in zip(padded["weights"], packed["weights"]):
                close_weights(a, b)


@pytest.fixture(scope="module")
def resumes(tmp_path_factory):
    from megatron_spec.trainers.megatron.parallel import spawn

    return spawn(w.dist_resume, 2, str(tmp_path_factory.mktemp("resume")))


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_distributed_checkpoint_resumes_at_another_layout(resumes, kind):
    """MoE + MTP saved at EP2, resumed at PP2; dense saved at PP2, resumed at TP2: the 2 steps after the resume
    equal steps 3-4 of the uninterrupted run (metrics and weights, `test_policy.py`'s tolerances), so weights,
    both Adam moments, the step count and the MTP layers all came back through the resharding."""
    for rank in resumes:
        straight, resumed = rank[kind, "straight"], rank[kind, "resumed"]
        keys = ("loss", "grad_norm", "clip_frac") + (("drafter_loss",) if kind == "moe" else ())
        for a, b in zip(straight["metrics"][2:], resumed["metrics"]):
            same_metrics(a, b, keys)
        for a, b in zip(straight["weights"][2:], resumed["weights"]):
            close_weights(a, b)


def test_bf16_distributed_checkpoint_resumes_exactly(resumes):
    """bf16 parameters with fp32 masters, saved and resumed at the same layout: steps 3-4 equal the uninterrupted
    run's bit for bit (metrics and exported weights), so the fp32 masters (not their bf16 rounding) and both fp32
    moments were saved and restored."""
    for rank in resumes:
        straight, resumed = rank["moe_bf16", "straight"], rank["moe_bf16", "resumed"]
        for a, b in zip(straight["metrics"][2:], resumed["metrics"]):
            assert {k: v for k, v in a.items() if k != "memory"} == {k: v for k, v in b.items() if k != "memory"}
        for a, b in zip(straight["weights"][2:], resumed["weights"]):
            assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_distributed_checkpoint_is_written_by_every_rank(resumes):
    """Both ranks wrote a shard file of their own (torch_dist names them __<rank>_<n>.distcp) and neither holds
    the whole state: each file is at most 70 % of the shard bytes (an even split is 50 %; the replicated norms
    and router are written once, by one rank)."""
    for kind in ("moe", "dense"):
        files = resumes[0][kind, "files"]
        shards = {n: b for n, b in files.items() if n.endswith(".distcp")}
        assert {n.split("_")[2] for n in shards} == {"0", "1"}, files
        total = sum(shards.values())
        assert max(shards.values()) <= 0.7 * total, shards


def test_distributed_save_stages_no_copy_of_the_state(tmp_path):
    """Megatron-Core's writer clones every host tensor that is a view before writing; the SwiGLU weights' gate and
    up halves (and their Adam moments) are views, so, left as they are, a save stages a copy of two thirds of
    every MLP's state (here well over a tenth of the rank's state; all but the attention, norms, router and
    embeddings). As `save_sharded` hands them over (whole-storage aliases of the same memory) nothing is copied."""
    from megatron_spec.trainers.megatron.parallel import spawn

    for rank in spawn(w.save_copies, 2, str(tmp_path)):
        assert rank["copied"] == 0
        assert rank["copied_with_views"] > 0.1 * rank["state_bytes"]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    from megatron_spec.trainers.megatron.parallel import spawn

    return spawn(w.interrupted_save, 2, str(tmp_path_factory.mktemp("interrupted")))


def test_interrupted_save_leaves_previous_checkpoint_loadable(interrupted):
    """The save of step 1 failed after the shards were written: `latest` still names step 0, no step-1
    directory exists (only its temporary name is gone too), and a policy at another layout (PP2, saved at EP2)
    loads exactly step 0's weights from it."""
    for rank in interrupted:
        assert rank["failed"] is True
        W = rank["at_step0"]
        assert sorted(W) == sorted(rank["loaded"])
        assert all(torch.equal(W[n], rank["loaded"][n]) for n in W)
    assert interrupted[0]["step"] == 0
    assert interrupted[0]["listing"] == ["latest", "step_000000"]


def test_export_hf_streams_the_distributed_checkpoint(interrupted, tmp_path_factory):
    """`export-hf` on the step-0 checkpoint (written at EP2 by 2 ranks): the policy's HF tensors and the MTP layer
    as a drafter directory equal, bit for bit, what the trainer's own exporter gathered at step 0 (the fp32
    weights), in shards of at most the asked-for size; both load with our loaders."""
    from megatron_spec.trainers.megatron.hf_export import export_checkpoint
    from megatron_spec.models import from_pretrained
    from megatron_spec.drafters.files import load_drafter
    from megatron_spec.models.hf_io import load_tensors

    from .common import tiny

    run_dir = Path(interrupted[0]["run_dir"])
    out = tmp_path_factory.mktemp("export") / "hf"
    export_checkpoint(run_dir / "checkpoints" / "step_000000", out, max_shard_bytes=40_000)
    W = interrupted[0]["at_step0"]
    policy = load_tensors(out)
    drafter = load_tensors(out / "drafter")
    assert sorted(policy) == sorted(n for n in W if not n.startswith("drafter."))
    assert sorted("drafter." + n for n in drafter) == sorted(n for n in W if n.startswith("drafter."))
    assert all(torch.equal(policy[n], W[n]) for n in policy)
    assert all(torch.equal(drafter[n], W["drafter." + n]) for n in drafter)
    shards = list(out.glob("*.safetensors"))
    assert len(shards) > 1
    largest_tensor = max(t.numel() * t.element_size() for t in policy.values())
    assert all(f.stat().st_size <= max(40_000, largest_tensor) + 10_000 for f in shards)  # + header
    cfg = tiny("moe")
    assert from_pretrained(out).config.num_experts == cfg.num_experts
    assert load_drafter(out / "drafter", cfg).mtp_config.num_layers == 1


def test_loop_with_megatron_trainer_never_loads_the_full_policy(tmp_path):
    """The tiny MoE recipe under torchrun, Megatron EP2 on 2 gloo ranks, 1 step, with every `from_pretrained` in
    the ranks recorded: neither rank loads a full model (the trainer's shards come from the files; the embedded
    generator loads its copy in a process of its own, a child of rank 0 without torchrun's rank variables). The
    step's metrics carry each rank's peak RSS (above the 100 MB an importing Python with torch and megatron-core
    holds, below 8 GB), rank 0's trainer peak is at most the loop process's peak of the same step, and the
    generator's process is among the loop's children, holding the model it generates with."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    logs = tmp_path / "loads"
    logs.mkdir()
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(Path(__file__).with_name("count_loads.py")),
           "recipes/tiny_moe_grpo_spec.py", "backend.trainer=megatron", "backend.megatron.ep=2", "run.steps=1",
           "run.resume=false", "run.report=false", "run.eval_every=0", f"run.out_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOAD_LOG": str(logs)}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loads = {f.name: f.read_text().splitlines() for f in logs.iterdir()}
    assert loads == {"rank0.txt": [], "rank1.txt": []}
    m = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["memory"]
    assert len(m["trainer_peak_rss_mb"]) == 2
    assert all(100 < x < 8192 for x in m["trainer_peak_rss_mb"])
    assert m["trainer_peak_rss_mb"][0] <= m["loop_peak_rss_mb"]
    assert any(x > 100 for x in m["children_peak_rss_mb"])


def test_megatron_optimizer_is_refused_without_cuda():
    """Megatron-Core's distributed optimizer needs CUDA: on a machine without it the policy refuses before any
    process group or parameter exists, naming the CPU alternative."""
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy

    from .common import tiny
    from .policy_workers import SAMPLING, grpo, our_model

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(NotImplementedError, match="needs CUDA; on the CPU use optimizer=torch"):
        MegatronPolicy(our_model(tiny("dense")), grpo(), SAMPLING, Parallelism(), optimizer="megatron")
