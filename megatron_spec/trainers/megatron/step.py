"""One GRPO step on a Megatron-Core `GPTModel`, run collectively by every rank through Megatron's own schedule
(`get_forward_backward_func`: no pipelining, 1F1B over the pipeline stages with micro-batches, or interleaved 1F1B
over each stage's model chunks with virtual pipeline stages).

    plan       the batch's micro-batches, and which data-parallel rank runs which
    forward    this stage's part of the model; on the last stage the policy logits and, with MTP, the MTP layers'
    loss       the GRPO loss of one micro-batch (`rl/grpo.py`, the whole batch's denominators) + the MTP loss
    grads      data-parallel / embedding / sequence-parallel reductions, then the policy's and the MTP layers'
               gradients clipped separately (so a detached MTP head cannot change the policy update)

The MoE load-balancing loss is Megatron's: each router adds `moe_aux_loss_coeff` x its micro-batch's
Switch loss, weighted 1 / (micro-batches in the step), through `MoEAuxLossAutoScaler`.

Scaling through the schedule: it divides each micro-batch's loss by the number of micro-batches on this rank, and
data-parallel gradients are averaged (as Megatron's DDP does), so each micro-batch's GRPO share is fed in
multiplied by (local micro-batches x data-parallel size): the sum of the gradients is then the one-big-batch
gradient, while the router losses keep their 1 / (all micro-batches) weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_spec.rl.grpo import LossNorm
from megatron_spec.microbatch import micro_batches, sequence_lengths
from megatron_spec.interfaces import Batch
from megatron_spec.trainers.embedded import grpo_micro_loss, masked, token_logprobs
from megatron_spec.drafters.loss import soft_cross_entropy

from . import require_megatron
from .cpu import on_cpu
from .forward import attention_mask, head
from .importer import layer_offset
from .mapping import REPLICATED, megatron_to_hf
from .routing import force

require_megatron()
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402


@dataclass
class Micro:
    """One micro-batch: the batch's `rows`, cropped to `length` positions."""

    rows: list[int]
    batch: Batch


def device() -> torch.device:
    """Where this rank computes and reduces: its GPU, or the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def on_device(batch: Batch) -> Batch:
    return batch.to(device())


def plan(batch: Batch, token_budget: int, dp: int, dp_rank: int, fixed: bool = False, packed: bool = True,
         min_micros: int = 1) -> list[Micro]:
    """This data-parallel rank's micro-batches.

    One data-parallel rank and no pipeline (TP only): the embedded trainer's length buckets
    (`microbatch.micro_batches`), so both trainers cut the same batch the same way. Otherwise (`fixed`, or dp > 1)
    the ranks run their k-th micro-batches in lockstep, which must then have one shape on every rank: the MoE
    dispatcher exchanges tokens between the data-parallel ranks (over which EP spreads the experts) in every layer,
    and the pipeline schedule sends activations of its call's one shape between stages. So the rows, longest first,
    are cut into slots of dp x m rows, m as large as the token budget allows at the slot's longest row (`packed`),
    rank r taking the slot's r-th m rows, all padded to that longest row only (rows of one length keep their
    order, so every layout of the same budget cuts them alike); `run_schedule` runs them all as one schedule
    call. `packed` False: consecutive rows in chunks of m (the largest divisor of
    B / dp with m x T within the budget), all padded to the batch's full length T, chunk j on rank j mod dp.
    `min_micros`: packed slots are cut small enough that each rank gets at least that many micro-batches where it
    has the rows (the interleaved schedule needs pp of them).
    """
    B, T = batch.input_ids.shape
    if dp == 1 and not fixed:
        lengths = sequence_lengths(batch.mask)
        return [Micro(rows, on_device(batch.select(rows, max(lengths[r] for r in rows))))
                for rows in micro_batches(lengths, token_budget)]
    if B % dp:
        raise ValueError(f"a batch of {B} rollouts cannot be split evenly over {dp} data-parallel ranks")
    if packed:
        return [Micro(rows, on_device(batch.select(rows, length)))
                for rows, length in slots(batch, token_budget, dp, dp_rank, min_micros)]
    per_rank = B // dp
    m = max([d for d in range(1, per_rank + 1) if per_rank % d == 0 and (token_budget <= 0 or d * T <= token_budget)],
            default=1)
    chunks = [list(range(s, s + m)) for s in range(0, B, m)]
    return [Micro(rows, on_device(batch.select(rows, T))) for j, rows in enumerate(chunks) if j % dp == dp_rank]


def slots(batch: Batch, token_budget: int, dp: int, dp_rank: int, min_micros: int = 1) -> list[tuple[list[int], int]]:
    """`plan`'s packed cut: this rank's (rows, padded length) per slot, the same slot shapes on every rank; at
    least `min_micros` slots where each rank has that many rows."""
    B = batch.input_ids.shape[0]
    lengths = sequence_lengths(batch.mask)
    order = sorted(range(B), key=lambda i: (-lengths[i], i))
    out, i = [], 0
    while i < B:
        longest = lengths[order[i]]
        m = (B - i) // dp
        if token_budget > 0:
            m = max(1, min(m, token_budget // max(longest, 1)))
        if len(out) < min_micros:  # leave every slot still needed a row per rank
            m = max(1, min(m, (B - i) // dp // (min_micros - len(out))))
        start = i + dp_rank * m
        out.append((sorted(order[start : start + m]), longest))
        i += dp * m
    return out


def padded_tokens(micros: list[Micro]) -> int:
    """Positions of this rank's micro-batches that hold no token of a row (padding)."""
    return positions(micros) - sum(sum(sequence_lengths(m.batch.mask)) for m in micros)


