"""GPU tier: Megatron-Core's own forward and backward on CUDA (run on an H200 with megatron-core 0.16.1; the
Transformer Engine spec when TE is installed, else the local spec), one process.

- fp32 (TF32 off): Megatron-Core's policy and MTP logits equal our CausalLM and MTP drafter on the same weights
  to 1e-4 (GPU kernels reorder sums; the CPU tier checks 1e-5 with the local spec); 2e-3 with Transformer Engine,
  whose GEMMs may use TF32.
- bf16: the same comparison against our fp32 model on the bf16-rounded weights. Stated tolerance: mean |diff| <=
  2 % of mean |logit|, max |diff| <= 10 % of max |logit|, and the same argmax for >= 95 % of positions. bf16 keeps
  8 mantissa bits (~0.4 % per rounding) and errors add up over 4 layers; the max bound is loose because a near-tie
  in MoE routing can pick a different expert in bf16.
- training only the MTP layers (detached trunk, detached embedding and head) leaves every trunk parameter without a
  gradient and bitwise unchanged after an optimizer step, while every MTP parameter learns.
- a GRPO step of `MegatronPolicy` on the GPU equals the embedded trainer's (loss, grad norm, weights).
- import -> export is bitwise on the GPU spec too (TE fuses the pre-attention / pre-MLP norms into the next linear,
  so this checks those names).
- Megatron-Core's distributed optimizer with MTP layers (bf16): the MTP layers step at `drafter_lr`, and the
  policy's update equals the run without MTP layers (they are clipped apart); its checkpoint (`save_sharded` /
  `load_sharded`) restores masters, moments and step exactly, and the next step equals the uninterrupted one.

Without CUDA every test skips and says why.
"""

from __future__ import annotations

import os

import pytest
import torch

from .common import MTP_LAYERS, hf_tensors, reference_logits, tiny, token_ids

if not torch.cuda.is_available():
    print("\nSKIP tests/trainers/megatron/test_gpu.py: needs CUDA (Megatron-Core's forward/backward run on a GPU)")
    pytest.skip("needs CUDA: Megatron-Core's forward/backward tier runs on a GPU (H100/H200)", allow_module_level=True)
pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e .[megatron]")


def gpu_cfg(kind: str):
    """Larger than the CPU tier so bf16 error has room to show, still seconds on one GPU. Vocab 1000 is padded."""
    return tiny(kind, vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, head_dim=32, intermediate_size=512, max_position_embeddings=256,
                **(dict(num_experts=8, moe_intermediate_size=128) if kind == "moe" else {}))


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    """The trainer's own start-up path (`process_groups.start_process_group`, as torchrun ranks and Ray actors
    start): NCCL on the GPU, its proving all-reduce on the device."""
    import torch.distributed as dist

    from megatron_spec.trainers.megatron.parallel import destroy_model_parallel
    from megatron_spec.distributed.process_groups import free_port, start_process_group

    backend = start_process_group(0, 1, 0, "127.0.0.1", free_port(), timeout_s=120.0)
    record("nccl_start_up", backend=backend, device=str(torch.cuda.current_device()),
           gpu=torch.cuda.get_device_name())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield backend
    destroy_model_parallel()
    dist.destroy_process_group()


def record(key: str, **figures) -> None:
    """Add `figures` under `key` to the JSON file named by MEGATRON_SPEC_GPU_RECORD (the GPU checks' record)."""
    path = os.environ.get("MEGATRON_SPEC_GPU_RECORD")
    if not path:
        return
    import json

    data = json.loads(open(path).read()) if os.path.exists(path) else {}
    data[key] = figures
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=float)


@pytest.mark.gpu
def test_start_up_path_forms_an_nccl_group_on_the_device(one_rank):
    """World size 1 through the start-up path: the backend is NCCL and a collective on the GPU answers (a host
    tensor sent to NCCL is what used to crash start-up)."""
    import torch.distributed as dist

    from megatron_spec.distributed.process_groups import collective_device

    assert one_rank == "nccl" and dist.get_backend() == "nccl"
    x = torch.full((4,), 3.0, device=collective_device("nccl"))
    dist.all_reduce(x)
    assert x.device.type == "cuda" and x.tolist() == [3.0] * 4


