"""An EAGLE-3 head trained online beside a Megatron-Core policy: the embedded trainer's update, fed from the
Megatron forward.

    capture   during the train step's forward (Megatron's schedule), forward hooks on the decoder layers the head
              fuses keep each micro-batch's layer outputs, detached, on whichever pipeline stage holds them, and a
              hook on the output layer keeps the policy's logits on the last stage
    gather    after the policy's optimizer step, every rank sends the head rank (the last pipeline stage's first
              tensor- and data-parallel rank) what it holds and nothing else, point to point: its stage's fused
              layers for its micro-batches (the first tensor-parallel rank the whole states; with sequence
              parallelism every tensor-parallel rank its own slice of positions, so the states are gathered over
              TP there), the last stage's logits, the first stage's (updated) embedding rows of the batch's tokens.
              A small manifest of what comes (rows, positions, shapes) reaches the head rank first. No other rank
              receives any of it.
    update    on the head rank only, which alone has the head's optimizer: the one online drafter trainer
              (`drafters.trainer.DrafterTrainer`), over the embedded trainer's micro-batches of the batch; its
              metrics are broadcast (a few numbers), and the head's weights (a broadcast of the head alone) when
              they are exported or checkpointed

The head reads everything detached and has its own AdamW (`drafter_train.lr`), so no gradient reaches the policy:
its trunk's gradients are those of a step without the head, bit for bit. As in the embedded trainer, the head
learns from the states of the forward before the policy's update and from the token embeddings after it.

Cost: the head rank receives R x T x (3H + V) floats per step for the R rows it trains on (every row, or those
within `drafter_train.max_tokens`, `spread_rows`; V is the head's draft vocabulary without `drafter_train.agreement`,
whose measure needs the whole vocabulary); the hooks keep only those rows, so no rank holds more of them than its
own micro-batches' share; every other rank sends only its own share. Under full activation
recompute a layer's forward runs again inside the backward; the hooks skip that run (`in_backward`). Sequence parallelism cannot run on the CPU
(Megatron's torch norms refuse it without Apex / Transformer Engine); `assemble` is tested with the slices it
sends.
"""

from __future__ import annotations

import contextlib
import os
import torch
import torch.distributed as dist
from torch import Tensor

from megatron_spec.drafters.eagle3.model import Eagle3Head
from megatron_spec.models.config import ModelConfig
from megatron_spec.models.decoder import TrunkOutput
from megatron_spec.microbatch import micro_batches, sequence_lengths, spread_rows
from megatron_spec.drafters.trainer import DrafterTrainer
from megatron_spec.interfaces import Batch, DrafterInputs
from megatron_spec.refit import DRAFTER_PREFIX

from ...trainers.megatron import require_megatron
from ...trainers.megatron.importer import layer_offset
from ...trainers.megatron.step import device

require_megatron()
from megatron.core import parallel_state as ps  # noqa: E402


def load_head(head: Eagle3Head | str | os.PathLike, cfg: ModelConfig) -> Eagle3Head:
    """The EAGLE-3 head (a module, or a checkpoint directory in our or a public layout) in fp32 on this rank's
    device, checked against the policy's config; anything else raises."""
    if not isinstance(head, Eagle3Head):
        from megatron_spec.drafters.files import load_drafter

        head = load_drafter(head, cfg, dtype=torch.float32, device=device())
        if not isinstance(head, Eagle3Head):
            raise ValueError(f"spec.method=eagle3 needs an EAGLE-3 head, the drafter is a {type(head).__name__}")
    check_head(head, cfg)
    return head.to(device=device(), dtype=torch.float32)


