"""Rehearsal of an at-scale recipe (`--rehearsal`): the same recipe file, config and code path, at toy width, on
the allocation at hand.

What changes, and only that (`overrides`, laid over the recipe's config before any YAML or user override):
- the policy: a random checkpoint of the recipe's own architecture (`toy_architecture`: layers, experts, top-k,
  attention and key-value heads kept; hidden size, head and FFN widths shrunk to `WIDTHS`), scaled so that it
  repeats its last token (`shape_policy`: otherwise a random policy accepts no greedy draft), written as HF
  safetensors + config.json with a tokenizer and chat template (SmolLM2's: the real one is not on this machine);
- the drafter: a fresh head of the recipe's method for that toy, built and saved by the drafter registry as
  `megatron-spec train-drafter` does, an EAGLE-3 head set to draft what the toy repeats (`shape_drafter`);
- the data: a small file in the recipe's data format (DAPO-Math layout parquet: chat-message prompts, boxed
  integer answers scored by the recipe's reward);
- the optimizer: AdamW on each rank's shards (`backend.megatron.optimizer=torch`) where there is no GPU, since
  Megatron-Core's distributed optimizer needs CUDA (the audit, `--audit`, sizes the recipe's own at full width);
- the cluster: `WORLD` trainer ranks with the recipe's kinds of parallelism at size 2 (those Megatron runs on
  gloo: `megatron_split`), vLLM engines of tensor parallel 2 on CPU bundles, 3 steps of 2 prompts x 4 rollouts of a few tokens.
Everything else stays the recipe's: backends, placement, async lag, speculation method and k, online drafter
training, checkpoint cadence (the loop also saves the last step), pre-launch checks, sbatch template, Ray driver.
The recipe's own config is first audited at full size (`full_size_audit`): a recipe that would not fit its GPUs is
refused, since a toy run of it would prove nothing.

A stage the code path would skip without an error (`problems`: e.g. a drafter the trainer backend does not train
although the config says it is trained online) refuses the rehearsal before anything is built, naming the stage,
so a rehearsal cannot pass by not doing something.

The toy files go to `runs/rehearsal/<recipe>/toy/` beside the run's directory `.../run/`, written on the
submitting machine (the job reads them from the shared checkout), and are rebuilt only when missing or made for
another architecture. vLLM's CPU attention needs a head dimension of at least 32 and its CPU MoE kernels an expert
width per tensor-parallel worker that is a multiple of 32, which set the two smallest widths here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
from pathlib import Path

from megatron_spec.layout import Layout
from megatron_spec.rl.overrides import override_args

WORLD = 4
"""Trainer ranks of a rehearsal (and CPU bundles of its Ray placement)."""

ENGINE_TP = 2
"""vLLM tensor parallel size of a rehearsal's engines."""

WIDTHS = {"hidden_size": 64, "head_dim": 32, "intermediate_size": 128, "moe_intermediate_size": 64}
"""What a toy shrinks: widths only (head_dim 32 and expert width 64 = 2 x 32 are vLLM CPU's smallest)."""

TOKENIZER = "smollm2-135m"
"""Whose tokenizer and chat template the toy carries (a 49152-token vocabulary)."""

STEPS = 3
PROMPTS, GROUP, MAX_TOKENS, PROMPT_TOKENS = 2, 4, 16, 96
DATA_ROWS = 64


def toy_architecture(policy: str) -> dict:
    """The preset of the recipe's policy (`Qwen/Qwen3-235B-A22B` -> `qwen3-235b-a22b`) with only the widths of
    `WIDTHS` and the vocabulary (the toy tokenizer's) changed."""
    from megatron_spec.models.presets import PRESETS

    name = policy.rstrip("/").split("/")[-1].lower()
    if name not in PRESETS:
        raise ValueError(f"--rehearsal needs the architecture of {policy}: no preset named {name!r} "
                         f"(known: {', '.join(PRESETS)})")
    arch = dict(PRESETS[name])
    arch.update({k: v for k, v in WIDTHS.items() if k in arch})
    arch["vocab_size"] = 49152
    return arch


def megatron_split(scale) -> dict:
    """The recipe's kinds of trainer parallelism that run on gloo, at size 2 on `WORLD` ranks: each of TP, PP, EP the
    recipe uses (> 1) becomes 2, except TP beside EP (Megatron-Core trains MoE layers under TP only with sequence
    parallelism, whose norms need Transformer Engine or Apex, absent on the CPU); CP stays 1 (the trainer does not
    run it); data parallelism takes the rest."""
    tp, pp, ep = (2 if getattr(scale.parallel, k) > 1 else 1 for k in ("tp", "pp", "ep"))
    if ep > 1:
        tp = 1
    if WORLD % (tp * pp):
        raise ValueError(f"a rehearsal on {WORLD} ranks cannot hold TP{tp} x PP{pp}")
    return {"tp": tp, "pp": pp, "ep": ep}