def build(cfg, hf, dtype):
    from megatron_spec.trainers.megatron.importer import import_hf
    from megatron_spec.trainers.megatron.parallel import Parallelism, init_model_parallel
    from megatron_spec.trainers.megatron.provider import build_model

    init_model_parallel(Parallelism(), cfg)
    model = build_model(cfg, Parallelism(), mtp_num_layers=MTP_LAYERS, dtype=dtype, init=False)
    assert [n for n, p in model.named_parameters() if not p.is_cuda] == []
    import_hf(model, {n: t.to(dtype) for n, t in hf.items()})
    return model


def megatron_logits(model, ids):
    from megatron_spec.trainers.megatron.forward import detached_mtp_logits

    model.eval()
    with torch.no_grad():
        policy, mtp = detached_mtp_logits(model, ids.cuda())
    return policy.float().cpu(), [m.float().cpu() for m in mtp]


def fp32_tolerance() -> float:
    from megatron_spec.trainers.megatron.provider import have_transformer_engine

    # Plain torch honours allow_tf32=False; Transformer Engine's GEMMs may still use TF32 (10-bit mantissa).
    return 2e-3 if have_transformer_engine() else 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fp32_logits_equal_ours(kind):
    cfg = gpu_cfg(kind)
    hf, ids = hf_tensors(cfg), token_ids(cfg, batch=2, length=64)
    policy, mtp = megatron_logits(build(cfg, hf, torch.float32), ids)
    ref_policy, ref_mtp = reference_logits(cfg, hf, ids)
    tol = fp32_tolerance()
    torch.testing.assert_close(policy, ref_policy, rtol=tol, atol=tol)
    for ours, theirs in zip(ref_mtp, mtp):
        torch.testing.assert_close(theirs[:, : ours.shape[1]], ours, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bf16_logits_agree_with_ours_within_stated_tolerance(kind):
    cfg = gpu_cfg(kind)
    hf, ids = hf_tensors(cfg), token_ids(cfg, batch=2, length=64)
    rounded = {n: t.to(torch.bfloat16).float() for n, t in hf.items()}
    policy, mtp = megatron_logits(build(cfg, rounded, torch.bfloat16), ids)
    ref_policy, ref_mtp = reference_logits(cfg, rounded, ids)
    pairs = [(policy, ref_policy)] + [(theirs[:, : ours.shape[1]], ours) for ours, theirs in zip(ref_mtp, mtp)]
    for got, want in pairs:
        diff = (got - want).abs()
        print(f"bf16 {kind}: mean|diff| {diff.mean():.4g} vs mean|logit| {want.abs().mean():.4g}, "
              f"max|diff| {diff.max():.4g} vs max|logit| {want.abs().max():.4g}")
        assert diff.mean() <= 0.02 * want.abs().mean()
        assert diff.max() <= 0.10 * want.abs().max()
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_training_only_mtp_leaves_trunk_gradients_untouched(kind):
    from megatron_spec.trainers.megatron.forward import detached_mtp_logits, mtp_loss

    cfg = gpu_cfg(kind)
    model = build(cfg, hf_tensors(cfg), torch.bfloat16)
    model.train()
    ids = token_ids(cfg, batch=2, length=64).cuda()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    policy, mtp = detached_mtp_logits(model, ids)
    loss = mtp_loss(policy, mtp, ids, soft=True)
    loss.backward()
    trunk = {n: p for n, p in model.named_parameters() if not n.startswith("mtp.")}
    drafter = {n: p for n, p in model.named_parameters() if n.startswith("mtp.")}
    assert [n for n, p in trunk.items() if p.grad is not None] == []
    assert [n for n, p in drafter.items() if p.grad is None or not p.grad.any()] == []
    # Adam's first step moves every element with a gradient by ~lr whatever the gradient's size, so each MTP
    # tensor visibly changes in bf16 (an SGD step of lr x a small gradient, e.g. a rarely routed expert's, can
    # round back to the same bf16 value).
    torch.optim.Adam([p for p in model.parameters() if p.grad is not None], lr=1e-2).step()
    assert [n for n, p in trunk.items() if not torch.equal(p, before[n])] == []
    assert all(not torch.equal(p, before[n]) for n, p in drafter.items() if p.dim() > 1)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_gpu_spec_round_trip_is_bitwise(kind):
    from megatron_spec.trainers.megatron.exporter import export_hf

    cfg = gpu_cfg(kind)
    hf = {n: t.to(torch.bfloat16) for n, t in hf_tensors(cfg).items()}
    out = {n: t.cpu() for n, t in export_hf(build(cfg, hf, torch.bfloat16), bucket_bytes=1 << 20)}
    assert sorted(out) == sorted(hf)
    assert [n for n in hf if not torch.equal(out[n], hf[n])] == []


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_megatron_grpo_step_matches_the_embedded_trainer(kind):
    """One `MegatronPolicy` step on the GPU (fp32, TF32 off) against the embedded trainer on the CPU, same weights
    and batch (the CPU tier's 2-step scenario, first step): loss and grad norm to rel 1e-4 (GPU kernels reorder
    sums; the CPU tier holds 1e-5), 2e-3 with Transformer Engine (TF32 GEMMs); weights after the update within
    2 x lr (Adam's sign-like first step)."""
    from megatron_spec.trainers.megatron.parallel import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy
    from megatron_spec.trainers.embedded import EmbeddedPolicy

    from . import policy_workers as w

    cfg = tiny(kind)
    b = w.batches(cfg, 1)[0]
    ref = EmbeddedPolicy(w.our_model(cfg), w.grpo(), w.SAMPLING)
    want = ref.train_step(w.with_policy_old(b, None))
    policy = MegatronPolicy(w.our_model(cfg), w.grpo(), w.SAMPLING, Parallelism())
    assert [n for n, p in policy.model.named_parameters() if not p.is_cuda] == []
    got = policy.train_step(w.with_policy_old(b, None))
    tol = 1e-4 if fp32_tolerance() == 1e-4 else 2e-3
    assert got["loss"] == pytest.approx(want["loss"], rel=tol)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=tol)
    exported = {n: t.cpu() for n, t in policy.export_weights()}
    for n, t in ref.model.state_dict().items():
        assert (exported[n] - t).abs().max() <= 2 * w.grpo().lr, n


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bf16_distributed_optimizer_recompute_step_tracks_the_fp32_cpu_step(kind):
    """3 GRPO steps of `MegatronPolicy` on the GPU in bf16, with Megatron-Core's distributed optimizer (fp32 grad
    buffers and fp32 sharded masters) and selective recompute, against the embedded trainer in fp32 on the CPU
    (which the CPU tier holds equal to the fp32 Megatron step to 1e-5), same weights and batches. Bounds, as
    `test_at_scale.py`'s bf16-vs-fp32 test reasons them for these 2-layer models:

    - log-probs before each step: |diff| <= 0.05 (8 significant bits per op, O(1) logits, some tens of ops);
    - loss: within 0.05 x mean |advantage| + 1e-3 (each ratio is exp of a log-prob difference <= 0.05);
    - weights after 3 steps: Adam moves each element by about lr a step, so |diff| <= 2 x lr x 3 plus one bf16
      spacing of the weight (|w| x 2^-7), and the mean |diff| <= lr / 4 plus the mean half-spacing; a lost or
      doubled update gives ~lr per element everywhere.
    The trainer's peak device memory is recorded from the step's own metrics."""
    from megatron_spec.trainers.megatron.parallel import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy
    from megatron_spec.trainers.embedded import EmbeddedPolicy

    from . import policy_workers as w

    cfg = tiny(kind)
    steps = w.batches(cfg, 3)
    ref = EmbeddedPolicy(w.our_model(cfg), w.grpo(), w.SAMPLING)
    policy = MegatronPolicy(w.our_model(cfg), w.grpo(), w.SAMPLING, Parallelism(), params_dtype="bfloat16",
                            recompute="selective", optimizer="megatron")
    assert policy.mopt is not None and [n for n, p in policy.model.named_parameters() if not p.is_cuda] == []
    lr, figures = w.grpo().lr, []
    for b in steps:
        want_lp, got_lp = ref.logprobs(b), policy.logprobs(b).float().cpu()
        want = ref.train_step(w.with_policy_old(b, want_lp))
        got = policy.train_step(w.with_policy_old(b, got_lp))
        lp_diff = float((want_lp - got_lp).abs().max())
        figures.append(dict(logprob_max_diff=lp_diff, loss=got["loss"], loss_fp32_cpu=want["loss"],
                            grad_norm=got["grad_norm"], grad_norm_fp32_cpu=want["grad_norm"], memory=got["memory"]))
        assert got["skipped"] is False
        assert lp_diff <= 0.05
        assert abs(got["loss"] - want["loss"]) <= 0.05 * float(b.advantages.abs().mean()) + 1e-3
    exported = {n: t.float().cpu() for n, t in policy.export_weights()}
    ref_weights = ref.model.state_dict()
    diffs, slack = [], []
    for n, t in ref_weights.items():
        if n not in exported:  # a tied head travels once
            continue
        d = (exported[n] - t).abs()
        assert float((d - t.abs() * 2**-7).max()) <= 2 * lr * 3, n
        diffs.append(d.flatten())
        slack.append((t.abs() * 2**-8).flatten())
    diffs, slack = torch.cat(diffs), torch.cat(slack)
    assert float(diffs.mean()) <= lr / 4 + float(slack.mean())
    peaks = figures[-1]["memory"]
    assert peaks.get("trainer_cuda_peak_allocated_mb", [0])[0] > 0
    record(f"megatron_bf16_distopt_recompute_{kind}", steps=figures, weight_max_diff=float(diffs.max()),
           weight_mean_diff=float(diffs.mean()), lr=lr, gpu=torch.cuda.get_device_name())


