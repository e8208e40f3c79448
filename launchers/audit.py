"""The full-size memory audit of an at-scale recipe (`--audit`): every kind of rank's device and host memory, counted
before launch on a machine with no GPU and no hub access.

Rank kinds: each trainer pipeline stage (its ranks differ by layers, embedding / output layer and the micro-batches
1F1B keeps in flight), the vLLM engine workers, the driver. Each figure is labelled by how it was obtained:

- `fake-tensor`: the project's own model code (`megatron_spec.models`) constructed on torch's meta device (shapes
  without storage: nothing allocated, a 128-expert layer in a tenth of a second): one decoder layer of each kind,
  the embedding and output layer, the EAGLE-3 head; a stage's
  parameters are those counts times its layers, split by Megatron-Core's rules (attention, dense MLP, embedding and
  output layer over TP; experts over EP x ETP; norms and routers replicated);
- `analytic`: counted from those parameters or the model's shapes by the component's own rules: gradients and
  optimizer states by the optimizer the run uses (`backend.megatron.optimizer`), activations at the recipe's
  largest micro-batch under its recompute setting, refit buffers, the engines' weights, workspace and KV cache
  (vLLM reserves `gpu_memory_utilization` of the device), host memory per process and per node.

The optimizer rules (Megatron-Core 0.16, `trainers/megatron/optimizer.py`): `torch` keeps bf16 parameters, fp32
gradients on the fp32 masters and AdamW's two fp32 moments on every rank, nothing sharded (18 B a parameter);
`megatron` (the distributed optimizer) keeps bf16 parameters, an fp32 gradient buffer (`grad_reduce_in_fp32`) and
shards the fp32 masters and moments (12 B) over the data-parallel ranks, expert parameters over the expert
data-parallel ranks, world / (PP x EP x ETP) (`parallel_state.initialize_model_parallel`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass, field
from unittest import mock

from megatron_spec.layout import stage_layers
from megatron_spec.models import ModelConfig

FAKE, ANALYTIC, MEASURED = "fake-tensor", "analytic", "measured"
GB = 1000 ** 3
GiB = 1024 ** 3
HOST_MEMORY_BYTES = 2 * 1000 ** 4
"""Host memory of one node (an 8-GPU H100 node: 2 TB)."""
PROCESS_OVERHEAD_BYTES = 4 * GiB
"""Host memory of one process before it loads anything of the model (Python, torch, CUDA and NCCL runtimes, Ray's
worker): an assumption, stated, not measured here."""
DEVICE_RUNTIME_BYTES = 3 * GiB
"""Device memory of a trainer rank outside its tensors: the CUDA context (about 0.6 GB), the buffers of its NCCL
communicators (TP, PP, DP, EP, expert-DP: about 1 GB) and the caching allocator's fragmentation (about 1.5 GB): an
assumption, stated, not measured here (vLLM's engines count theirs inside `gpu_memory_utilization`)."""
CPU_PROCESS_BYTES = 485_036_032
"""A Megatron trainer rank's peak resident memory on the CPU before it loads anything of the model (Python, torch,
Megatron-Core, its gloo group): measured once (`research/audit_check/overhead.py`); on the CPU (`gpu="cpu"`) the
device memory a rank audits is its process's, and this takes the place of `DEVICE_RUNTIME_BYTES`."""
EAGLE3_DRAFT_VOCAB = 32000
"""Draft vocabulary of the public EAGLE-3 heads, assumed where the drafter's files are not on this machine."""


@dataclass
class RankAudit:
    """One kind of rank: how many there are and what one of them holds (bytes), each part with its source."""

    kind: str
    count: int
    parts: dict[str, int]
    sources: dict[str, str]
    device_limit: int
    host_bytes: int
    note: str = ""
    """How the optimizer's states are laid out (trainer ranks)."""
    parameters: int = 0
    """Parameters one rank of this kind holds (the policy's share)."""

    @property
    def device_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def source(self) -> str:
        """Which parts were counted how: `fake-tensor: params, ...; analytic: ...`."""
        by = {}
        for part, how in self.sources.items():
            by.setdefault(how, []).append(part)
        return "; ".join(f"{how}: {', '.join(parts)}" for how, parts in sorted(by.items(), reverse=True))

    def as_json(self) -> dict:
        return {"kind": self.kind, "count": self.count, "device_bytes": self.device_bytes,
                "host_bytes": self.host_bytes, "parts": dict(self.parts), "source": self.source,
                "sources": dict(self.sources), "device_limit": self.device_limit}


@dataclass
class Audit:
    ranks: list[RankAudit]
    problems: list[str] = field(default_factory=list)
    nodes: dict[str, int] = field(default_factory=dict)
    """Host bytes of each kind of node."""

    @property
    def fits(self) -> bool:
        return not self.problems

    def as_json(self) -> dict:
        return {"fits": self.fits, "problems": list(self.problems), "ranks": [r.as_json() for r in self.ranks],
                "nodes": dict(self.nodes)}

    def table(self) -> str:
        """The audit as printed: one line per kind of rank, then the nodes and the problems."""
        cols = ("params", "grads", "optimizer", "activations", "other")
        head = f"{'rank kind':<28}{'count':>6}" + "".join(f"{c:>13}" for c in cols) + f"{'device':>10}{'limit':>8}" \
               f"{'host':>9}  source"
        lines = [head + "   (GB = 1e9 bytes)"]
        for r in self.ranks:
            groups = {c: 0 for c in cols}
            for name, b in r.parts.items():
                groups[_group(name)] += b
            lines.append(f"{r.kind:<28}{r.count:>6}" + "".join(f"{groups[c] / GB:>13.1f}" for c in cols)
                         + f"{r.device_bytes / GB:>10.1f}{r.device_limit / GB:>8.1f}{r.host_bytes / GB:>9.1f}  "
                         + ("fake-tensor params, the rest analytic" if FAKE in r.sources.values() else
                            "analytic" if r.sources else "-"))
        for kind, b in self.nodes.items():
            lines.append(f"host memory of {_node(kind)}: {b / GB:.0f} GB of {HOST_MEMORY_BYTES / GB:.0f} GB")
        lines.append("fits" if self.fits else "does not fit:\n  - " + "\n  - ".join(self.problems))
        return "\n".join(lines)


def _node(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} node"


def _group(part: str) -> str:
    if part.startswith("params"):
        return "params"
    if part.startswith("grads"):
        return "grads"
    if part.startswith("optimizer"):
        return "optimizer"
    if part.startswith("activations"):
        return "activations"
    return "other"  # refit buffers, runtime; an engine's workspace and KV cache


# -- parameters, on fake tensors ---------------------------------------------------------------------------------

@contextlib.contextmanager
def _fake_mode():
    """Modules built on the meta device, their initialisation skipped where it would cost seconds (a normal
    initialisation of a vocabulary-sized table on meta tensors)."""
    import torch
    from torch import nn

    with torch.device("meta"), mock.patch.object(nn.init, "normal_", lambda tensor, *a, **k: tensor):
        yield


def layer_params(model: ModelConfig, layer: int) -> dict[str, int]:
    """Parameters of decoder layer `layer` of `model`, built on fake tensors by the model code, by how Megatron-Core
    splits them: `tp` (attention projections, dense MLP), `expert` (all the layer's experts), `replicated` (norms,
    router)."""
    from megatron_spec.models.decoder import DecoderLayer

    with _fake_mode():
        built = DecoderLayer(model, layer)
    out = {"tp": 0, "expert": 0, "replicated": 0}
    for name, p in built.named_parameters():
        if ".experts." in name:
            out["expert"] += p.numel()
        elif "norm" in name or name == "mlp.gate.weight":
            out["replicated"] += p.numel()
        else:
            out["tp"] += p.numel()
    return out


def shell_params(model: ModelConfig) -> dict[str, int]:
    """Embedding, final norm and output layer, built on fake tensors by the model code (`CausalLM` of one layer,
    that layer's parameters left out)."""
    from megatron_spec.models.decoder import CausalLM

    with _fake_mode():
        built = CausalLM(dataclasses.replace(model, num_hidden_layers=1, mlp_only_layers=()))
    out = {"embedding": 0, "final_norm": 0, "output_layer": 0}
    for name, p in built.named_parameters(remove_duplicate=False):
        if name.startswith("model.embed_tokens"):
            out["embedding"] += p.numel()
        elif name.startswith("model.norm"):
            out["final_norm"] += p.numel()
        elif name.startswith("lm_head"):
            out["output_layer"] += p.numel()
    return out


def eagle3_params(model: ModelConfig, draft_vocab: int = EAGLE3_DRAFT_VOCAB) -> int:
    """Parameters of an EAGLE-3 head for `model` (the project's `Eagle3Head`, on fake tensors)."""
    from megatron_spec.drafters.eagle3.model import Eagle3Config, Eagle3Head

    inner = model.intermediate_size
    with _fake_mode():
        head = Eagle3Head(model, Eagle3Config(model.num_hidden_layers, intermediate_size=inner,
                                              draft_vocab_size=draft_vocab if draft_vocab < model.vocab_size else 0))
    return sum(p.numel() for p in head.parameters())


@dataclass(frozen=True)
class Split:
    """The trainer's split as Megatron-Core builds it."""

    tp: int
    pp: int
    ep: int
    etp: int
    cp: int
    train_gpus: int
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @property
    def dp(self) -> int:
        return self.train_gpus // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        """Megatron-Core's expert data-parallel size: world / (ETP x EP x PP)."""
        return self.train_gpus // (self.etp * self.ep * self.pp)


def stage_params(model: ModelConfig, split: Split) -> list[dict[str, int]]:
    """Per-rank parameters of each pipeline stage, by kind (`dense`: sharded over DP by the distributed optimizer;
    `expert`: over the expert DP)."""
    layers = stage_layers(model.num_hidden_layers, split.pp, split.first_stage_layers, split.last_stage_layers)
    kinds = {}
    for i in range(model.num_hidden_layers):
        key = model.is_moe_layer(i)
        if key not in kinds:
            kinds[key] = layer_params(model, i)
    shell = shell_params(model)
    out, start = [], 0
    for s, n in enumerate(layers):
        dense = expert = 0
        for i in range(start, start + n):
            lp = kinds[model.is_moe_layer(i)]
            dense += lp["tp"] // split.tp + lp["replicated"]
            expert += lp["expert"] // (split.ep * split.etp)
        if s == 0:
            dense += shell["embedding"] // split.tp
        if s == split.pp - 1:
            dense += shell["final_norm"]
            # tied embeddings: Megatron keeps a copy of the embedding as the last stage's output layer
            dense += (shell["output_layer"] or shell["embedding"]) // split.tp if (split.pp > 1 or
                                                                                    shell["output_layer"]) else 0
        out.append({"dense": dense, "expert": expert, "layers": n})
        start += n
    return out