def scale(recipe_scale):
    """The recipe's Scale on the rehearsal's allocation: one node of CPU bundles, `WORLD` for the trainer (with
    the split of `megatron_split`) and, when the recipe's placement is disaggregated, one engine of `ENGINE_TP`
    more; colocated, engines of `ENGINE_TP` share the trainer's. Placement, async lag and time as the recipe's."""
    lay = recipe_scale.parallel
    parallel = dataclasses.replace(lay, cp=1, first_stage_layers=None, last_stage_layers=None, sequence_parallel=False,
                                   engine=Layout(tp=ENGINE_TP, etp=1), engines=1, **megatron_split(recipe_scale))
    gen = 0 if lay.colocated else ENGINE_TP
    return dataclasses.replace(recipe_scale, nodes=1, gpus_per_node=WORLD + gen, parallel=parallel, cpu_bundles=True)


def home(name: str) -> Path:
    """Where a rehearsal of recipe `name` keeps its toy inputs (`toy/`) and its run (`run/`): siblings, because a
    fresh run moves whatever its directory held aside."""
    return Path("runs/rehearsal") / name


def overrides(name: str, cfg, recipe_scale) -> list[str]:
    """The override set of a rehearsal of recipe `name` (config `cfg`, cluster `recipe_scale`), as key=value."""
    out, toy = home(name) / "run", home(name) / "toy"
    sets = {
        "run.out_dir": out, "run.steps": STEPS, "run.eval_prompts": 2, "run.threads": 1, "run.report": "false",
        # Toy steps take seconds: the recipe's step cadence (kept) saves the rehearsal; its time cadence, sized for
        # hour-long steps, would only ask a short allocation for a first save it never reaches.
        "run.save_every_s": "null",
        "model.policy": toy / "policy", "model.hub_cache": "null", "model.drafter": toy / "drafter",
        "data.path": toy / "data.parquet", "data.format": "dapo", "data.max_prompt_tokens": PROMPT_TOKENS,
        "data.reward_workers": 1,
        "grpo.prompts_per_step": PROMPTS, "grpo.group_size": GROUP, "grpo.max_tokens": MAX_TOKENS,
        **scale(recipe_scale).parallel.overrides(),  # the split, the engine and the placement of `scale`
        "backend.megatron.optimizer": "megatron" if _cuda() else "torch",
        "backend.vllm.max_model_len": PROMPT_TOKENS + MAX_TOKENS, "backend.vllm.threads": 1,
        "backend.init_timeout_s": 600,
    }
    if cfg.spec is not None:
        sets["spec.model"] = toy / "drafter"
    return override_args(sets)


def full_size_audit(cfg, recipe_scale, gpu: str) -> dict:
    """The memory audit (`launchers.audit`) of the recipe's own config on its own layout at full size: a rehearsal
    proves the code path at toy width, which only means something for a recipe that fits its GPUs. `fits` None where
    the architecture is not known here."""
    from .checks import audit_of

    found = audit_of(cfg, recipe_scale.layout(cfg), gpu)
    if found is None:
        return {"gpu": gpu, "fits": None}
    return {"gpu": gpu, "fits": found.fits, "largest_rank_gb": round(max(r.device_bytes for r in found.ranks) / 1e9, 1),
            "problems": list(found.problems)}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def problems(cfg, arch: dict) -> list[str]:
    """What the recipe's config (with the toy of architecture `arch`) asks for that its code path would skip, or
    fail at after the allocation starts, so that a rehearsal could not show it working: each names its stage, in
    the order the run meets them. Each is read from the code it is about, so it clears when that code can."""
    from megatron_spec.drafters.registry import method_names

    out = []
    method = cfg.spec.method if cfg.spec else None
    if cfg.backend.generator == "vllm" and method == "eagle3":
        from megatron_spec.drafters.eagle3.export import EAGLE3_ARCHITECTURES

        if arch["model_type"] not in EAGLE3_ARCHITECTURES:
            out.append(f"vLLM engine start-up: the EAGLE-3 export for vLLM has no class for a {arch['model_type']} "
                       f"target (megatron_spec.drafters.eagle3.export.EAGLE3_ARCHITECTURES: "
                       f"{', '.join(EAGLE3_ARCHITECTURES)})")
    if cfg.backend.trainer == "megatron" and cfg.drafter_train.online and method in method_names(weights=True):
        # what the Megatron trainer trains online: MTP heads as Megatron-Core MTP layers, EAGLE-3 heads beside it
        trained = {"mtp": cfg.backend.megatron.mtp_num_layers > 0,
                   "eagle3": importlib.util.find_spec("megatron_spec.drafters.eagle3.megatron") is not None}
        if not trained.get(method, False):
            how = " unless backend.megatron.mtp_num_layers > 0" if method == "mtp" else ""
            out.append(f"online drafter training: the Megatron trainer does not train a {method} drafter{how}; it "
                       "would be served frozen while drafter_train.online=true says it is trained")
    return out