def positions(micros: list[Micro]) -> int:
    """Positions of this rank's micro-batches, padding included (what the forward computes over)."""
    return sum(m.batch.mask.numel() for m in micros)


def stage_forward(model, input_ids: Tensor, mtp: str | None) -> tuple[Tensor, list[Tensor]]:
    """This stage's output: hidden states [T, B, H] to send on, or on the last stage the policy logits [B, T, V]
    (gathered over TP) and, when `mtp` is `detached` or `coupled`, each MTP depth's logits [B, T, V].

    `detached`: the MTP layers read the trunk's final states, the token embeddings and the output head all
    detached, so their loss reaches the MTP layers only. `coupled`: Megatron's native MTP, whose loss flows into the
    trunk, the embedding and the head too.
    """
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    mask = attention_mask(input_ids)
    rotary = model.rotary_pos_emb(T)
    x = model.embedding(input_ids=input_ids, position_ids=positions) if model.pre_process else None
    hidden = model.decoder(hidden_states=x, attention_mask=mask, rotary_pos_emb=rotary)
    if not model.post_process:
        return hidden, []
    logits = head(model, hidden)
    if mtp is None:
        return logits, []
    detached = mtp == "detached"

    def embed(input_ids, position_ids, **_):
        with torch.set_grad_enabled(torch.is_grad_enabled() and not detached):
            return model.embedding(input_ids=input_ids, position_ids=position_ids)

    stacked = model.mtp(input_ids=input_ids, position_ids=positions,
                        hidden_states=hidden.detach() if detached else hidden, attention_mask=mask,
                        rotary_pos_emb=rotary, embedding=embed)
    depths = stacked.chunk(1 + model.config.mtp_num_layers, dim=0)[1:]
    return logits, [head(model, h, detach_weight=detached) for h in depths]


@dataclass(frozen=True)
class StepSpec:
    """What the loss needs besides the micro-batch (the same on every rank)."""

    grpo: object
    """`GRPOSection`: clip range, aggregation."""
    sampling: dict
    """Temperature / top-k / top-p: the engine's processing of the logits."""
    norm: LossNorm
    """The whole batch's denominators."""
    mtp_counts: tuple[float, ...]
    """Per MTP depth k, the batch's positions whose predicted token (k + 2 ahead) is generated."""
    mtp_weight: float
    """`mtp_loss_scaling_factor`."""
    scale: float
    """local micro-batches x data-parallel size: undoes the schedule's averaging (module docstring)."""
    fold: bool
    """The old log-probs are this forward's own (`grpo.fold_logprob`)."""
    routing: dict = field(default_factory=dict)
    """The policy's replaying routers by MoE layer (`routing.install`, `grpo.routing_replay`): each micro-batch's
    forward routes as its rollouts did. Empty: the routers choose."""