# -- activations, analytic ---------------------------------------------------------------------------------------

def layer_activation_bytes(model: ModelConfig, layer: int, recompute: str, tp: int, sp: bool, act: int,
                           modules: tuple[str, ...] = ()) -> float:
    """Bytes one token's activations of one decoder layer keep for the backward pass on one rank: the layer's input
    only under full recompute; otherwise norms' inputs and outputs, the q/k/v projections and their normed and
    rotated copies, the attention output, and the MLP's gate, up, SiLU and product (for each of the top-k experts a
    token is routed to, with its dispatched input and output). Core attention is fused (Transformer Engine's
    flash attention: no sequence-squared scores), so recomputing it saves nothing here. Selective recompute of
    `modules` (`backend.megatron.recompute_modules`) drops what they recompute: `layernorm` the norms' outputs,
    `mlp` a dense MLP's inner activations, `moe_act` the experts' SiLU and product, `moe` everything of the MoE
    MLP but its input. Terms of width hidden are split over TP only with sequence parallelism."""
    h, d = model.hidden_size, model.head_dim
    wide = 1 / tp if sp else 1.0
    if recompute == "full":
        return h * act * wide
    mods = set(modules) if recompute == "selective" else set()
    norm_out = 0 if "layernorm" in mods else h * wide
    q, kv = model.num_attention_heads * d, model.num_key_value_heads * d
    attn = h * wide + norm_out + ((q + 2 * kv) + (q + kv) + q) / tp
    if model.is_moe_layer(layer):
        k, f = model.num_experts_per_tok, model.moe_intermediate_size
        inner = 0 if "moe" in mods else k * (2 * h + (2 if "moe_act" in mods else 4) * f) / tp
        mlp = h * wide + (0 if "moe" in mods else norm_out) + inner + model.num_experts * 2 * wide  # router fp32
    else:
        mlp = h * wide + norm_out + (0 if "mlp" in mods else 4 * model.intermediate_size / tp)
    return (attn + mlp) * act


