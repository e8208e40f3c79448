"""What the spawned ranks run for `test_eagle3.py`: `MegatronPolicy` with an online EAGLE-3 head on a 4-layer tiny
model whose head fuses layers (0, 1, 3), so at PP2 the fused layers sit on both stages; and the embedded trainer
with the same head on the same weights and batches."""

from __future__ import annotations

import torch

from megatron_spec.drafters.eagle3.model import Eagle3Head
from megatron_spec.drafters.eagle3.model import Eagle3Config
from megatron_spec.rl.config import DrafterTrainSection
from megatron_spec.trainers.embedded import EmbeddedPolicy

from .common import tiny
from .policy_workers import SAMPLING, STEPS, batches, grpo, our_model, with_policy_old

LAYERS, CAPTURE = 4, (0, 1, 3)
D2T = torch.arange(0, 96, 2)
"""A draft vocabulary of every other id: the loss learns the target restricted to it (`drafter_loss`)."""


def cfg():
    return tiny("dense", num_hidden_layers=LAYERS)


def head() -> Eagle3Head:
    torch.manual_seed(7)
    return Eagle3Head(cfg(), Eagle3Config(LAYERS, CAPTURE, draft_vocab_size=len(D2T)), d2t=D2T)


def drafter_cfg(**kw) -> DrafterTrainSection:
    """lr 1e-3 as the policy's, so the weight tolerances of `test_policy.py` apply to the head too."""
    return DrafterTrainSection(**{"lr": 1e-3, **kw})


def head_weights(weights: dict) -> dict:
    return {n: t for n, t in weights.items() if n.startswith("drafter.")}


def embedded_run(**drafter) -> dict:
    model = our_model(cfg())
    policy = EmbeddedPolicy(model, grpo(), SAMPLING, head(), "eagle3", drafter_cfg(**drafter))
    metrics, weights = [], []
    for b in batches(cfg()):
        b = with_policy_old(b, policy.logprobs(b))
        metrics.append(policy.train_step(b))
        weights.append({n: t.detach().clone() for n, t in policy.export_weights()})
    return {"metrics": metrics, "weights": weights}


def megatron_policy(par, with_head: bool = True, **kw):
    from megatron_spec.trainers.megatron.policy import MegatronPolicy

    return MegatronPolicy(our_model(cfg()), grpo(**kw.pop("grpo", {})), SAMPLING, par,
                          eagle3=head() if with_head else None, drafter_cfg=drafter_cfg(**kw.pop("drafter", {})), **kw)


def megatron_run(par, steps: int = STEPS, **drafter) -> dict:
    policy = megatron_policy(par, drafter=drafter)
    metrics, weights = [], []
    for b in batches(cfg(), steps):
        b = with_policy_old(b, policy.logprobs(b))
        metrics.append(policy.train_step(b))
        weights.append({n: t.clone() for n, t in policy.export_weights()})
    return {"metrics": metrics, "weights": weights}


def trunk_grads_run() -> dict:
    """Trunk gradients of one step without and with the head (clip off: max_grad_norm 1e9 makes its factor 1)."""
    from megatron_spec.trainers.megatron.checks import Parallelism

    out = {}
    for name, with_head in (("none", False), ("eagle3", True)):
        policy = megatron_policy(Parallelism(), with_head, grpo=dict(max_grad_norm=1e9))
        m = policy.train_step(batches(cfg(), 1)[0])
        out[name] = {"grads": {n: p.grad.clone() for n, p in policy.model.named_parameters()}, "metrics": m}
    return out


def gather_run(par) -> dict:
    """One train step whose head inputs are also gathered the way every rank once received them: each rank's own
    pieces placed in zero buffers (`eagle3.assemble`) and all-reduced over the job. Returns this rank's number, the
    head rank, whether this rank received the inputs and whether they equal that all-reduce."""
    import torch.distributed as dist

    from megatron_spec.drafters.eagle3 import megatron as eagle3

    policy = megatron_policy(par)
    online, seen = policy.eagle3, {}
    gather = online._gather

    def both(batch):
        ids = batch.input_ids.unique()
        fused = list(dict.fromkeys(online.head.capture_layers))
        cfg = online.model.hf_config
        placed = eagle3.assemble(online._pieces(batch, ids), len(fused), tuple(batch.input_ids.shape),
                                 cfg.hidden_size, cfg.vocab_size, ids)
        reference = torch.cat([t.flatten() for t in placed])
        dist.all_reduce(reference)
        out = gather(batch)
        seen["got"] = None if out is None else torch.cat(
            [torch.stack([out[0][i] for i in fused]).flatten(), out[1].flatten(), out[2].rows.flatten()])
        seen["reference"] = reference
        return out

    online._gather = both
    batch = batches(cfg(), 1)[0]
    policy.train_step(with_policy_old(batch, policy.logprobs(batch)))
    got = seen["got"]
    return {"rank": dist.get_rank(), "head_rank": online.head_rank, "received": got is not None,
            "equal": got is not None and torch.equal(got, seen["reference"]),
            "nonzero": int((seen["reference"] != 0).sum())}