def mtp_terms(logits: Tensor, mtp_logits: list[Tensor], mask: Tensor, counts: tuple[float, ...]) -> list[Tensor]:
    """Per depth, this micro-batch's share of the batch's soft cross-entropy of the MTP layer against the policy's
    detached distribution for the same token, over positions whose predicted token is generated: depth k at i
    predicts token i + k + 2, which the policy predicts at i + k + 1 (`spec.drafter_loss` for the embedded one)."""
    terms = []
    for k, (student, count) in enumerate(zip(mtp_logits, counts)):
        n = mask.shape[1] - k - 2
        if n <= 0 or count == 0:
            continue
        m = mask[:, k + 2 :]
        local = float(m.sum())
        terms.append(soft_cross_entropy(student[:, :n], logits[:, k + 1 : k + 1 + n], m) * (local / count))
    return terms


def loss_func(spec: StepSpec, micro: Micro, mtp_logits: list[Tensor], logits: Tensor):
    """The schedule's loss function on the last stage: (loss fed to backward, this micro-batch's metrics)."""
    mb = micro.batch
    loss, metrics, logprobs = grpo_micro_loss(logits, mb, None if spec.fold else mb.old_logprobs, spec.sampling,
                                              spec.grpo, spec.norm)
    metrics["policy_loss"] = float(loss.detach())
    total = loss
    terms = mtp_terms(logits, mtp_logits, mb.mask, spec.mtp_counts)
    if terms:
        mtp = torch.stack(terms).sum() / len(spec.mtp_counts)
        metrics["drafter_loss"] = float(mtp.detach())
        total = total + spec.mtp_weight * mtp
    metrics["logprobs"], metrics["rows"] = logprobs.detach(), micro.rows
    return total * spec.scale, metrics


def forward_logprobs(spec: StepSpec, micro: Micro, logits: Tensor):
    mb = micro.batch
    lp = masked(token_logprobs(logits, mb.input_ids, spec.sampling), mb.mask[:, 1:])
    return logits.sum() * 0, {"logprobs": lp, "rows": micro.rows}


def schedule_groups(micros: list[Micro], one_call: bool) -> list[list[Micro]]:
    """The micro-batches of each schedule call: all of them in one (`one_call`), or each run of consecutive
    micro-batches of one shape in its own (the pipeline then sends one activation shape per call)."""
    if one_call:
        return [micros]
    groups: list[list[Micro]] = []
    for m in micros:
        if groups and groups[-1][0].batch.input_ids.shape == m.batch.input_ids.shape:
            groups[-1].append(m)
        else:
            groups.append([m])
    return groups


def run_schedule(chunks: list, micros: list[Micro], spec: StepSpec, mtp: str | None, forward_only: bool,
                 one_call: bool = True) -> tuple[list[dict], int]:
    """Megatron's forward(-backward) over this rank's micro-batches through its model `chunks` (one, or the vp
    chunks of interleaved stages): (the last stage's per-micro-batch outputs, schedule calls made).

    `one_call`: one call over all of them, whatever their shapes, with Megatron's `variable_seq_lengths` set when
    the pipeline has more than one stage and the shapes differ (each send is then preceded by its shape), so 1F1B
    keeps every stage busy across the whole step. Otherwise each run of one shape is its own call: a call over n of
    the rank's N micro-batches divides each loss by n, not N, so the config's `grad_scale_func` multiplies by n / N
    during it, which restores the one-call weights of the GRPO loss and of the router losses (whose scale the
    schedule derives from the same function)."""
    groups = schedule_groups(micros, one_call)
    config = chunks[0].config  # the schedule reads the first chunk's config
    base, variable, outs = config.grad_scale_func, config.variable_seq_lengths, []
    group_size = config.microbatch_group_size_per_vp_stage

    def scaled(factor, t):
        return (base(t) if base is not None else t) * factor

    try:
        config.variable_seq_lengths = variable or len({m.batch.input_ids.shape for m in groups[0]}) > 1
        for group in groups:
            if len(groups) > 1:
                config.grad_scale_func = partial(scaled, len(group) / len(micros))
            if len(chunks) > 1:
                pp = ps.get_pipeline_model_parallel_world_size()
                config.microbatch_group_size_per_vp_stage = interleave_group(len(group), pp)
            outs += _schedule_call(chunks, group, spec, mtp, forward_only)
    finally:
        config.grad_scale_func, config.variable_seq_lengths = base, variable
        config.microbatch_group_size_per_vp_stage = group_size
    return outs, len(groups)