def stage_activation_bytes(model: ModelConfig, layers: range, meg, tp: int, act: int) -> tuple[float, float]:
    """(bytes per token one micro-batch keeps on a stage holding `layers`, bytes per token live again while
    recompute reruns a part). Full recompute, `uniform`: the input of each chunk of `recompute_num_layers` layers
    is kept and one chunk's activations live while it reruns; `block`: the stage's first `recompute_num_layers`
    layers keep only their input, the rest keep everything, and one layer reruns at a time."""
    sp = meg.sequence_parallel
    mods = tuple(getattr(meg, "recompute_modules", ()))
    n = getattr(meg, "recompute_num_layers", 1)
    if meg.recompute != "full" or not layers:
        return sum(layer_activation_bytes(model, i, meg.recompute, tp, sp, act, mods) for i in layers), 0.0
    if getattr(meg, "recompute_method", "uniform") == "block":
        kept = sum(layer_activation_bytes(model, i, "full" if j < n else "none", tp, sp, act)
                   for j, i in enumerate(layers))
        return kept, layer_activation_bytes(model, layers[0], "none", tp, sp, act)
    chunks = math.ceil(len(layers) / n)
    rerun = sum(layer_activation_bytes(model, i, "none", tp, sp, act) for i in layers[:n])
    return chunks * layer_activation_bytes(model, layers[0], "full", tp, sp, act), rerun