DRAFTER_LR = 1e-4
"""The MTP layers' learning rate in the distributed-optimizer tests: 10x below the policy's (`policy_workers.grpo`,
1e-3), so an MTP layer stepped at the policy's rate, or not at all, is plain."""


def megatron_policy(kind: str, mtp: bool):
    from megatron_spec.trainers.megatron.parallel import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy

    from . import policy_workers as w

    cfg = tiny(kind)
    return MegatronPolicy(w.our_model(cfg), w.grpo(), w.SAMPLING, Parallelism(), params_dtype="bfloat16",
                          optimizer="megatron", drafter=w.our_drafter(cfg) if mtp else None,
                          mtp_num_layers=1 if mtp else 0, drafter_lr=DRAFTER_LR)


def megatron_states(policy) -> dict[str, dict[str, torch.Tensor]]:
    """Parameter name -> its fp32 master (`param`) and Adam moments (once stepped), flat, on the host, from
    Megatron-Core's distributed optimizer (one rank holds every shard whole)."""
    named = list(policy.model.named_parameters())
    out = {}
    for sub in policy.mopt.chained_optimizers:
        for name, p in named:
            if p in sub.model_param_group_index_map:  # read without adding an (empty) state entry
                group, order = sub.model_param_group_index_map[p]
                main = sub.optimizer.param_groups[group]["params"][order]
                states = {"param": main, **sub.optimizer.state.get(main, {})}
                out[name] = {k: states[k].detach().float().cpu().clone()
                             for k in ("param", "exp_avg", "exp_avg_sq") if k in states}
    assert sorted(out) == sorted(n for n, _ in named)
    return out