def interleave_group(n_micro: int, pp: int) -> int:
    """Micro-batches the interleaved schedule runs through one chunk before moving to the next: Megatron-Core
    needs between pp and `n_micro`, and the last group empty or at least pp long. Its default, pp, takes a multiple
    of pp micro-batches; the smallest group that fits `n_micro` keeps the fewest activations in flight."""
    if n_micro < pp:
        raise ValueError(f"interleaved pipeline stages need at least pp={pp} micro-batches per schedule call, got "
                         f"{n_micro}: lower grpo.micro_batch_tokens, give each data-parallel rank more rows, or set "
                         "backend.megatron.virtual_pipeline=1")
    return next(g for g in range(pp, n_micro + 1) if n_micro % g == 0 or n_micro % g >= pp)


def _schedule_call(chunks: list, micros: list[Micro], spec: StepSpec, mtp: str | None,
                   forward_only: bool) -> list[dict]:
    def forward_step(data_iterator, model):
        micro = next(data_iterator)
        if spec.routing:
            force(spec.routing, micro.batch.routing)
        out, mtp_logits = stage_forward(model, micro.batch.input_ids, None if forward_only else mtp)
        if forward_only:
            return out, partial(forward_logprobs, spec, micro)
        return out, partial(loss_func, spec, micro, mtp_logits)

    B, T = micros[0].batch.input_ids.shape
    # Every chunk runs every micro-batch in order: interleaved, each gets its own iterator.
    data = iter(micros) if len(chunks) == 1 else [iter(micros) for _ in chunks]
    # The schedule sets the router losses' backward scale (a class attribute of Megatron-Core's
    # `MoEAuxLossAutoScaler`) by copying a 1-element tensor into whatever an earlier step left there. A backward
    # outside the schedule (a detached MTP step, another model in the same process) leaves a 0-dim tensor, maybe on
    # another device, and the copy then fails; cleared, the schedule's first micro-batch sets a fresh one.
    moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
    groups = interleaved_groups(chunks[0].config) if len(chunks) > 1 else {}
    # The schedule follows the chunks given, not whatever virtual size the process-global parallel state holds.
    schedule = get_forward_backward_func(ps.get_pipeline_model_parallel_world_size(),
                                         len(chunks) if len(chunks) > 1 else None)
    with on_cpu():
        return schedule(
            forward_step_func=forward_step, data_iterator=data, model=chunks, num_microbatches=len(micros),
            seq_length=T, micro_batch_size=B, forward_only=forward_only, **groups,
        )


class PairedShapes(P2PCommunicator):
    """Megatron-Core's point-to-point exchange with the shapes of variable-length sends (`variable_seq_lengths`)
    posted in the order its tensor exchange uses: on even ranks send-next, recv-prev, send-prev, recv-next, on odd
    ranks recv-prev, send-next, recv-next, send-prev. Megatron-Core posts the shapes in one fixed order, which
    pairs them crosswise when the previous and the next stage are the same rank (two stages with interleaving,
    where the last stage's chunk sends on to the first stage's next chunk): an activation's shape then arrives as
    a gradient's and the exchange of the tensors fails."""

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        if self.pp_group.size() != 2:
            return super()._communicate_shapes(tensor_send_next, tensor_send_prev, recv_prev, recv_next)
        dev = torch.cuda.current_device()
        got = {k: torch.empty(3, dtype=torch.int64, device=dev) for k, on in (("prev", recv_prev),
                                                                           ("next", recv_next)) if on}
        sent = {k: torch.tensor(t.size(), dtype=torch.int64, device=dev)
                for k, t in (("next", tensor_send_next), ("prev", tensor_send_prev)) if t is not None}
        peer = {"next": self.next_rank, "prev": self.prev_rank}
        order = (("send", "next"), ("recv", "prev"), ("send", "prev"), ("recv", "next"))
        if self.pp_group.rank() % 2:
            order = (("recv", "prev"), ("send", "next"), ("recv", "next"), ("send", "prev"))
        reqs = []
        for op, side in order:
            if op == "send" and side in sent:
                reqs.append(dist.isend(sent[side], dst=peer[side], group=self.pp_group))
            elif op == "recv" and side in got:
                reqs.append(dist.irecv(got[side], src=peer[side], group=self.pp_group))
        for r in reqs:
            r.wait()
        return tuple(got[k].tolist() if k in got else [0, 0, 0] for k in ("prev", "next"))