def eagle3_head_bytes(cfg, model: ModelConfig, rollouts: int, prompt_tokens: int) -> tuple[int, int]:
    """What the online EAGLE-3 head's rank holds (`drafters/eagle3/megatron.py`), (during the policy's forward and
    backward, after the policy's update). During: the fused states and logits its hooks keep for the positions it
    trains on (`drafter_train.max_tokens`, at least one row; else every row at its longest; the logits over the
    draft vocabulary without `drafter_train.agreement`), fp32. After (the policy's activations freed): those as
    received and as assembled, and the head's own activations on its largest micro-batch (`grpo.micro_batch_tokens`,
    at least one row) per unrolled draft (`drafter_train.drafts`): its fused input, its decoder layer (dense, fp32,
    the policy's widths), its output and logits with their gradient."""
    d = cfg.drafter_train
    if not (d.online or d.agreement):
        return 0, 0
    row = prompt_tokens + cfg.grpo.max_tokens
    tokens = max(d.max_tokens, row) if d.max_tokens else rollouts * row
    vocab = model.vocab_size if d.agreement else EAGLE3_DRAFT_VOCAB
    captured = tokens * (3 * model.hidden_size + vocab) * 4
    if not d.online:
        return captured, 2 * captured
    micro = min(tokens, max(cfg.grpo.micro_batch_tokens, row))
    layer = layer_activation_bytes(dataclasses.replace(model, num_experts=0), 0, "none", 1, False, 4)
    per_token = layer + (3 * model.hidden_size + model.hidden_size + 2 * vocab) * 4
    return captured, int(2 * captured + micro * d.drafts * per_token)


def save_host_bytes(cfg, n: int, act: int) -> int:
    """Host memory a trainer rank holding `n` parameters takes while it saves (`trainers/megatron/checkpoint.py`):
    the fp32 masters and both Adam moments of its model-parallel part (12 B a parameter; the distributed optimizer's
    reshardable form gathers them over data parallelism, the torch optimizer's live there already on a CPU but are
    copied off a GPU), and with `run.async_save` a copy of its weights (`act` B) for the background writer."""
    return n * (12 + (act if cfg.run.async_save else 0))