def build_toy(cfg, arch: dict, seed: int = 0) -> Path:
    """Write the toy policy of architecture `arch` (`toy_architecture`), its drafter and the data file where `cfg`
    names them (model.policy, model.drafter, data.path), each unless it is there already (the policy: for this
    architecture, which also rebuilds the drafter); returns the policy directory. The policy is a function of
    `arch` and `seed`, so a drafter made later is made for the same weights."""
    import torch

    from megatron_spec.models import CausalLM, ModelConfig, save_pretrained
    from megatron_spec.models.gguf import load_tokenizer
    from megatron_spec.drafters.registry import drafter_method, needs_weights

    policy = Path(cfg.model.policy)
    made = policy / "config.json"
    fresh = not (made.is_file() and _same_arch(json.loads(made.read_text()), arch))
    drafter_path = cfg.model.drafter or (cfg.spec.model if cfg.spec else None)
    wants_drafter = cfg.spec is not None and needs_weights(cfg.spec.method) and drafter_path
    if fresh or (wants_drafter and not Path(drafter_path).is_dir()):
        torch.manual_seed(seed)
        target = shape_policy(CausalLM(ModelConfig(**arch)))
        if fresh:
            save_pretrained(target, policy)
            load_tokenizer(TOKENIZER).save_pretrained(str(policy))
        if wants_drafter:
            method = drafter_method(cfg.spec.method)
            method.save(shape_drafter(method.new(target, None, None)), drafter_path, target)
        del target
    if cfg.data.path and not Path(cfg.data.path).is_file():
        write_data(Path(cfg.data.path), seed)
    return policy


EMBED_STD, LAYER_SCALE, HEAD_SCALE = 1.0, 0.1, 0.5
"""How `shape_policy` scales a random toy (see there)."""


def shape_policy(model):
    """A random toy made to predict something a drafter can agree with at temperature 1. vLLM drafts greedily and
    accepts a draft with the policy's probability of it, so a random near-uniform policy (49152 tokens) accepts
    nothing. Here the embeddings are N(0, EMBED_STD), every layer's output projections (attention `o_proj`, MLP and
    expert `down_proj`) are scaled by LAYER_SCALE so the residual stream stays close to the current token's
    embedding, and `lm_head` is HEAD_SCALE x the embeddings: the policy repeats its last token with probability
    close to 1, through all its layers (each still adds its own part)."""
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, EMBED_STD)
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(LAYER_SCALE)
        model.lm_head.weight.copy_(HEAD_SCALE * model.model.embed_tokens.weight)
    return model


def shape_drafter(drafter):
    """An EAGLE-3 head that agrees with `shape_policy`'s toy: its fusion averages the three captured hidden states
    (each close to the current token's embedding) and its layer's output projections are scaled as the policy's,
    so with the target's `lm_head` (copied at creation) it drafts the token the policy repeats. Other drafters are
    left as the registry made them."""
    import torch

    from megatron_spec.drafters.eagle3.model import Eagle3Head

    if isinstance(drafter, Eagle3Head):
        with torch.no_grad():
            h = drafter.fc.weight.shape[0]
            drafter.fc.weight.copy_(torch.eye(h, dtype=drafter.fc.weight.dtype).repeat(1, 3) / 3)
            for name, p in drafter.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(LAYER_SCALE)
    return drafter


def write_data(path: Path, seed: int) -> Path:
    """`DATA_ROWS` rows in DAPO-Math-17k's layout (`prompt` as chat messages, `reward_model.ground_truth`,
    `data_source`, `ability`): sums of two integers, answer asked in \\boxed{}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    rows = []
    for i in range(DATA_ROWS):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question = f"What is {a} + {b}? Put the final answer in \\boxed{{}}."
        rows.append({"data_source": "rehearsal", "ability": "MATH", "index": i,
                     "prompt": [{"role": "user", "content": question}],
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)}})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)
    return path


def _same_arch(saved: dict, arch: dict) -> bool:
    return all(saved.get(k) == v for k, v in arch.items())