def megatron_step(policy, b):
    from . import policy_workers as w

    return policy.train_step(w.with_policy_old(b, policy.logprobs(b)))


def loss_of(metrics: dict) -> float:
    return metrics.get("grpo_loss", metrics["loss"])  # MoE: without the router losses (the MTP layer has one)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_megatron_optimizer_steps_mtp_layers_at_drafter_lr_apart_from_the_policy(kind):
    """bf16, Megatron-Core's distributed optimizer, one detached MTP layer, 2 GRPO steps (the policy's clip 0.2 is
    active on step 2), against the same run without the MTP layer.

    - groups: the MTP layers' have lr = `drafter_lr` and torch's default betas, the policy's `grpo.lr` and (0.9,
      0.99);
    - step 1 moves each fp32 master by Adam's first step, lr x |g| / (|g| + 1e-8): every MTP element by at most
      1.01 x `drafter_lr` (fp32 rounding of the weight is < 1e-6 here) and the median MTP element by >= 0.9 x it
      (gradients far above 1e-8); the policy's by at most 1.01 x `grpo.lr`;
    - the policy: loss, grad norm (of the policy alone) and fp32 masters after both steps equal the run without
      MTP within what GPU accumulation-order nondeterminism leaves: loss rel 1e-5, grad norm rel 1e-4, masters
      within 0.05 x lr (step 2's Adam update mixes both steps' clipped gradients, so a clip that counted the MTP
      gradients would change the ratio of the two steps' clip factors and move masters by a sizeable part of lr),
      and the bf16 weights within one bf16 spacing (|w| x 2^-7) of each other."""
    from . import policy_workers as w

    cfg = tiny(kind)
    batches, lr = w.batches(cfg, 2), w.grpo().lr
    runs = {}
    for mtp in (False, True):
        policy = megatron_policy(kind, mtp)
        before = megatron_states(policy)
        metrics, states = [], []
        for b in batches:
            metrics.append(megatron_step(policy, b))
            states.append(megatron_states(policy))
        groups = [g for sub in policy.mopt.chained_optimizers for g in sub.optimizer.param_groups]
        runs[mtp] = dict(before=before, metrics=metrics, states=states, groups=groups,
                         weights={n: t.float().cpu() for n, t in policy.export_weights()})
        del policy
    plain, ours = runs[False], runs[True]
    mtp_groups = [g for g in ours["groups"] if g.get("is_decoupled_lr")]
    assert any(g["params"] for g in mtp_groups)
    assert all(g["lr"] == DRAFTER_LR and tuple(g["betas"]) == (0.9, 0.999) for g in mtp_groups)
    policy_groups = [g for g in ours["groups"] if not g.get("is_decoupled_lr")]
    assert all(g["lr"] == lr and tuple(g["betas"]) == (0.9, 0.99) for g in policy_groups)

    def moved(names):
        return torch.cat([(ours["states"][0][n]["param"] - ours["before"][n]["param"]).abs() for n in names])

    mtp_names = [n for n in ours["before"] if n.startswith("mtp.")]
    trunk_names = [n for n in ours["before"] if not n.startswith("mtp.")]
    assert mtp_names and sorted(trunk_names) == sorted(plain["before"])
    d_mtp, d_trunk = moved(mtp_names), moved(trunk_names)
    assert float(d_mtp.max()) <= 1.01 * DRAFTER_LR
    assert float(d_mtp.median()) >= 0.9 * DRAFTER_LR
    assert float(d_trunk.max()) <= 1.01 * lr
    figures = []
    for step, (got, want) in enumerate(zip(ours["metrics"], plain["metrics"])):
        assert got["skipped"] is False and want["skipped"] is False
        assert loss_of(got) == pytest.approx(loss_of(want), rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        assert got["drafter_loss"] > 0
        master_diff = max(float((ours["states"][step][n]["param"] - plain["states"][step][n]["param"]).abs().max())
                          for n in trunk_names)
        assert master_diff <= 0.05 * lr
        figures.append(dict(loss=loss_of(got), loss_without_mtp=loss_of(want), grad_norm=got["grad_norm"],
                            grad_norm_without_mtp=want["grad_norm"], drafter_loss=got["drafter_loss"],
                            trunk_master_max_diff=master_diff))
    for n, t in plain["weights"].items():
        d = (ours["weights"][n] - t).abs()
        assert float((d - t.abs() * 2**-7).max()) <= 0.05 * lr, n
    record(f"megatron_distopt_mtp_{kind}", steps=figures, mtp_step1_max_move=float(d_mtp.max()),
           mtp_step1_median_move=float(d_mtp.median()), drafter_lr=DRAFTER_LR, lr=lr,
           gpu=torch.cuda.get_device_name())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_megatron_optimizer_checkpoint_resumes_the_next_step(kind, tmp_path):
    """bf16, Megatron-Core's distributed optimizer, one detached MTP layer: a step, `save_sharded`, then the next
    step; a freshly built policy loads the checkpoint the way the RL loop does (`load_state_dict` of the returned
    state) and takes the same next step.

    - the load is exact: bf16 weights, fp32 masters and both Adam moments bitwise equal to the saved policy's,
      Adam's step 1, the MTP groups' lr `drafter_lr` (all copies of saved values);
    - the next step's loss and drafter loss equal the uninterrupted run's to rel 1e-6 (the same forward on the same
      weights), its grad norm to rel 1e-5 and the masters after it within 0.01 x lr (GPU accumulation-order
      nondeterminism in the backward; a lost moment or step count changes Adam's second update by a sizeable part of
      lr)."""
    from . import policy_workers as w

    cfg = tiny(kind)
    first_batch, next_batch = w.batches(cfg, 2)
    lr = w.grpo().lr
    first = megatron_policy(kind, mtp=True)
    megatron_step(first, first_batch)
    state = first.save_sharded(tmp_path / "ckpt")
    assert state["optimizer"] == "megatron" and state["step"] == 1.0
    saved_weights = {n: t.cpu().clone() for n, t in first.export_weights()}
    saved_states = megatron_states(first)
    want = megatron_step(first, next_batch)
    want_states = megatron_states(first)
    del first

    resumed = megatron_policy(kind, mtp=True)
    resumed.load_state_dict({**state, "sharded_dir": str(tmp_path / "ckpt")})
    loaded_weights = {n: t.cpu() for n, t in resumed.export_weights()}
    assert sorted(loaded_weights) == sorted(saved_weights)
    assert [n for n, t in saved_weights.items() if not torch.equal(loaded_weights[n], t)] == []
    loaded_states = megatron_states(resumed)
    assert [(n, k) for n, s in saved_states.items() for k, t in s.items()
            if not torch.equal(loaded_states[n][k], t)] == []
    assert all(sorted(s) == ["exp_avg", "exp_avg_sq", "param"] for s in loaded_states.values())
    assert resumed.optimizer.adam_step() == 1.0
    groups = [g for sub in resumed.mopt.chained_optimizers for g in sub.optimizer.param_groups]
    assert all(g["lr"] == (DRAFTER_LR if g.get("is_decoupled_lr") else lr) for g in groups)
    got = megatron_step(resumed, next_batch)
    got_states = megatron_states(resumed)
    assert got["skipped"] is False
    assert loss_of(got) == pytest.approx(loss_of(want), rel=1e-6)
    assert got["drafter_loss"] == pytest.approx(want["drafter_loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    master_diff = max(float((got_states[n]["param"] - want_states[n]["param"]).abs().max()) for n in want_states)
    assert master_diff <= 0.01 * lr
    record(f"megatron_distopt_mtp_resume_{kind}", loss=loss_of(got), loss_uninterrupted=loss_of(want),
           grad_norm=got["grad_norm"], grad_norm_uninterrupted=want["grad_norm"], master_max_diff=master_diff,
           files=sorted(f.name for f in (tmp_path / "ckpt").iterdir()), gpu=torch.cuda.get_device_name())


@pytest.mark.gpu
def test_alltoall_dispatcher_step_matches_the_allgather_step():
    """The MoE model's GRPO step with the GPU's speed settings (`backend.megatron`'s defaults: the alltoall
    dispatcher, and with Transformer Engine grouped GEMM, permute fusion and the fused kernels; without it the
    alltoall dispatcher alone) against the portable settings (allgather, nothing fused): the same experts see the
    same tokens, so loss and grad norm agree to the module's fp32 GPU tolerance."""
    from megatron_spec.trainers.megatron.parallel import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy
    from megatron_spec.trainers.megatron.provider import PORTABLE, Speed, have_transformer_engine

    from . import policy_workers as w

    cfg = tiny("moe")
    b = w.batches(cfg, 1)[0]
    fast = Speed() if have_transformer_engine() else Speed(moe_grouped_gemm=False, moe_permute_fusion=False,
                                                           fusions=False)
    got = {}
    for name, speed in (("portable", PORTABLE), ("fast", fast)):
        policy = MegatronPolicy(w.our_model(cfg), w.grpo(), w.SAMPLING, Parallelism(), speed=speed)
        got[name] = (policy.model.config.moe_token_dispatcher_type, policy.train_step(w.with_policy_old(b, None)))
    assert (got["portable"][0], got["fast"][0]) == ("allgather", "alltoall")
    tol = 1e-4 if fp32_tolerance() == 1e-4 else 2e-3
    for key in ("loss", "grad_norm"):
        assert got["fast"][1][key] == pytest.approx(got["portable"][1][key], rel=tol), key