def micro_batch_tokens(cfg, prompt_tokens: int) -> int:
    """Tokens of the recipe's largest micro-batch: as many rows of the longest rollout (prompt plus
    `grpo.max_tokens`) as `grpo.micro_batch_tokens` allows, at least one (`trainers/megatron/step.plan`)."""
    row = prompt_tokens + cfg.grpo.max_tokens
    budget = cfg.grpo.micro_batch_tokens
    return max(1, budget // row if budget else cfg.grpo.prompts_per_step * cfg.grpo.group_size) * row


# -- the audit ---------------------------------------------------------------------------------------------------

def audit(cfg, layout: dict, model: ModelConfig, *, prompt_tokens: int, gpu: str = "h100",
          gpus_per_node: int = 8, checkpoint_dtype_bytes: int = 2) -> Audit:
    """The audit of `cfg` on `layout` (`Scale.layout`: the split, engines and placement on the allocation) for the
    policy architecture `model`, on GPUs of kind `gpu` (or "cpu": the trainer ranks of a CPU run, whose device memory
    is their resident memory); the policy's checkpoint files hold `checkpoint_dtype_bytes` a parameter."""
    from megatron_spec.placement.workers import loads_whole_policy
    from megatron_spec.rl.loop import REFIT_BUCKET_BYTES
    from megatron_spec.sim.hardware import hardware
    from megatron_spec.sim.memory import ENGINE_WORKSPACE_BYTES

    hw = hardware(gpu)
    limit = int(hw.mem_bytes)
    meg, g = cfg.backend.megatron, cfg.grpo
    engines, engine_tp = layout["vllm"]["engines"], layout["vllm"]["tensor_parallel_size"]
    colocated = layout["ray"]["placement"] != "disaggregated"
    world = layout["gpus"]
    gen_gpus = world if colocated else engines * engine_tp
    split = Split(tp=meg.tp, pp=meg.pp, ep=meg.ep, etp=meg.etp or meg.tp, cp=meg.cp,
                  train_gpus=world if colocated else world - gen_gpus,
                  first_stage_layers=meg.first_stage_layers, last_stage_layers=meg.last_stage_layers)
    problems = []
    rollouts = g.prompts_per_step * g.group_size
    for what, size, name in (("data-parallel", split.dp, "DP"), ("expert data-parallel", split.expert_dp, "expert-DP")):
        if size and rollouts % size:
            problems.append(
                f"grpo.prompts_per_step x grpo.group_size = {g.prompts_per_step} x {g.group_size} = {rollouts} "
                f"rollouts do not split over the trainer's {what} ranks ({name} = {size}): choose "
                f"grpo.prompts_per_step so the rollouts are a multiple of {size}, or a layout whose {name} divides "
                f"{rollouts}")

    act = 2 if meg.params_dtype in ("bfloat16", "bf16") else 4
    masters = 4 if act == 2 else 0  # fp32 parameters are their own masters
    mb = micro_batch_tokens(cfg, prompt_tokens) // split.cp
    rows = rollouts // max(split.dp, 1)
    n_micro = max(1, math.ceil(rows * (prompt_tokens + g.max_tokens) / (mb * split.cp)))
    head = eagle3_params(model) if cfg.spec is not None and cfg.spec.method == "eagle3" else 0
    ranks = []
    stages = stage_params(model, split)
    for s, st in enumerate(stages):
        n = st["dense"] + st["expert"]
        parts, src = {"params": n * act}, {"params": FAKE}
        if meg.optimizer == "torch":
            parts["grads"] = n * 4
            parts["optimizer"] = n * (masters + 8)
            why = "optimizer=torch: fp32 masters and moments on every rank"
        else:
            parts["grads"] = n * 4
            parts["optimizer"] = math.ceil(st["dense"] * (masters + 8) / (split.dp * 1)) + \
                math.ceil(st["expert"] * (masters + 8) / split.expert_dp)
            why = f"distributed optimizer: over DP {split.dp}, experts over expert-DP {split.expert_dp}"
        src["grads"] = src["optimizer"] = ANALYTIC
        in_flight = min(split.pp - s, n_micro)
        start = sum(x["layers"] for x in stages[:s])
        per_token, rerun = stage_activation_bytes(model, range(start, start + st["layers"]), meg, split.tp, act)
        activations = mb * (per_token * in_flight + rerun)
        if s == split.pp - 1:  # the output layer's fp32 logits and their gradient, vocabulary-parallel
            activations += mb * model.vocab_size / split.tp * 4 * 2
        parts["activations"] = int(activations)
        src["activations"] = ANALYTIC
        if head:
            parts["params_drafter"] = head * 4
            src["params_drafter"] = FAKE
            if s == split.pp - 1:  # the head rank: its gradients and AdamW, and the rows it trains on
                parts["optimizer_drafter"] = head * 12
                src["optimizer_drafter"] = ANALYTIC
                during, after = eagle3_head_bytes(cfg, model, rollouts, prompt_tokens)
                # the head updates after the policy's step, once the policy's activations are freed
                parts["activations_drafter"] = max(during, after - parts["activations"])
                src["activations_drafter"] = ANALYTIC
        parts["refit_buckets"] = 2 * REFIT_BUCKET_BYTES  # the bucket gathered and its shards cast
        src["refit_buckets"] = ANALYTIC
        if gpu == "cpu":
            parts["runtime"], src["runtime"] = CPU_PROCESS_BYTES, MEASURED
        else:
            parts["runtime"], src["runtime"] = DEVICE_RUNTIME_BYTES, ANALYTIC
        save = save_host_bytes(cfg, n, act)
        if gpu == "cpu":  # the save's host copies are the rank's own resident memory
            if cfg.run.async_save:
                parts["save"], src["save"] = save, ANALYTIC
            host = 0
        else:
            host = PROCESS_OVERHEAD_BYTES + save
        ranks.append(RankAudit(f"trainer stage {s} ({st['layers']} layers)", split.train_gpus // split.pp, parts,
                               src, limit, host, note=why, parameters=n))
    if gpu == "cpu":  # a CPU run's trainer ranks: their resident memory is what the audit counts
        return Audit(ranks, problems, {})
    # a process that loads the whole policy holds it in float32 on the host (`placement/workers._build`)
    total = model_params(model)
    whole = total * 4
    rank0_policy = whole if loads_whole_policy(cfg, "policy") else 0  # on top of what rank 0 holds as a rank

    # engines: weights at the served dtype over TP, the drafter, workspace and logits, KV cache in what is left
    kv_per_token = 2 * model.num_hidden_layers * math.ceil(model.num_key_value_heads / engine_tp) * model.head_dim * 2
    util = cfg.backend.vllm.gpu_memory_utilization
    engine_limit = int(limit * util)
    # an engine from the files serves the checkpoint's dtype; one built on a loaded policy exports it in float32
    served = 4 if loads_whole_policy(cfg, "generator") else checkpoint_dtype_bytes
    weights = math.ceil(total * served / engine_tp)
    drafter = math.ceil(head * served / engine_tp)
    k = cfg.spec.num_speculative_tokens if cfg.spec else 0
    workspace = ENGINE_WORKSPACE_BYTES + 1024 * (k + 1) * model.vocab_size * 4
    one_sequence = (prompt_tokens + g.max_tokens) * kv_per_token
    kv = max(engine_limit - weights - drafter - workspace - REFIT_BUCKET_BYTES, one_sequence)
    eparts = {"params": weights, "params_drafter": drafter, "workspace": workspace, "refit_bucket": REFIT_BUCKET_BYTES,
              "kv_cache": kv}
    esrc = {k_: ANALYTIC for k_ in eparts}
    ranks.append(RankAudit(f"engine worker (vLLM TP{engine_tp})", engines * engine_tp, eparts, esrc, engine_limit,
                           PROCESS_OVERHEAD_BYTES))
    engine_actor_host = PROCESS_OVERHEAD_BYTES + (whole if loads_whole_policy(cfg, "generator") else 0)
    ranks.append(RankAudit("driver", 1, {}, {}, 0, PROCESS_OVERHEAD_BYTES))

    for r in ranks:
        if r.device_limit and r.device_bytes > r.device_limit:
            problems.append(_device_problem(r, cfg, split, model))
    # nodes: the trainer's first node (rank 0's float32 policy, the driver) and an engine node (its actor's copy)
    per_engine_node = max(gpus_per_node // engine_tp, 1) if engine_tp <= gpus_per_node else 1
    trainer_host = max(r.host_bytes for r in ranks if r.kind.startswith("trainer"))  # a rank saving its shards
    nodes = {"trainer rank 0's": gpus_per_node * trainer_host + rank0_policy + PROCESS_OVERHEAD_BYTES}  # + driver
    if colocated:
        nodes["trainer rank 0's"] += per_engine_node * engine_actor_host + gpus_per_node * PROCESS_OVERHEAD_BYTES
    else:
        nodes["engine"] = per_engine_node * engine_actor_host + gpus_per_node * PROCESS_OVERHEAD_BYTES
    for kind, b in nodes.items():
        if b > HOST_MEMORY_BYTES:
            problems.append(f"host memory of {_node(kind)}: {b / GB:.0f} GB > {HOST_MEMORY_BYTES / GB:.0f} GB "
                            "(processes that load the whole policy in float32): load each rank's slices from the "
                            "files in the served dtype")
    return Audit(ranks, problems, nodes)


def model_params(model: ModelConfig) -> int:
    """Every parameter of `model`, from the fake-tensor counts of one layer of each kind and the shell."""
    shell = shell_params(model)
    kinds = {}
    total = sum(shell.values())
    for i in range(model.num_hidden_layers):
        key = model.is_moe_layer(i)
        if key not in kinds:
            kinds[key] = sum(layer_params(model, i).values())
        total += kinds[key]
    return total


def _device_problem(r: RankAudit, cfg, split: Split, model: ModelConfig) -> str:
    """One line: the rank kind, its figure against the device, the largest parts, and the fix."""
    top = ", ".join(f"{k} {v / GB:.1f} GB" for k, v in sorted(r.parts.items(), key=lambda kv: -kv[1])[:3])
    head = f"{r.kind}: {r.device_bytes / GB:.1f} GB a GPU > {r.device_limit / GB:.1f} GB ({top})"
    if r.kind.startswith("engine"):
        return f"{head}: raise backend.vllm.tensor_parallel_size or lower backend.vllm.max_model_len"
    meg = cfg.backend.megatron
    if r.parts.get("activations_drafter", 0) > r.device_limit / 4:
        return (f"{head}: the online EAGLE-3 head's rank holds the fused states and logits of every position it "
                f"trains on, and its activations per unrolled draft: lower drafter_train.max_tokens (for example to "
                f"8192) or drafter_train.drafts, and set drafter_train.agreement=false (the logits then only over the "
                f"head's draft vocabulary)")
    if meg.optimizer == "torch":
        fix = ("set backend.megatron.optimizer=megatron (the distributed optimizer shards the fp32 masters and "
               f"moments over DP {split.dp}, experts over expert-DP {split.expert_dp})")
    elif meg.recompute != "full":
        fix = (f"set backend.megatron.recompute=full (each layer's activations recomputed: "
               f"{r.parts.get('activations', 0) / GB:.1f} GB now), or lower grpo.micro_batch_tokens")
    elif model.num_experts:
        fix = (f"the stage's {r.parameters / 1e9:.2f} B parameters at EP{split.ep} leave no room: offload the "
               "optimizer's states to the host (a precision-aware optimizer), or colocate trainer and engines on all "
               "GPUs at a larger EP (EP16 on 128 GPUs)")
    else:
        fix = "raise tp or pp, or lower grpo.micro_batch_tokens"
    return f"{head}: {fix}"


def write_json(result: Audit, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result.as_json(), f, indent=1, sort_keys=False)
