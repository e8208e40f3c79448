"""What the spawned ranks run for `test_policy.py`: `MegatronPolicy` steps on the tiny models of `common.py`, and the
embedded trainer on the same weights and batches. Each scenario returns plain tensors / floats; the tests compare
them in the parent process."""

from __future__ import annotations

import torch

from megatron_spec.drafters.mtp.model import MTP, MTPConfig
from megatron_spec.models import CausalLM
from megatron_spec.rl.config import GRPOSection, RolloutCorrection
from megatron_spec.interfaces import Batch
from megatron_spec.trainers.embedded import EmbeddedPolicy

from .common import hf_tensors, policy_part, tiny

SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0)
B, T, PROMPT = 4, 12, 4
BUDGET = 2 * T
"""Two micro-batches of two full-length rows, [0, 1] and [2, 3], for every layout: the embedded length buckets, and
EP's fixed chunks dealt over 2 data-parallel ranks, cut the batch the same way, so MoE's per-micro-batch router
loss is the same function everywhere."""
STEPS = 2


def grpo(**kw) -> GRPOSection:
    """lr 1e-3 so one update moves every weight visibly; clip 0.2 is active on step 2 (see `batches`)."""
    return GRPOSection(**{"lr": 1e-3, "micro_batch_tokens": BUDGET, "share_prompt": False, **kw})


def batches(cfg, n: int = STEPS, start: int = 0) -> list[Batch]:
    """Full-length rows (prompt 4, completion 8). Step 0 folds the old log-probs (ratio 1); later steps carry
    offsets of 0.3 x N(0, 1) to add to the policy's own log-probs (`with_policy_old`), so ratios differ from 1 and
    the clip is active."""
    out = []
    for s in range(start, start + n):
        g = torch.Generator().manual_seed(100 + s)
        ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
        mask = torch.zeros(B, T, dtype=torch.bool)
        mask[:, PROMPT:] = True
        adv = torch.randn(B, generator=g)
        old = None if s == 0 else (0.3 * torch.randn(B, T - 1, generator=g))
        out.append(Batch(ids, mask, adv, old))
    return out


def with_policy_old(batch: Batch, policy_logprobs: torch.Tensor) -> Batch:
    """Step > 0: old log-probs = the policy's own + the batch's offsets (so the ratio is exp(-offset))."""
    if batch.old_logprobs is None:
        return Batch(batch.input_ids, batch.mask, batch.advantages)
    return Batch(batch.input_ids, batch.mask, batch.advantages, policy_logprobs + batch.old_logprobs)


def our_model(cfg) -> CausalLM:
    model = CausalLM(cfg)
    model.load_state_dict(policy_part(hf_tensors(cfg, mtp_layers=0)))
    return model


def our_drafter(cfg, layers: int = 1) -> MTP:
    drafter = MTP(cfg, MTPConfig(layers))
    drafter.load_state_dict({n: t for n, t in hf_tensors(cfg, mtp_layers=layers).items() if n.startswith("mtp.")})
    return drafter


def embedded_run(kind: str) -> dict:
    """The embedded trainer's STEPS steps (no drafter): metrics and the weights after each step."""
    cfg = tiny(kind)
    model = our_model(cfg)
    policy = EmbeddedPolicy(model, grpo(), SAMPLING)
    metrics, weights = [], []
    for b in batches(cfg):
        b = with_policy_old(b, policy.logprobs(b))
        metrics.append(policy.train_step(b))
        weights.append({n: t.detach().clone() for n, t in model.state_dict().items()})
    return {"metrics": metrics, "weights": weights}


def megatron_policy(kind: str, par, mtp: str | None = None, **kw):
    from megatron_spec.trainers.megatron.policy import MegatronPolicy

    cfg = tiny(kind)
    return MegatronPolicy(our_model(cfg), grpo(**kw.pop("grpo", {})), SAMPLING, par,
                          drafter=our_drafter(cfg) if mtp else None, mtp_num_layers=1 if mtp else 0,
                          mtp_coupling=mtp or "detached", **kw)


