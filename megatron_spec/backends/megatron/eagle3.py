"""An EAGLE-3 head trained online beside a Megatron-Core policy: the embedded trainer's update, fed from the
Megatron forward.

    capture   during the train step's forward (Megatron's schedule), forward hooks on the decoder layers the head
              fuses keep each micro-batch's layer outputs, detached, on whichever pipeline stage holds them, and a
              hook on the output layer keeps the policy's logits on the last stage
    gather    after the policy's optimizer step, one all-reduce over the whole job assembles the batch's captured
              states [B, T, H] per layer, its logits [B, T, V] and the (updated) embedding rows of the tokens it
              holds: each value is added in by exactly one rank (its stage's first tensor-parallel rank, or with
              sequence parallelism every tensor-parallel rank its own slice of positions; the data-parallel rank
              that ran the micro-batch), every other rank adds zeros
    update    the head is replicated on every rank and every rank makes the same update from the same gathered
              inputs (deterministic), so every rank can export it; the update is `EmbeddedPolicy.drafter_step`
              itself, over the embedded trainer's micro-batches of the batch, with the registry's EAGLE-3 loss

The head reads everything detached and has its own AdamW (`drafter_train.lr`), so no gradient reaches the policy:
its trunk's gradients are those of a step without the head, bit for bit. As in the embedded trainer, the head
learns from the states of the forward before the policy's update and from the token embeddings after it.

Cost: the gather moves B x T x (3H + V) floats per step to every rank, fine at test and toy scale; at full scale
a send to the last stage alone (and logits restricted to the head's draft vocabulary) is the cheaper layout.
Full activation recompute would run the hooked layers twice per micro-batch and is refused. The sequence-parallel
path (each TP rank adds its own slice of positions) cannot run on the CPU, where Megatron's torch norms refuse
sequence parallelism without Apex / Transformer Engine; the CPU tests cover TP and PP without it.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_spec.models import Eagle3Head
from megatron_spec.models.config import ModelConfig
from megatron_spec.models.decoder import TrunkOutput
from megatron_spec.rl.microbatch import micro_batches, sequence_lengths
from megatron_spec.rl.policy import Batch, DrafterInputs, EmbeddedPolicy
from megatron_spec.rl.refit import DRAFTER_PREFIX

from . import require_megatron
from .importer import layer_offset
from .step import device

require_megatron()
from megatron.core import parallel_state as ps  # noqa: E402


def load_head(head: Eagle3Head | str | os.PathLike, cfg: ModelConfig) -> Eagle3Head:
    """The EAGLE-3 head (a module, or a checkpoint directory in our or a public layout) in fp32 on this rank's
    device, checked against the policy's config; anything else raises."""
    if not isinstance(head, Eagle3Head):
        from megatron_spec.models import load_drafter

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


class _Embeddings:
    """The target's `embed` for the head: the gathered embedding rows of the ids a batch holds."""

    def __init__(self, ids: Tensor, rows: Tensor):
        self.ids, self.rows = ids, rows

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.rows[torch.searchsorted(self.ids, input_ids.contiguous())]


class _HeadTrainer:
    """What `EmbeddedPolicy.drafter_step` / `drafter_pass` read (`model` is the target's embedding only: the
    EAGLE-3 loss reads nothing else of it)."""

    drafter_step = EmbeddedPolicy.drafter_step
    drafter_pass = EmbeddedPolicy.drafter_pass

    def __init__(self, head: Eagle3Head, grpo, sampling: dict, drafter_cfg):
        self.drafter, self.drafter_method, self.drafter_cfg = head, "eagle3", drafter_cfg
        self.grpo, self.sampling, self.model = grpo, sampling, None
        self.drafter_opt = (torch.optim.AdamW(head.parameters(), lr=drafter_cfg.lr, weight_decay=0.0)
                            if drafter_cfg.online else None)
        self.replay = deque(maxlen=drafter_cfg.replay)