def interleaved_groups(config) -> dict:
    """The interleaved schedule's `p2p_communicator` (`PairedShapes`) and the process groups it then needs
    passed too: Megatron-Core's defaults, read from its parallel state."""
    pg = ProcessGroupCollection()
    pg.tp, pg.cp, pg.pp = (ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group(),
                           ps.get_pipeline_model_parallel_group())
    pg.embd = ps.get_embedding_group(check_initialized=False)
    pg.pos_embd = ps.get_position_embedding_group(check_initialized=False)
    pg.dp_cp = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    return dict(p2p_communicator=PairedShapes(pp_group=pg.pp, config=config), pg_collection=pg)


# ---------------------------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------------------------


def is_expert(name: str) -> bool:
    """Expert parameters (`...mlp.experts.*`, not shared experts) are reduced over the expert data-parallel group."""
    return ".mlp.experts." in name


@torch.no_grad()
def reduce_grads(model) -> None:
    """What Megatron's `finalize_model_grads` does, on plain `.grad`, for one model chunk: average over
    data-parallel ranks (expert parameters over their expert data-parallel group, with the same 1 / dp), sum the
    first and last stages' embedding copies (PP with MTP or tied heads), and sum over TP the replicated parameters whose gradient each TP
    rank only has part of."""
    dp = ps.get_data_parallel_world_size()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for _, p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if dp > 1:
        for n, p in params:
            group = ps.get_expert_data_parallel_group() if is_expert(n) else ps.get_data_parallel_group()
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
            p.grad.div_(dp)
    shared = model.share_embeddings_and_output_weights or model.config.mtp_num_layers
    holds_copy = model.pre_process or model.post_process  # with virtual stages, only the first / last chunk
    if shared and holds_copy and ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
        # The first stage's embedding and the last stage's copy (for the MTP layers or a tied head) are one weight.
        dist.all_reduce(model.shared_embedding_or_output_weight().grad, group=ps.get_embedding_group())
    if ps.get_tensor_model_parallel_world_size() > 1:
        # Replicated parameters that each TP rank sees only part of the tokens or heads of: norms under sequence
        # parallelism, and the QK norms (shared by all heads, each rank holding some heads).
        cfg = model.config
        for name, p in model.named_parameters():
            partial_grad = (cfg.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
                cfg.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name))
            if p.requires_grad and partial_grad:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())


def named_chunks(chunks: list) -> list[tuple[str, Tensor]]:
    """(name, parameter) of this rank's model chunks; with several, each name is prefixed `chunk{v}.` (their local
    layer numbers repeat)."""
    if len(chunks) == 1:
        return list(chunks[0].named_parameters())
    return [(f"chunk{v}.{n}", p) for v, c in enumerate(chunks) for n, p in c.named_parameters()]


def norm_owned(chunks: list) -> dict[str, bool]:
    """Whether this rank counts each parameter of its chunks in the global gradient norm (`named_chunks`'
    names): every shard once. Read from the HF mapping (Megatron's `tensor_model_parallel` attributes are only
    set when Megatron initialises the weights): replicated tensors count on TP rank 0 only (expert ones on ETP
    rank 0), and a later stage's copy of the embedding (MTP layers, tied head) not at all."""
    owned = {}
    for v, model in enumerate(chunks):
        prefix = f"chunk{v}." if len(chunks) > 1 else ""
        owned.update({prefix + n: own for n, own in _chunk_owned(model).items()})
    return owned