def check_head(head: Eagle3Head, cfg: ModelConfig) -> None:
    """The head fits the policy: its fused layers exist, hidden size and vocabulary match."""
    n = cfg.num_hidden_layers
    bad = [i for i in head.capture_layers if not 0 <= i < n]
    if bad:
        raise ValueError(f"the EAGLE-3 head fuses layer(s) {bad} (capture_layers {head.capture_layers}); the policy "
                         f"has layers 0..{n - 1}")
    t = head.target_config
    if (t.hidden_size, t.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
        raise ValueError(f"the EAGLE-3 head was built for hidden size {t.hidden_size} and vocabulary {t.vocab_size}, "
                         f"the policy has {cfg.hidden_size} and {cfg.vocab_size}")


def head_rank() -> int:
    """Global rank of the last pipeline stage's first tensor- and data-parallel rank, where the head trains.
    Collective (one all-reduce of one number)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0
    mine = (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0)
    flag = torch.tensor([dist.get_rank() if mine else -1], device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def in_backward() -> bool:
    """Whether this runs inside an autograd backward (a recomputed forward does): autograd has a current graph
    task then."""
    return torch._C._current_graph_task_id() != -1


class _Embeddings:
    """The target's `embed` for the head: the gathered embedding rows of the ids a batch holds."""

    def __init__(self, ids: Tensor, rows: Tensor):
        self.ids, self.rows = ids, rows

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.rows[torch.searchsorted(self.ids, input_ids.contiguous())]


class Eagle3Online:
    """Capture (`capture`), gather and update (`step`), export (`export`) of an EAGLE-3 head beside `model`, a
    Megatron-Core `GPTModel` stage. Every rank holds one and makes the same calls (construction, `step`,
    `export`, `state_dict` are collective); the head is updated on the head rank (`head_rank`) alone."""

    @property
    def state_key(self) -> str:
        """Where the policy's state and checkpoint keep this head's (its registry entry's `state_key`)."""
        from ..registry import drafter_method

        return drafter_method(self.trainer.method).state_key

    def __init__(self, model, head: Eagle3Head, grpo, sampling: dict, drafter_cfg):
        self.model, self.head = model, head
        self.head_rank = head_rank()
        self.micro_batch_tokens = grpo.micro_batch_tokens
        self.trainer = DrafterTrainer(head, "eagle3", drafter_cfg, sampling, grpo.micro_batch_tokens,
                                      learns=not dist.is_initialized() or dist.get_rank() == self.head_rank)
        self.reads = self.trainer.reads
        offset = layer_offset(model)
        self.local = {offset + j: layer for j, layer in enumerate(model.decoder.layers)
                      if offset + j in head.capture_layers}
        self.draft_vocab = not drafter_cfg.agreement and head.d2t is not None
        self.layers: dict[int, list[Tensor]] = {}
        self.logits: list[Tensor] = []
        self.micros, self.rows, self.kept = [], [], []

    @contextlib.contextmanager
    def capture(self, micros, mask: Tensor | None = None):
        """Hooks on this stage's fused layers (and its output layer on the last stage) for one train forward over
        `micros` (this rank's micro-batches, run in order by the schedule), keeping only the rows the head trains
        on: those of the batch's generated-token `mask` [B, T] within `drafter_train.max_tokens` (`spread_rows`),
        every row without a mask."""
        self.micros, self.layers, self.logits = micros, {i: [] for i in self.local}, []
        self.rows = self.trainer.rows(mask) if mask is not None else sorted(
            r for micro in micros for r in micro.rows)
        at = {r: n for n, r in enumerate(self.rows)}  # a kept row's place among the head's rows
        # per micro-batch: (its positions of the kept rows, their places among the head's rows)
        self.kept = [([j for j, r in enumerate(micro.rows) if r in at], [at[r] for r in micro.rows if r in at])
                     for micro in micros]
        if not self.reads:
            yield
            return
        handles = [layer.register_forward_hook(self._keep(i)) for i, layer in self.local.items()]
        if self.model.post_process:
            handles.append(self.model.output_layer.register_forward_hook(self._keep_logits))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _keep(self, i: int):
        def hook(_module, _inputs, out):  # out [t, b, H]: the micro-batch's kept rows only
            if in_backward():  # full recompute runs the layer again inside the backward: the same states
                return
            local, _ = self.kept[len(self.layers[i])]
            self.layers[i].append((out[0] if isinstance(out, tuple) else out).detach()[:, local])
        return hook

    def _keep_logits(self, _module, _inputs, out):
        """The kept rows' logits [t, b, V padded] (gathered over TP), cut to the vocabulary, or to the head's draft
        vocabulary where nothing needs the rest."""
        local, _ = self.kept[len(self.logits)]
        lg = out[0].detach()[:, local, : self.model.hf_config.vocab_size]
        self.logits.append(lg.index_select(-1, self.head.d2t.to(lg.device)) if self.draft_vocab else lg)

    def _pieces(self, batch: Batch, ids: Tensor) -> list[tuple[tuple, Tensor]]:
        """What this rank holds for the head, as (key, tensor) (`assemble` reads the keys)."""
        cfg = self.model.hf_config
        tp_rank = ps.get_tensor_model_parallel_rank()
        sp = self.model.config.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1
        pieces = []
        for k, i in enumerate(dict.fromkeys(self.head.capture_layers)):
            for (_, at), h in zip(self.kept, self.layers.get(i, [])):  # h [t, b, H] (t / tp of them under SP)
                if (sp or tp_rank == 0) and at:
                    start = tp_rank * h.shape[0] if sp else 0
                    pieces.append((("layer", k, at, start), h.transpose(0, 1).float().contiguous()))
        if tp_rank == 0:
            for (_, at), lg in zip(self.kept, self.logits):  # [t, b, V]
                if at:
                    pieces.append((("logits", at), lg.transpose(0, 1).float().contiguous()))
        if ps.is_pipeline_first_stage() and ps.get_data_parallel_rank() == 0:
            emb = self.model.embedding.word_embeddings  # vocabulary-parallel: each TP rank its own rows
            lo, hi = emb.vocab_start_index, emb.vocab_end_index
            inside = (ids >= lo) & (ids < hi)
            pieces.append((("embed", lo, hi), emb.weight[ids[inside] - lo].float().contiguous()))
        return pieces

    @torch.no_grad()
    def _gather(self, batch: Batch) -> tuple[dict[int, Tensor], Tensor, _Embeddings] | None:
        """The kept rows' (`batch`: those rows) captured layers [R, T, H], logits [R, T, V] and token embeddings on
        the head rank (None on every other rank): each rank's pieces, sent point to point after a manifest of their
        keys and shapes."""
        ids = batch.input_ids.unique().to(device())
        pieces = self._pieces(batch, ids)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            rank = dist.get_rank()
            manifest = [(key, tuple(t.shape)) for key, t in pieces]
            manifests = [None] * world if rank == self.head_rank else None
            dist.gather_object(manifest, manifests, dst=self.head_rank)
            if rank != self.head_rank:
                for n, (_, t) in enumerate(pieces):
                    dist.send(t, self.head_rank, tag=n)
                return None
            for src, entries in enumerate(manifests):
                if src == rank:
                    continue
                for n, (key, shape) in enumerate(entries):
                    t = torch.empty(shape, device=ids.device)
                    dist.recv(t, src, tag=n)
                    pieces.append((key, t))
        cfg = self.model.hf_config
        fused = list(dict.fromkeys(self.head.capture_layers))
        vocab = len(self.head.d2t) if self.draft_vocab else cfg.vocab_size
        layers, logits, rows = assemble(pieces, len(fused), batch.input_ids.shape, cfg.hidden_size, vocab, ids)
        return {i: layers[k] for k, i in enumerate(fused)}, logits, _Embeddings(ids, rows)

    def step(self, batch: Batch) -> dict:
        """The head's update (online) and agreement on this step's captured forward, as the embedded trainer
        makes them: its micro-batches of the batch, each with the captured states and logits of its rows. Computed
        on the head rank; every rank returns its metrics."""
        if not self.reads:
            return {}
        import time

        started = time.perf_counter()
        batch = Batch(batch.input_ids[self.rows], batch.mask[self.rows])  # the rows the head trains on
        gathered = self._gather(batch)
        self.layers, self.logits = {}, []
        metrics = {}
        if gathered is not None:
            layers, logits, embeddings = gathered
            ids, mask = batch.input_ids.to(device()), batch.mask.to(device())
            lengths = sequence_lengths(batch.mask)
            forwards = []
            for rows in micro_batches(lengths, self.micro_batch_tokens):
                L, idx = max(lengths[r] for r in rows), torch.tensor(rows, device=ids.device)
                out = TrunkOutput(logits.new_zeros(len(rows), L, 0), {i: h[idx, :L] for i, h in layers.items()})
                forwards.append(DrafterInputs(ids[idx, :L], mask[idx, :L], out, logits[idx, :L]))
            metrics = self.trainer.step(embeddings, forwards, float(batch.mask.sum()))
            metrics["drafter_s"] = time.perf_counter() - started
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [metrics]
            dist.broadcast_object_list(box, src=self.head_rank)
            metrics = box[0]
        return metrics

    def share(self, with_optimizer: bool = False) -> dict | None:
        """The head's weights from the head rank to every rank (a broadcast of the head, small next to what the
        gather moves), so every rank exports and checkpoints the head it trained; with `with_optimizer`, also its
        optimizer's state, returned. Collective."""
        opt = self.trainer.opt.state_dict() if self.trainer.opt is not None else None
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return opt
        with torch.no_grad():
            for t in self.head.state_dict().values():
                dist.broadcast(t, self.head_rank)
        if with_optimizer:
            box = [opt]
            dist.broadcast_object_list(box, src=self.head_rank)
            opt = box[0]
        return opt

    def export(self, share: bool = True):
        """The head's tensors under `drafter.` (as the embedded trainer's refit stream carries them). With `share`
        collective (every rank drains it); without, the caller has `share`d the head on every rank already."""
        if share:
            self.share()
        for name, t in self.head.state_dict().items():
            yield DRAFTER_PREFIX + name, t.detach()

    def state_dict(self) -> dict:
        """The head and its optimizer's state. Collective."""
        opt = self.share(with_optimizer=True)
        state = {"head": {n: t.detach().cpu().clone() for n, t in self.head.state_dict().items()}}
        if opt is not None:
            state["opt"] = opt
        return state

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
        if self.trainer.opt is not None and "opt" in state:
            self.trainer.opt.load_state_dict(state["opt"])


def assemble(pieces: list[tuple[tuple, Tensor]], n_layers: int, shape: tuple[int, int], hidden: int, vocab: int,
             ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(layers [n_layers, B, T, H], logits [B, T, V], embedding rows [len(ids), H]) from the ranks' pieces:
    `("layer", k, rows, start)` [b, t, H] holds fused layer k's states of `rows` at positions start.. (a slice of
    them under sequence parallelism); `("logits", rows)` [b, t, V]; `("embed", lo, hi)` the embedding rows of the
    `ids` in [lo, hi), in order. Positions no piece covers (padding) stay 0."""
    B, T = shape
    dev = ids.device
    layers = torch.zeros(n_layers, B, T, hidden, device=dev)
    logits = torch.zeros(B, T, vocab, device=dev)
    rows = torch.zeros(len(ids), hidden, device=dev)
    for key, t in pieces:
        if key[0] == "layer":
            _, k, at, start = key
            layers[k, at, start : start + t.shape[1]] = t
        elif key[0] == "logits":
            logits[key[1], : t.shape[1]] = t
        else:
            _, lo, hi = key
            rows[(ids >= lo) & (ids < hi)] = t
    return layers, logits, rows


OnlineHead = Eagle3Online  # the name the Megatron trainer asks the registry for (`megatron_hook`)