def megatron_steps(policy, kind: str, steps: int = STEPS, start: int = 0) -> dict:
    """`policy`'s steps on the batches from `start` (this rank's view): metrics, exported weights after each."""
    metrics, weights = [], []
    for b in batches(tiny(kind), steps, start):
        b = with_policy_old(b, policy.logprobs(b))
        metrics.append(policy.train_step(b))
        weights.append({n: t.clone() for n, t in policy.export_weights()})
    return {"metrics": metrics, "weights": weights}


def megatron_run(kind: str, par, mtp: str | None = None, steps: int = STEPS, **kw) -> dict:
    return megatron_steps(megatron_policy(kind, par, mtp, **kw), kind, steps)


def trunk_grads(policy) -> dict:
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if not n.startswith("mtp.")}


def coupling_run(kind: str) -> dict:
    """Trunk gradients of one step (clipping off: max_grad_norm 1e9 makes the clip factor exactly 1) without MTP,
    with detached MTP, with coupled MTP, and with coupled MTP and zero advantages (the MTP loss's gradient alone)."""
    out = {}
    for name, mtp, zero in (("none", None, False), ("detached", "detached", False), ("coupled", "coupled", False),
                            ("coupled_mtp_only", "coupled", True)):
        from megatron_spec.trainers.megatron.checks import Parallelism
        from megatron_spec.trainers.megatron.policy import MegatronPolicy

        cfg = tiny(kind)
        policy = MegatronPolicy(our_model(cfg), grpo(max_grad_norm=1e9), SAMPLING, Parallelism(),
                                drafter=our_drafter(cfg) if mtp else None, mtp_num_layers=1 if mtp else 0,
                                mtp_coupling=mtp or "detached")
        b = batches(cfg, 1)[0]
        if zero:
            b.advantages = torch.zeros(B)
        m = policy.train_step(b)
        out[name] = {"grads": trunk_grads(policy), "metrics": m}
    return out


def online_mtp_run(kind: str, steps: int = 6) -> list[float]:
    """A fresh MTP head (Qwen3 ships none) trained online, detached, on the same batch: its loss per step."""
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.policy import MegatronPolicy

    cfg = tiny(kind)
    policy = MegatronPolicy(our_model(cfg), grpo(), SAMPLING, Parallelism(), mtp_num_layers=1, drafter_lr=3e-3)
    b = batches(cfg, 1)[0]
    losses = []
    for _ in range(steps):
        losses.append(policy.train_step(Batch(b.input_ids, b.mask, b.advantages))["drafter_loss"])
    return losses


def after_outside_backward_run(kind: str) -> dict:
    """A backward through an MoE model's routers outside Megatron's schedule (a detached MTP loss on a model in
    this process, as the GPU tier's MTP-only test does), then the TP1 steps of a fresh policy. Megatron-Core keeps
    the router losses' backward scale in a class attribute, which such a backward leaves 0-dim and which the
    schedule's next step cannot copy its 1-element scale into unless the step clears it first."""
    from megatron_spec.trainers.megatron.checks import Parallelism
    from megatron_spec.trainers.megatron.cpu import on_cpu
    from megatron_spec.trainers.megatron.forward import detached_mtp_logits, mtp_loss

    ids = batches(tiny(kind), 1)[0].input_ids
    model = megatron_policy(kind, Parallelism(), "detached").model.train()
    with on_cpu():
        logits, mtp = detached_mtp_logits(model, ids)
        mtp_loss(logits, mtp, ids, soft=True).backward()
    return megatron_run(kind, Parallelism())


CORRECTION = dict(rollout_correction=RolloutCorrection(level="geometric", truncate=1.2))
"""Geometric-mean importance ratios truncated at 1.2: per-row weights, row 0's truncated (`correction_inputs`)."""


def correction_inputs(kind: str, rows: list[int] | None = None) -> tuple[Batch, torch.Tensor]:
    """Step 0's batch (old log-probs folded) with behaviour log-probs 0.5 x N(0, 1) off the embedded policy's own
    (0.6 lower on row 0, whose geometric-mean ratio is then above the bound), and with rows 2 and 3 left out as dynamic sampling leaves a group out of a fixed row count (`leave_out_rows`:
    empty mask, advantage 0); `rows`: only those rows instead (the batch without the left-out group)."""
    from megatron_spec.rl.loop import leave_out_rows

    cfg = tiny(kind)
    b = batches(cfg, 1)[0]
    own = EmbeddedPolicy(our_model(cfg), grpo(), SAMPLING).logprobs(b)
    behaviour = own + 0.5 * torch.randn(own.shape, generator=torch.Generator().manual_seed(7))
    behaviour[0] -= 0.6
    if rows is not None:
        return Batch(b.input_ids[rows], b.mask[rows], b.advantages[rows], None, behaviour[rows]), behaviour
    keep = [True, True, False, False]
    mask, advantages = leave_out_rows(b.mask, b.advantages[[0, 1]], keep)
    return Batch(b.input_ids, mask, advantages, None, behaviour), behaviour