class Eagle3Online:
    """Capture (`capture`), gather and update (`step`), export (`export`) of an EAGLE-3 head beside `model`, a
    Megatron-Core `GPTModel` stage. Every method except `export` and the state methods is collective."""

    def __init__(self, model, head: Eagle3Head, grpo, sampling: dict, drafter_cfg):
        self.model, self.head = model, head
        self.trainer = _HeadTrainer(head, grpo, sampling, drafter_cfg)
        self.reads = drafter_cfg.online or drafter_cfg.agreement
        offset = layer_offset(model)
        self.local = {offset + j: layer for j, layer in enumerate(model.decoder.layers)
                      if offset + j in head.capture_layers}
        self.layers: dict[int, list[Tensor]] = {}
        self.logits: list[Tensor] = []
        self.micros = []

    @contextlib.contextmanager
    def capture(self, micros):
        """Hooks on this stage's fused layers (and its output layer on the last stage) for one train forward over
        `micros` (this rank's micro-batches, run in order by the schedule)."""
        self.micros, self.layers, self.logits = micros, {i: [] for i in self.local}, []
        if not self.reads:
            yield
            return
        handles = [layer.register_forward_hook(self._keep(i)) for i, layer in self.local.items()]
        if self.model.post_process:
            handles.append(self.model.output_layer.register_forward_hook(
                lambda _m, _i, out: self.logits.append(out[0].detach())))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _keep(self, i: int):
        def hook(_module, _inputs, out):
            self.layers[i].append((out[0] if isinstance(out, tuple) else out).detach())
        return hook

    @torch.no_grad()
    def _gather(self, batch: Batch) -> tuple[dict[int, Tensor], Tensor, _Embeddings]:
        """The batch's captured layers [B, T, H], logits [B, T, V] and token embeddings, on every rank."""
        B, T = batch.input_ids.shape
        cfg = self.model.hf_config
        H, V = cfg.hidden_size, cfg.vocab_size
        fused = list(dict.fromkeys(self.head.capture_layers))
        ids = batch.input_ids.unique().to(device())
        dev = device()
        layers = torch.zeros(len(fused), B, T, H, device=dev)
        logits = torch.zeros(B, T, V, device=dev)
        rows = torch.zeros(len(ids), H, device=dev)
        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        sp = self.model.config.sequence_parallel and tp > 1
        for k, i in enumerate(fused):
            for micro, h in zip(self.micros, self.layers.get(i, [])):  # h [t, b, H] (t / tp of them under SP)
                if sp:
                    start = tp_rank * h.shape[0]
                    layers[k, micro.rows, start : start + h.shape[0]] = h.transpose(0, 1).float()
                elif tp_rank == 0:
                    layers[k, micro.rows, : h.shape[0]] = h.transpose(0, 1).float()
        if tp_rank == 0:
            for micro, lg in zip(self.micros, self.logits):  # [t, b, V padded], gathered over TP
                logits[micro.rows, : lg.shape[0]] = lg.transpose(0, 1)[..., :V].float()
        if ps.is_pipeline_first_stage() and ps.get_data_parallel_rank() == 0:
            emb = self.model.embedding.word_embeddings  # vocabulary-parallel: each TP rank its own rows
            inside = (ids >= emb.vocab_start_index) & (ids < emb.vocab_end_index)
            rows[inside] = emb.weight[ids[inside] - emb.vocab_start_index].float()
        flat = torch.cat([layers.flatten(), logits.flatten(), rows.flatten()])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
        n1, n2 = layers.numel(), logits.numel()
        layers = flat[:n1].view_as(layers)
        return ({i: layers[k] for k, i in enumerate(fused)}, flat[n1 : n1 + n2].view_as(logits),
                _Embeddings(ids, flat[n1 + n2 :].view_as(rows)))

    def step(self, batch: Batch) -> dict:
        """The head's update (online) and agreement on this step's captured forward, as the embedded trainer
        makes them: its micro-batches of the batch, each with the captured states and logits of its rows."""
        if not self.reads:
            return {}
        import time

        started = time.perf_counter()
        layers, logits, embeddings = self._gather(batch)
        self.layers, self.logits = {}, []
        self.trainer.model = embeddings
        ids, mask = batch.input_ids.to(device()), batch.mask.to(device())
        lengths = sequence_lengths(batch.mask)
        forwards = []
        for rows in micro_batches(lengths, self.trainer.grpo.micro_batch_tokens):
            L, idx = max(lengths[r] for r in rows), torch.tensor(rows, device=ids.device)
            out = TrunkOutput(logits.new_zeros(len(rows), L, 0), {i: h[idx, :L] for i, h in layers.items()})
            forwards.append(DrafterInputs(ids[idx, :L], mask[idx, :L], out, logits[idx, :L]))
        metrics = self.trainer.drafter_step(forwards, float(batch.mask.sum()))
        metrics["drafter_s"] = time.perf_counter() - started
        return metrics

    def export(self):
        """The head's tensors under `drafter.` (as the embedded trainer's refit stream carries them)."""
        for name, t in self.head.state_dict().items():
            yield DRAFTER_PREFIX + name, t.detach()

    def state_dict(self) -> dict:
        state = {"head": {n: t.detach().cpu().clone() for n, t in self.head.state_dict().items()}}
        if self.trainer.drafter_opt is not None:
            state["opt"] = self.trainer.drafter_opt.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
        if self.trainer.drafter_opt is not None and "opt" in state:
            self.trainer.drafter_opt.load_state_dict(state["opt"])