def budget_run(par) -> dict:
    """One train step with every row kept and the whole vocabulary (the default), one within
    `drafter_train.max_tokens` with the draft vocabulary only (agreement off), and one as the first under full
    activation recompute: what the head rank received in each, on the head rank (None elsewhere), and the rows kept."""
    import torch.distributed as dist

    out = {}
    for name, drafter, recompute in (("all", {}, "none"), ("budget", {"max_tokens": BUDGET, "agreement": False}, "none"),
                                     ("recompute", {}, "full")):
        policy = megatron_policy(par, drafter=drafter, recompute=recompute)
        online, seen = policy.eagle3, {}
        gather = online._gather

        def keep(batch, gather=gather, seen=seen):
            got = gather(batch)
            seen["got"] = None if got is None else (
                {i: t.clone() for i, t in got[0].items()}, got[1].clone(), got[2].ids.clone(), got[2].rows.clone())
            return got

        online._gather = keep
        batch = batches(cfg(), 1)[0]
        policy.train_step(with_policy_old(batch, policy.logprobs(batch)))
        out[name] = {"got": seen["got"], "rows": list(online.rows)}
    out["rank"] = dist.get_rank() if dist.is_initialized() else 0
    return out


def refit_run(par) -> dict:
    """After one train step, a refit through the policy's own join_weights / send_weights into a weight-update group
    whose one receiver is a thread of rank 0's process: every stage's first rank sends; the EAGLE-3 head (trained on
    the last stage's first rank) travels in stage 0's stream, shared with every rank first. Returns the received
    head tensors (rank 0) and this rank's head after the step."""
    import threading

    import torch.distributed as dist

    from megatron_spec.distributed.process_groups import free_port
    from megatron_spec.distributed.weight_group import open_weight_group

    policy = megatron_policy(par)
    batch = batches(cfg(), 1)[0]
    policy.train_step(with_policy_old(batch, policy.logprobs(batch)))
    port = [free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)
    senders = par.pp
    got, box = {}, {}

    def receiver():
        try:
            member = open_weight_group("127.0.0.1", port[0], senders, senders + 1, 120, "gloo", senders=senders)
            got.update({n: t.clone() for b in member.receive() for n, t in b})
        except BaseException as err:  # reported, not lost in the thread
            box["error"] = repr(err)

    thread = threading.Thread(target=receiver) if dist.get_rank() == 0 else None
    if thread is not None:
        thread.start()
    policy.join_weights("127.0.0.1", port[0], senders + 1, 120, "gloo", senders)
    policy.send_weights(1 << 16, "float32")
    if thread is not None:
        thread.join(120)
    head = {n: t.detach().clone() for n, t in policy.eagle3.head.state_dict().items()}
    return {"head": head, "received": {n: t for n, t in got.items() if n.startswith("drafter.")}, **box}


BUDGET = 24
"""Positions the budget run's head trains on: fewer than the batch's (4 rows of up to 12 tokens)."""


def one_rank(rank: int, world: int) -> dict:
    from megatron_spec.trainers.megatron.checks import Parallelism

    return {"tp1": megatron_run(Parallelism()), "grads": trunk_grads_run(), "budget": budget_run(Parallelism()),
            "tp1_drafts": megatron_run(Parallelism(), drafts=DRAFTS)}


DRAFTS = 3
"""Unrolled drafts of the head's update in the training-time-test comparison."""


def two_ranks(rank: int, world: int) -> dict:
    from megatron_spec.trainers.megatron.checks import Parallelism

    return {"tp2": megatron_run(Parallelism(tp=2)), "pp2": megatron_run(Parallelism(pp=2)),
            "gather_tp2": gather_run(Parallelism(tp=2)), "gather_pp2": gather_run(Parallelism(pp=2)),
            "budget_pp2": budget_run(Parallelism(pp=2)), "refit_pp2": refit_run(Parallelism(pp=2))}