def embedded_correction_run(kind: str) -> dict:
    """The embedded trainer's step on the kept rows alone: with the correction, and without behaviour log-probs."""
    out = {}
    for name, corrected in (("corrected", True), ("plain", False)):
        model = our_model(tiny(kind))
        policy = EmbeddedPolicy(model, grpo(**CORRECTION), SAMPLING)
        b, _ = correction_inputs(kind, rows=[0, 1])
        if not corrected:
            b.behaviour_logprobs = None
        out[name] = {"metrics": [policy.train_step(b)],
                     "weights": [{n: t.detach().clone() for n, t in model.state_dict().items()}]}
    return out


def megatron_correction_run(kind: str, par) -> dict:
    """`MegatronPolicy`'s step on the whole batch with rows 2 and 3 left out, corrected as `CORRECTION` says."""
    policy = megatron_policy(kind, par, grpo=CORRECTION)
    b, _ = correction_inputs(kind)
    return {"metrics": [policy.train_step(b)], "weights": [{n: t.clone() for n, t in policy.export_weights()}]}


# ---------------------------------------------------------------------------------------------------------------
# Spawn entries (module-level, importable by the spawned processes)
# ---------------------------------------------------------------------------------------------------------------

TWO_RANK_LAYOUTS = {
    ("dense", None): {"tp2": dict(tp=2), "pp2": dict(pp=2)},
    ("dense", "detached"): {"tp2": dict(tp=2), "pp2": dict(pp=2)},
    ("moe", None): {"ep2": dict(ep=2, etp=1), "pp2": dict(pp=2)},
    ("moe", "detached"): {"ep2": dict(ep=2, etp=1), "pp2": dict(pp=2)},
}
RESUME_STEPS = 4


def one_rank(rank: int, world: int) -> dict:
    """The TP1 references, the coupling gradients, the online MTP losses (one process)."""
    from megatron_spec.trainers.megatron.checks import Parallelism

    out = {}
    for kind, mtp in TWO_RANK_LAYOUTS:
        out[kind, mtp, "tp1"] = megatron_run(kind, Parallelism(), mtp)
    out["coupling"] = coupling_run("dense")
    out["online"] = online_mtp_run("moe")
    out["after_outside_backward"] = after_outside_backward_run("moe")
    out["correction"] = megatron_correction_run("dense", Parallelism())
    return out


def two_ranks(rank: int, world: int) -> dict:
    """TP2 / PP2 / EP2 steps, and resume: 4 steps at EP2 against 2 at EP2 + 2 at PP2 (and at EP2) from its state."""
    from megatron_spec.trainers.megatron.checks import Parallelism

    out = {}
    for (kind, mtp), layouts in TWO_RANK_LAYOUTS.items():
        for name, sizes in layouts.items():
            out[kind, mtp, name] = megatron_run(kind, Parallelism(**sizes), mtp)
    out["correction", "dp2"] = megatron_correction_run("dense", Parallelism())  # rank 1's rows are the left-out ones
    out["correction", "pp2"] = megatron_correction_run("dense", Parallelism(pp=2))
    ep2, pp2 = Parallelism(ep=2, etp=1), Parallelism(pp=2)
    out["resume", "straight"] = megatron_run("moe", ep2, "detached", steps=RESUME_STEPS)
    first = megatron_policy("moe", ep2, "detached")
    megatron_steps(first, "moe", 2)
    state = first.state_dict()
    for name, par in (("same_layout", ep2), ("other_layout", pp2)):
        policy = megatron_policy("moe", par, "detached")
        policy.load_state_dict(state)
        out["resume", name] = megatron_steps(policy, "moe", 2, start=2)
    return out