def _chunk_owned(model) -> dict[str, bool]:
    offset, tied = layer_offset(model), model.hf_config.tie_word_embeddings
    first = model.pre_process  # the chunk that embeds (with virtual stages, the first stage's first chunk)
    owned = {}
    for name, _ in model.named_parameters():
        spec = megatron_to_hf(name, offset, first_stage=first, tied=tied)
        rank = ps.get_expert_tensor_parallel_rank() if spec.is_expert else ps.get_tensor_model_parallel_rank()
        owned[name] = spec.export and (spec.kind != REPLICATED or rank == 0)
    return owned


@torch.no_grad()
def clip(named: list[tuple[str, Tensor]], owned: dict[str, bool], max_norm: float) -> float:
    """Global L2 norm of the gradients of `named` parameters (each shard once, `norm_owned`), then torch's
    `clip_grad_norm_` rule. Squares are summed over the whole job; data-parallel replicas, whose gradients are
    equal after `reduce_grads`, are divided back out (the expert parameters' over their own replica count).
    Collective: every rank calls it, with or without parameters."""
    sq = torch.zeros(2, dtype=torch.float64, device=device())
    for n, p in named:
        if owned[n]:
            sq[int(is_expert(n))] += torch.linalg.vector_norm(p.grad).double().square()
    if dist.get_world_size() > 1:
        dist.all_reduce(sq)
    total = float((sq[0] / ps.get_data_parallel_world_size() + sq[1] / ps.get_expert_data_parallel_world_size()).sqrt())
    coef = min(max_norm / (total + 1e-6), 1.0)
    for _, p in named:
        p.grad.mul_(coef)
    return total


def is_mtp(name: str) -> bool:
    return name.startswith("mtp.")


def gather_rows(values: list[tuple[list[int], Tensor]], shape: tuple[int, int], contributes: bool) -> Tensor:
    """[B, T-1] assembled from per-micro-batch rows, summed over every rank (only `contributes` ranks add theirs:
    the last stage's first tensor-parallel rank), so every rank gets the whole batch's values."""
    out = torch.zeros(shape, device=device())
    if contributes:
        for rows, lp in values:
            out[rows, : lp.shape[1]] = lp.float()
    if dist.get_world_size() > 1:
        dist.all_reduce(out)
    return out.cpu()


def sum_metrics(outputs: list[dict], contributes: bool, keys: tuple[str, ...]) -> dict:
    """Per-step metrics: each key summed over micro-batches and ranks (the per-micro-batch values are shares)."""
    vals = torch.tensor([sum(float(o[k]) for o in outputs if k in o) if contributes else 0.0 for k in keys],
                        dtype=torch.float64, device=device())
    if dist.get_world_size() > 1:
        dist.all_reduce(vals)
    return dict(zip(keys, vals.tolist()))


def aux_loss_sum(cfg, micro_total: int) -> float:
    """The trunk's MoE load-balancing losses of this step as Megatron applied them (coefficient x mean over
    micro-batches of each layer's Switch loss, summed over layers), from Megatron's tracker; 0 for dense models.
    `cfg`: the model's `TransformerConfig`."""
    if not cfg.num_moe_experts:
        return 0.0
    tracker = moe_utils.get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    value = torch.zeros((), dtype=torch.float64, device=device())
    if tracker is not None and ps.get_tensor_model_parallel_rank() == 0:
        value = tracker["values"][: cfg.num_layers].double().sum().to(device())
    if dist.get_world_size() > 1:  # layers live on different stages; micro-batches on different DP ranks
        dist.all_reduce(value)
    moe_utils.clear_aux_losses_tracker()
    coeff = cfg.moe_aux_loss_coeff[0] if isinstance(cfg.moe_aux_loss_coeff, list) else cfg.moe_aux_loss_coeff
    return float(value) * coeff / micro_total


def reset_router_tracker() -> None:
    """Forget Megatron's router-loss tracker (process-global, sized by the first model that logged into it)."""
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
