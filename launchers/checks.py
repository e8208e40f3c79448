"""Checks before launch: what a submitted job would otherwise find out only once its allocation starts.

A missing extra, a driver module that does not exist, an input that does not resolve (a local path that is not there,
a hub name this machine cannot find), a drafter missing or of another method than the recipe's, a layout the model
cannot take or the trainer does not run (context parallelism), more GPUs than the allocation has, vLLM engines that
straddle nodes or contradict the placement, `max_model_len` below prompt plus `grpo.max_tokens`, rollouts longer than
the model's context, backends other than the plan's, a drafter whose vocabulary is not the policy's, chain-length
weights the policy's task cannot take, hub names on several nodes without a shared `model.hub_cache`, TP or
expert groups that would straddle nodes: each is one line of a single error raised on the submitting machine, before
anything is rendered or submitted. Needs no optional dependency (model configs are read as JSON; a hub name is looked
up in huggingface_hub's local cache, fetched only when the machine may reach the hub; modules are looked up without
being imported).

Architecture figures for a layout check may come from a preset of the same name (`Qwen/Qwen3-8B` -> `qwen3-8b`),
which is how `--dryrun` and `--tune` work anywhere; whether the input itself resolves is `input_problems`' business,
and a preset never answers that.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from megatron_spec.layout import Layout
from megatron_spec.models import ModelConfig, hub
from megatron_spec.models.presets import PRESETS, preset
from megatron_spec.rl.config import RLConfig
from megatron_spec.rl.loop import config_problems
from megatron_spec.drafters.registry import needs_weights

from .extras import EXTRAS, missing_extras
from .plans import node_group_problems

SCALE_EXTRAS = ("megatron", "vllm", "ray")
"""What the Ray placements need where the job runs: Megatron-Core trains, vLLM generates, Ray places both."""


def local_input(name: str, cache_dir: str | None = None) -> str | None:
    """`name` as a directory on this machine: itself, or a hub name's snapshot in the local cache (never fetched
    here); None when neither."""
    if Path(name).exists():
        return name
    if hub.is_hub_name(name):
        try:
            return hub.cached(name, cache_dir)
        except ImportError:
            return None
    return None


def policy_config(policy: str, cache_dir: str | None = None) -> ModelConfig | None:
    """The policy's architecture: its `config.json` where the checkpoint is on this machine (a directory, or a hub
    name in the local cache), else the preset named like the last part of the name (`Qwen/Qwen3-8B` -> `qwen3-8b`),
    for layout checks only; None when neither is known here."""
    local = local_input(policy, cache_dir)
    path = Path(local or policy) / "config.json"
    if path.is_file():
        return ModelConfig.from_hf(json.loads(path.read_text()))
    name = Path(policy).name.lower()
    return preset(name) if name in PRESETS else None


def policy_dtype_bytes(policy: str, cache_dir: str | None = None) -> int:
    """Bytes a parameter of the policy's checkpoint files: the `torch_dtype` of its config.json where the checkpoint
    is on this machine, else 2 (the presets' published checkpoints are bfloat16)."""
    local = local_input(policy, cache_dir)
    path = Path(local or policy) / "config.json"
    hf = json.loads(path.read_text()) if path.is_file() else {}
    return {"float32": 4, "float16": 2, "bfloat16": 2}.get(hf.get("torch_dtype") or hf.get("dtype"), 2)


def drafter_vocab(path: str) -> int | None:
    """The vocabulary a drafter checkpoint drafts in (its own config.json: a draft model's `vocab_size`, a public
    EAGLE-3 head's target vocabulary; or the target recorded in drafter_config.json); None when the checkpoint is
    not on this machine."""
    for name, keys in (("config.json", ("vocab_size",)), ("drafter_config.json", ("target", "vocab_size"))):
        file = Path(path) / name
        if file.is_file():
            value = json.loads(file.read_text())
            if name == "config.json" and "transformer_layer_config" in value:  # speculators: the target's layer
                value = value["transformer_layer_config"]
            for key in keys:
                value = value.get(key) if isinstance(value, dict) else None
            return value
    return None


def drafter_kind(path: str) -> str | None:
    """What a drafter directory holds: `mtp` / `eagle3` (our drafter_config.json), `eagle3` (a public EAGLE-3 head
    in the vLLM speculators or SpecForge layout), `draft_model` (an HF causal LM); None when it is none of them."""
    ours, cfg = Path(path) / "drafter_config.json", Path(path) / "config.json"
    if ours.is_file():
        return json.loads(ours.read_text()).get("kind")
    if not cfg.is_file():
        return None
    hf = json.loads(cfg.read_text())
    if hf.get("speculators_model_type"):
        return hf["speculators_model_type"]
    if any("eagle3" in a.lower() for a in hf.get("architectures", [])):
        return "eagle3"
    return "draft_model" if hf.get("model_type") else None


def driver_problems(module: str) -> list[str]:
    """The driver module must exist in this version (looked up, not imported: it imports Ray)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    return [] if found else [f"the driver module {module} is not in this version of megatron_spec"]


def extras_problems(extras: tuple[str, ...], container_image: str | None) -> list[str]:
    """Without a container the job runs in this Python environment, so what it imports must be installed here; in
    a container it is the image's business (not checkable from here)."""
    if container_image:
        return []
    missing = missing_extras(extras)
    if not missing:
        return []
    modules = ", ".join(EXTRAS[e] for e in missing)
    return [f"the job runs without a container, in this environment, and needs {modules}: "
            f"pip install -e .[{','.join(missing)}] (or pass --container-image)"]


def import_check(extras: tuple[str, ...]) -> str:
    """The one-line Python import of this package and the modules of `extras`, which a rendered sbatch script runs in
    the named container before anything starts (so a missing package fails the job in seconds, not after the
    allocation has started its workers)."""
    modules = ", ".join(["megatron_spec", *(EXTRAS[e] for e in extras)])
    return f'python -c "import {modules}"'


def layout_fit_problems(cfg: RLConfig, layout: dict) -> list[str]:
    """The plan's layout (`Scale.layout`: the split the job will use on the allocation asked for, its engines and
    placement) as one `Layout`, checked by `Layout.problems`: the split fits the model and the trainer's GPUs, with
    sequence parallelism where Megatron-Core needs it and none where it cannot run, the engines fit the model and,
    colocated on GPUs, by the Ray placement's rule (`colocation_problems`; an engine's TP against the GPUs of
    a node is `plan_problems`' to check); and the engines fit the allocation."""
    world, meg = layout["gpus"], layout["megatron"]
    engines, engine_tp = layout["vllm"]["engines"], layout["vllm"]["tensor_parallel_size"]
    colocated = layout["ray"]["placement"] == "colocated"
    gen_gpus = 0 if colocated else engines * engine_tp
    lay = Layout(tp=meg["tp"], pp=meg["pp"], ep=meg["ep"], etp=meg["etp"], cp=meg["cp"],
                 first_stage_layers=meg.get("first_stage_layers"), last_stage_layers=meg.get("last_stage_layers"),
                 sequence_parallel=cfg.backend.megatron.sequence_parallel, engine=Layout(tp=engine_tp, etp=1),
                 engines=engines, colocated=colocated)
    model = policy_config(cfg.model.policy, cfg.model.hub_cache)
    on_gpus = "GPU" in layout["ray"].get("bundle", {"GPU": 1})  # a --rehearsal's bundles are CPUs
    # a disaggregated trainer gets the rest (none left: the engines' problem below)
    problems = lay.problems(model, world - gen_gpus if world > gen_gpus else None, runnable=True, on_gpus=on_gpus,
                            who="train")
    if engines * engine_tp > world:
        problems.append(f"{engines} generation engines x TP {engine_tp} = {engines * engine_tp} GPUs, more than the "
                        f"allocation's {world} (nodes x GPUs per node)")
    return problems


def memory_per_gpu(cfg: RLConfig, layout: dict, gpu: str = "h100"):
    """(SimConfig, MemoryReport) of the memory one GPU of `gpu` needs for the Megatron trainer's share of the
    model (weights, gradients, fp32 masters and Adam moments over data parallel, activations of the in-flight
    micro-batches with the chosen recompute and `grpo.micro_batch_tokens`) and for one vLLM engine's weights and a
    KV cache holding at least one full sequence, from the simulator's memory model (`megatron_spec.sim.memory`).
    Rollouts are taken at `grpo.max_tokens` (the worst case), parameters in `backend.megatron.params_dtype`
    (`sim.memory.with_params_dtype`). None for the embedded trainer or an unresolved policy."""
    from megatron_spec.sim.config import GenParallel, LengthDist, SimConfig, TrainParallel, Workload
    from megatron_spec.sim.hardware import hardware
    from megatron_spec.sim.memory import memory_report, with_params_dtype
    from megatron_spec.sim.shapes import shape_of

    model = policy_config(cfg.model.policy, cfg.model.hub_cache)
    if model is None or cfg.backend.trainer != "megatron":
        return None  # an unresolvable input is input_problems' to report; the embedded trainer has no split
    meg, g, world = layout["megatron"], cfg.grpo, layout["gpus"]
    engine_tp = layout["vllm"]["tensor_parallel_size"]
    colocated = layout["ray"]["placement"] != "disaggregated"
    gen_gpus = 0 if colocated else layout["vllm"]["engines"] * engine_tp
    per = meg["tp"] * meg["pp"] * meg["cp"]
    dp = max((world - gen_gpus) // per, 1)
    sim = SimConfig(model=model, hardware=gpu, gpus=world,
                    workload=Workload(g.prompts_per_step, g.group_size, prompt_budget(cfg),
                                      LengthDist(mean=g.max_tokens, max_tokens=g.max_tokens, sigma=0.0)),
                    train=TrainParallel(tp=meg["tp"], pp=meg["pp"], ep=meg["ep"], cp=meg["cp"], dp=dp),
                    gen=GenParallel(tp=engine_tp), colocated=colocated, gen_gpus=gen_gpus,
                    gpu_memory_utilization=cfg.backend.vllm.gpu_memory_utilization,
                    micro_batch_tokens=g.micro_batch_tokens or None, recompute=cfg.backend.megatron.recompute)
    report = memory_report(sim, hardware(gpu), shape_of(model), None)
    return sim, with_params_dtype(report, cfg.backend.megatron.params_dtype)


def audit_of(cfg: RLConfig, layout: dict, gpu: str = "h100"):
    """The full-size memory audit (`launchers.audit`) of the Megatron trainer's ranks, the engines and the driver
    on GPUs of kind `gpu`, with the optimizer the run uses and Megatron-Core's expert data parallelism; None for
    the embedded trainer or an unresolved policy."""
    from .audit import audit

    model = policy_config(cfg.model.policy, cfg.model.hub_cache)
    if model is None or cfg.backend.trainer != "megatron":
        return None  # an unresolvable input is input_problems' to report; the embedded trainer has no split
    return audit(cfg, layout, model, prompt_tokens=prompt_budget(cfg), gpu=gpu,
                 gpus_per_node=layout.get("gpus_per_node") or 8,
                 checkpoint_dtype_bytes=policy_dtype_bytes(cfg.model.policy, cfg.model.hub_cache))


def memory_problems(cfg: RLConfig, layout: dict, gpu: str = "h100") -> list[str]:
    """The audit's problems (`audit_of`): rollouts that do not split over DP or expert-DP, a rank over the memory
    of one `gpu`, a node over its host memory; each names its cause and fix."""
    found = audit_of(cfg, layout, gpu)
    return [f"memory audit ({gpu}): {p}" for p in found.problems] if found is not None else []


INPUT_FIELDS = (("model.policy", lambda c: c.model.policy), ("model.drafter", lambda c: c.model.drafter),
                ("spec.model", lambda c: c.spec.model if c.spec else None))


def input_problems(cfg: RLConfig, online: bool = True) -> list[str]:
    """Every checkpoint the job reads must resolve: a directory that exists here (the job's checkout and file
    systems are the submitting machine's), a built-in name, or a hub name found in the local cache
    (`model.hub_cache`) or, with `online` where this machine may reach the hub (HF_HUB_OFFLINE unset), on the hub
    itself."""
    problems, seen = [], set()
    for field, get in INPUT_FIELDS:
        name = get(cfg)
        if not name or name in hub.BUILTIN or name in seen:
            continue
        seen.add(name)
        if Path(name).exists():
            if field == "model.policy" and not (Path(name) / "config.json").is_file():
                problems.append(f"{field} {name} has no config.json: give an HF-layout checkpoint directory")
            continue
        if not hub.is_hub_name(name):
            problems.append(f"{field} {name} does not exist on this machine: give an existing directory or a hub "
                            "name (org/name)")
            continue
        problem = _hub_problem(name, cfg.model.hub_cache, online)
        if problem:
            problems.append(f"{field} {problem}")
    return problems


def _hub_problem(name: str, cache_dir: str | None, online: bool) -> str | None:
    """None when hub name `name` resolves from here; else what could not be resolved and how to fix it."""
    try:
        if hub.cached(name, cache_dir) is not None:
            return None
    except ImportError as err:
        return f"{name} is a hub name, and {err}"
    where = f"model.hub_cache={cache_dir}" if cache_dir else "huggingface_hub's default cache"
    fix = (f"download it where the nodes read it (`hf download {name}{f' --cache-dir {cache_dir}' if cache_dir else ''}`"
           f", with model.hub_cache on a shared file system) or give a local directory")
    if hub.offline() or not online:
        why = "HF_HUB_OFFLINE is set" if hub.offline() else "a dry run does not query the hub"
        return f"hub name {name} could not be resolved from this machine ({why}; not in {where}): {fix}"
    try:  # this machine may reach the hub: the name must exist there (only its config.json is fetched)
        hub.hub_module().hf_hub_download(name, "config.json", cache_dir=cache_dir)
    except Exception as err:  # noqa: BLE001 - any hub or network error means: not resolvable from here
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"hub name {name} could not be resolved from this machine ({first}; not in {where}): {fix}"
    return None


def shared_cache_problems(cfg: RLConfig, nodes: int, recipe: str = "<recipe>") -> list[str]:
    """A job on several nodes resolves each hub name on every node: without `model.hub_cache` each downloads into its
    own default cache (in a container, the container's), and a node may get a path that does not exist elsewhere."""
    if nodes <= 1 or cfg.model.hub_cache:
        return []
    names = [name for _, get in INPUT_FIELDS if (name := get(cfg)) and hub.is_hub_name(name)]
    if not names:
        return []
    return [f"hub name(s) {', '.join(dict.fromkeys(names))} on {nodes} nodes need model.hub_cache on a file system "
            f"every node mounts: set model.hub_cache=/shared/hf and stage them there once with `megatron-spec stage "
            f"recipes/{recipe}.py model.hub_cache=/shared/hf` (or give local directories)"]


def drafter_problems(cfg: RLConfig) -> list[str]:
    """A drafter with weights must be there, hold the recipe's method and draft in the policy's vocabulary (checked
    where both are on this machine)."""
    if not cfg.spec or not needs_weights(cfg.spec.method):
        return []
    name = cfg.model.drafter or cfg.spec.model
    if not name:
        return [f"spec.method={cfg.spec.method} drafts with weights and no drafter is named: set model.drafter (a "
                f"directory or hub name; `megatron-spec train-drafter --method {cfg.spec.method}` makes one)"]
    path = local_input(name, cfg.model.hub_cache)
    if path is None:
        return []  # input_problems says why it does not resolve
    problems = []
    kind = drafter_kind(path)
    if kind != cfg.spec.method:
        what = f"a {kind} drafter" if kind else "no drafter this project reads (no drafter_config.json or config.json)"
        problems.append(f"the drafter {name} holds {what}, the recipe drafts with spec.method={cfg.spec.method}: "
                        f"point model.drafter at a {cfg.spec.method} checkpoint or set spec.method={kind or '...'}")
    model = policy_config(cfg.model.policy, cfg.model.hub_cache)
    vocab = drafter_vocab(path)
    if model is not None and vocab is not None and vocab != model.vocab_size:
        problems.append(f"the drafter {name} drafts in a vocabulary of {vocab} tokens, the policy "
                        f"{cfg.model.policy} has {model.vocab_size}")
    return problems


PROMPT_TOKENS = 256
"""Prompt length the length checks allow for when the config sets no prompt cap: the built-in tasks' prompts are
far shorter (tiny ~10 tokens, the chat prompts ~60)."""


def prompt_budget(cfg: RLConfig) -> int:
    """Longest prompt the run may feed: the data section's prompt cap where the config has one, else PROMPT_TOKENS."""
    data = getattr(cfg, "data", None)
    for key in ("max_prompt_tokens", "max_prompt_len", "max_prompt_length"):
        if isinstance(getattr(data, key, None), int) and getattr(data, key) > 0:
            return getattr(data, key)
    return PROMPT_TOKENS


def length_problems(cfg: RLConfig) -> list[str]:
    """Rollouts must fit the policy's context (prompt + `grpo.max_tokens` <= max_position_embeddings, where the
    architecture is known here) and, with vLLM, the engines' `max_model_len`."""
    problems, prompt, new = [], prompt_budget(cfg), cfg.grpo.max_tokens
    model = policy_config(cfg.model.policy, cfg.model.hub_cache)
    if model is not None and prompt + new > model.max_position_embeddings:
        problems.append(f"grpo.max_tokens={new} plus a prompt of up to {prompt} tokens exceeds the context of "
                        f"{cfg.model.policy} (max_position_embeddings={model.max_position_embeddings}): lower "
                        f"grpo.max_tokens to {max(model.max_position_embeddings - prompt, 0)} or less")
    if cfg.backend.generator == "vllm" and cfg.backend.vllm.max_model_len < prompt + new:
        problems.append(f"backend.vllm.max_model_len={cfg.backend.vllm.max_model_len} is below a prompt of up to "
                        f"{prompt} tokens plus grpo.max_tokens={new}: set backend.vllm.max_model_len={prompt + new}")
    return problems


def plan_problems(cfg: RLConfig, recommended: dict) -> list[str]:
    """What the job resolves must be what the plan prints (a Megatron trainer and vLLM engines; the split, engine TP
    and placement are the config's by construction, `Scale.layout`), and the engines' tensor parallel size must fit
    the allocation and its nodes."""
    problems = []
    if cfg.backend.trainer != "megatron":
        problems.append(f"the plan prints a Megatron trainer but backend.trainer={cfg.backend.trainer}: set "
                        "backend.trainer=megatron (or run a recipe meant for one process)")
    if cfg.backend.generator != "vllm":
        problems.append(f"the plan prints vLLM engines but backend.generator={cfg.backend.generator}: set "
                        "backend.generator=vllm")
    tp, gpn = recommended["vllm"]["tensor_parallel_size"], recommended["gpus_per_node"]
    if recommended["gpus"] % tp:
        problems.append(f"vLLM TP {tp} does not divide the allocation's {recommended['gpus']} GPUs: set "
                        "backend.vllm.tensor_parallel_size to a divisor")
    if gpn and tp > gpn and tp % gpn:
        problems.append(f"a vLLM engine of TP {tp} on nodes of {gpn} GPUs would split a node between engines: use a "
                        f"TP that divides {gpn} or a multiple of it")
    elif gpn and tp < gpn and gpn % tp:
        problems.append(f"vLLM TP {tp} does not divide the {gpn} GPUs of a node: an engine would straddle two nodes")
    return problems  # the engine's split of the model's heads: `layout_fit_problems`


def task_problems(cfg: RLConfig) -> list[str]:
    """The task must be one the loop knows, and its chain-length weights must fit the chain lengths the policy was
    pretrained on (checked where the policy checkpoint is on this machine; the chat task needs none)."""
    from megatron_spec.rl.task import task_difficulty

    if cfg.model.task == "tiny" and not Path(cfg.model.policy).is_dir():
        return []
    try:
        task_difficulty(cfg.model.task, cfg.model.policy, cfg.model.terms_weights)
    except ValueError as err:
        return [f"model.task / model.terms_weights: {err}"]
    return []


def check_launch(name: str, cfg: RLConfig, layout: dict | None, *, driver: str | None,
                 extras: tuple[str, ...] = (), container_image: str | None = None, inputs: bool = True) -> list[str]:
    """Raise one ValueError naming every problem found (nothing is submitted then). `layout`: an at-scale recipe's
    plan (`recommended`: Scale.layout with nodes and GPUs per node). `inputs=False` (a dry run, which may run
    anywhere) returns the input problems and the memory audit's instead of raising on them."""
    problems = driver_problems(driver) if driver else []
    problems += extras_problems(extras, container_image) if extras else []
    split = (layout_fit_problems(cfg, layout) + plan_problems(cfg, layout)) if layout else []
    if layout and layout.get("nodes"):
        split += node_group_problems(layout, layout["nodes"])
    problems += split
    memory = memory_problems(cfg, layout) if layout and not split else []  # memory of a split that exists
    problems += length_problems(cfg)
    problems += drafter_problems(cfg)
    problems += task_problems(cfg)
    problems += config_problems(cfg)  # what the loop itself refuses at its start, asked here already
    missing = shared_cache_problems(cfg, layout.get("nodes", 1) if layout else 1, name)
    missing += input_problems(cfg, online=inputs)
    if inputs:
        problems += memory + missing
    if problems:
        raise ValueError(f"{name} cannot launch: " + "; ".join(problems))
    return [] if inputs else memory + missing
