"""What every recipe file shares: the command line, config resolution, checks before launch, executor plans and the
local run.

A recipe file is one function returning its `RLConfig` plus, for the at-scale models, a `Scale` (cluster shape and
parallelism); its `main(argv)` hands both to `recipe_main`:

    python recipes/<name>.py [key=value ...] [--config YAML] [--dryrun] [--executor local|slurm|ray-slurm]
                             [--tune [--gpu h100]] [--rehearsal] [...]

The config is the recipe's function, then (with --tune, at-scale recipes) the tuner's best layout for the
allocation, then the YAML laid over it, then the overrides in order: what the user writes always wins. `--dryrun`
prints the resolved config, the executor plan and the sbatch script that would be submitted, and runs nothing (no
optional dependency needed). `local` runs in this process (a Ray placement: on the Ray cluster at RAY_ADDRESS or a
local one); `slurm` submits this same command with `--executor local` through NeMo-Run's SlurmExecutor;
`ray-slurm` renders `slurm/ray.sub` (a Ray cluster on the allocation, this command on its head) and submits it.
Whatever would fail on the cluster for a reason visible here fails here first (`launchers/checks.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from launchers import MissingExtra, local_plan, ray_slurm_plan, slurm_plan
from launchers.cadence import check_save_cadence
from launchers.projection import project, timeout_problems
from launchers.checks import SCALE_EXTRAS, check_launch, import_check
from launchers.render import TEMPLATES, render_sbatch, sbatch_command
from megatron_spec.layout import Layout, check_layout
from megatron_spec.rl.backend_config import BackendSection, MegatronSection, VLLMSection
from megatron_spec.rl.config import RLConfig
from megatron_spec.rl.overrides import apply_overrides, dump_yaml, load_yaml, override_args

REPO = Path(__file__).resolve().parents[1]

SCALE_DRIVER = "megatron_spec.placement.driver"
"""Module whose `train(cfg, layout)` runs a Ray placement (every at-scale recipe) on the Ray cluster it joins."""

TUNE_GPU_MEMORY = 0.85
"""Share of a GPU the tuner lets a generation engine take (`SimConfig.gpu_memory_utilization`), and so the
`backend.vllm.gpu_memory_utilization` a tuned run gets: the layout it picks fits at that share, not necessarily at
the config's default."""

TUNE_ACCEPTANCE = 2.8
"""Acceptance length at k=3 the tuner assumes for a recipe's drafter (the figure the `megatron-spec tune` examples
and the reference projection use); the tuner re-expands it for other k."""


@dataclass(frozen=True)
class Scale:
    """Recommended cluster and parallel layout of an at-scale recipe."""

    nodes: int
    """SLURM nodes."""
    gpus_per_node: int
    """GPUs per node; the policy trains on all of them and, colocated, vLLM generates on all of them in turn."""
    parallel: Layout = Layout(etp=1, engine=Layout(etp=1))
    """The layout (`megatron_spec.layout.Layout`): the Megatron trainer's split and sequence parallelism
    (`backend.megatron.*` win when the recipe's trainer is Megatron), one vLLM engine's split (`engine.tp`), and the
    placement: colocated, engines of `engine.tp` GPUs take turns with the trainer on every GPU; disaggregated,
    `engines` of them form a generation pool and the trainer gets the rest."""
    async_lag: int = 0
    """Policy versions the engines may run ahead of the trainer (`backend.async_lag`; 0: synchronous GRPO)."""
    time: str = "04:00:00"
    """SLURM time limit of one job; runs longer than that resume from their last checkpoint."""
    recompute: str = "selective"
    """Activation recompute of the trainer (`backend.megatron.recompute`): `selective` (core attention) or `full`
    (each decoder layer), whichever the memory audit (`--audit`) needs."""
    cpu_bundles: bool = False
    """Ray bundles are equal shares of the cluster's CPUs, not GPUs (a `--rehearsal` on a CPU allocation)."""

    def __post_init__(self) -> None:
        # The one layout check the backend, the simulator and the tuner use, including what the trainer does not run
        # (context parallelism); the recipe checks its model against the same check.
        world, lay = self.nodes * self.gpus_per_node, self.parallel
        if lay.engine is None:
            raise ValueError("a Scale's layout names its vLLM engine's split: Layout(..., engine=Layout(tp=...))")
        if not lay.colocated and not 0 < self.gen_gpus < world:
            raise ValueError(f"a disaggregated Scale needs a generation pool of 0 < engines x engine TP < {world} "
                             f"GPUs; got {lay.engines} x {lay.engine.tp}")
        if lay.colocated and world % lay.engine.tp:
            raise ValueError(f"vLLM TP={lay.engine.tp} does not divide the {world} generation GPUs")
        check_layout(None, lay, world - self.gen_gpus, runnable=True, on_gpus=not self.cpu_bundles)

    @property
    def gen_gpus(self) -> int:
        """GPUs of the generation pool: 0 colocated (the engines share every GPU), engines x engine TP otherwise."""
        return 0 if self.parallel.colocated else self.parallel.engines * self.parallel.engine.tp

    def backend(self, max_model_len: int, init_timeout_s: float = BackendSection.init_timeout_s) -> BackendSection:
        """The backends this Scale describes, as the recipe's `backend` section: the Megatron trainer with this split,
        vLLM engines serving `max_model_len` tokens (prompt plus completion), the placement, and the process groups'
        timeout `init_timeout_s` (`backend.init_timeout_s`); so the run is what `--dryrun` prints. The layout's
        keys are `Layout.overrides`'."""
        sets = self.parallel.overrides()
        meg, vllm = (section_fields(sets, f"backend.{name}.") for name in ("megatron", "vllm"))
        return BackendSection(
            trainer="megatron", generator="vllm", placement=sets["backend.placement"],
            generators=sets["backend.generators"], async_lag=self.async_lag, init_timeout_s=init_timeout_s,
            # bf16 with Megatron-Core's distributed optimizer: fp32 masters and Adam moments sharded over data
            # parallelism (experts over expert-DP)
            megatron=MegatronSection(**meg, params_dtype="bfloat16", recompute=self.recompute, optimizer="megatron"),
            vllm=VLLMSection(**vllm, max_model_len=max_model_len,
                             gpu_memory_utilization=0.5 if self.parallel.colocated else 0.85))  # own GPUs: as simulated

    def layout(self, cfg: RLConfig, nodes: int | None = None, gpus_per_node: int | None = None) -> dict:
        """Plain data for --dryrun and for the at-scale driver: who runs where on `nodes` x `gpus_per_node` (the
        allocation; default the recommended one), and vLLM's speculative_config. The trainer split is
        `cfg.backend.megatron` when the trainer is Megatron and the engine TP `cfg.backend.vllm.tensor_parallel_size`
        when the generator is vLLM (so overrides and --tune reach them), else this Scale's."""
        world = (nodes or self.nodes) * (gpus_per_node or self.gpus_per_node)
        megatron = cfg.backend.trainer == "megatron"
        lay = cfg.backend.megatron.layout() if megatron else self.parallel
        split = {"tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "etp": lay.expert_tp}
        if megatron:
            split.update(first_stage_layers=lay.first_stage_layers, last_stage_layers=lay.last_stage_layers)
        placement = cfg.backend.placement
        colocated = placement != "disaggregated" if placement != "inline" else self.parallel.colocated
        vllm = cfg.backend.generator == "vllm"
        engine_tp = cfg.backend.vllm.tensor_parallel_size if vllm else self.parallel.engine.tp
        engines = world // engine_tp if colocated else cfg.backend.generators
        train_gpus = world if colocated else world - engines * engine_tp
        return {
            "gpus": world,
            "megatron": {**split, "dp": train_gpus // (split["tp"] * split["pp"] * split["cp"])},
            "vllm": {"tensor_parallel_size": engine_tp, "engines": engines,
                     "speculative_config": cfg.spec.vllm() if cfg.spec else None},
            "ray": {"placement": "colocated" if colocated else "disaggregated", "async_lag": cfg.backend.async_lag,
                    "bundles": world, "bundle": {"CPU": 1} if self.cpu_bundles else {"GPU": 1}},
        }


def recipe_main(build: Callable[[], RLConfig], argv: list[str] | None = None, scale: Scale | None = None) -> int:
    """Parse `argv`, resolve the config, check it, then print (--dryrun), run locally or submit. Returns the exit
    code; bad input is one line on stderr (exit 2), not a traceback, and nothing has been submitted then."""
    name = build.__name__
    doc = getattr(sys.modules.get(build.__module__), "__doc__", None) or build.__doc__ or ""
    argv = sys.argv[1:] if argv is None else argv
    recipe_scale = scale
    if scale is not None and "--rehearsal" in argv:  # its allocation sets the defaults of --nodes and the layout
        from launchers import rehearsal

        scale = rehearsal.scale(scale)
    args = _parser(name, doc, scale).parse_intermixed_args(argv)
    try:
        cfg = build()
        tuned = None
        toy_arch = None
        if args.rehearsal:
            if recipe_scale is None:
                raise ValueError(f"--rehearsal rehearses an at-scale recipe; {name} already runs at toy size")
            if args.tune:
                raise ValueError("--rehearsal runs the recipe's own layout at toy size; drop --tune")
            toy_arch = rehearsal.toy_architecture(cfg.model.policy)
            full_size = rehearsal.full_size_audit(apply_overrides(cfg, args.overrides), recipe_scale, args.gpu)
            if not args.dryrun and full_size["fits"] is False:
                raise ValueError(f"--rehearsal of {name}: the recipe does not fit its GPUs at full size, so a toy run "
                                 f"of it proves nothing: {'; '.join(full_size['problems'])}")
            cfg = apply_overrides(cfg, rehearsal.overrides(name, cfg, recipe_scale))
        if args.tune:
            cfg, scale, tuned = tune_recipe(name, cfg, scale, args)
        if args.config:
            cfg = load_yaml(args.config, base=cfg)
        cfg = apply_overrides(cfg, args.overrides)
        if toy_arch is not None and rehearsal.problems(cfg, toy_arch):  # a stage it could not show working
            why = f"--rehearsal of {name} cannot run: {'; '.join(rehearsal.problems(cfg, toy_arch))}"
            if not args.dryrun:
                raise NotImplementedError(why)
            print(f"{name}: note: {why}", file=sys.stderr)
        if toy_arch is not None and not args.dryrun:  # the toy inputs, before the checks look for them
            rehearsal.build_toy(cfg, toy_arch)
        plan = executor_plan(name, args, cfg, scale)
        if tuned is not None:
            plan["tuned"] = tuned
        if toy_arch is not None:  # what the rehearsal replaced the model by
            plan["rehearsal"] = {"toy_architecture": toy_arch, "refused_stages": rehearsal.problems(cfg, toy_arch),
                                 "full_size_audit": full_size}
        if scale is not None and toy_arch is None:  # the simulator's plain step on this layout, for the checks
            plan["projected"] = project(cfg, plan["recommended"], args.gpu)
            if problems := timeout_problems(cfg, plan["projected"]):
                raise ValueError("; ".join(problems))
        check_save_cadence(plan, cfg)  # the first save and the signal within --time (plan["save"])
        if args.audit or args.audit_json:
            return audit_main(name, args, cfg, scale, plan)
        check_before_launch(name, args, cfg, scale, plan)
        if args.dryrun:
            print(f"# {name}: resolved config\n{dump_yaml(cfg)}")
            if scale is not None:  # the memory audit's table, as YAML comments (`--audit` exits on it)
                print(audit_summary(cfg, plan, args.gpu))
            plan_text = yaml.safe_dump(plan, sort_keys=False, width=200)
            print(f"# executor plan (--dryrun: nothing runs)\n{plan_text}", end="")
            if args.executor != "local":
                what = "submitted with sbatch" if args.executor == "ray-slurm" else "the same job without NeMo-Run"
                print(f"# sbatch script ({TEMPLATES[plan['executor']]} rendered; {what})\n"
                      f"{render_sbatch(plan, plan['command'], name)}", end="")
            return 0
        if tuned is not None:
            print(f"{name}: tuned layout {json.dumps(tuned, sort_keys=True)}", file=sys.stderr)
        if args.executor == "local":
            summary = run_local(name, cfg, scale)
            print(json.dumps(summary, default=str, sort_keys=True))
            return 0
        from launchers import submit

        submit(plan, name, _remote_argv(name, args), workdir=REPO)
        return 0
    except (ValueError, FileNotFoundError, MissingExtra, NotImplementedError) as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2


def audit_main(name: str, args: argparse.Namespace, cfg: RLConfig, scale: Scale | None, plan: dict) -> int:
    """`--audit` / `--audit-json FILE`: the memory audit of the plan's layout on --gpu GPUs, printed (and written);
    0 when every rank and node fits and the rollouts split, else 1 with the problems on stderr. Runs nothing and
    needs no GPU and no hub (the architecture comes from a local config.json or a preset)."""
    from launchers.audit import write_json
    from launchers.checks import audit_of

    if scale is None:
        raise ValueError(f"--audit audits an at-scale recipe's ranks; {name} runs in one process")
    found = audit_of(cfg, plan["recommended"], args.gpu)
    if found is None:
        raise ValueError(f"--audit needs the architecture of {cfg.model.policy} (a local config.json or a preset) "
                         "and backend.trainer=megatron")
    print(f"# {name}: memory audit on {args.gpu} ({plan['recommended']['gpus']} GPUs)\n{found.table()}")
    if args.audit_json:
        write_json(found, args.audit_json)
    if not found.fits:
        print(f"{name}: error: the memory audit refuses this run: {'; '.join(found.problems)}", file=sys.stderr)
        return 1
    return 0


def audit_summary(cfg: RLConfig, plan: dict, gpu: str) -> str:
    """The audit's table as comment lines for --dryrun (the YAML around it still parses)."""
    from launchers.checks import audit_of

    found = audit_of(cfg, plan["recommended"], gpu)
    if found is None:
        return "# memory audit: the policy's architecture is not known here"
    return "\n".join(f"# {line}" for line in f"memory audit on {gpu}:\n{found.table()}".splitlines())


def needs_ray(cfg: RLConfig, scale: Scale | None) -> bool:
    """At-scale recipes and every placement other than `inline` run on a Ray cluster."""
    return scale is not None or cfg.backend.placement != "inline"


def check_before_launch(name: str, args: argparse.Namespace, cfg: RLConfig, scale: Scale | None, plan: dict) -> None:
    """`launchers.checks.check_launch` for what this command would run: the driver and, where the job runs in
    this environment (local, or submitted without a container; not for --dryrun, which needs nothing installed),
    the extras; the layout on the allocation asked for; the drafter's vocabulary."""
    ray = needs_ray(cfg, scale)
    installs_here = not args.dryrun and (args.executor == "local" or not args.container_image)
    extras = ((*SCALE_EXTRAS,) if scale else ("ray",)) if ray and installs_here else ()
    if args.executor != "local" and not args.dryrun:
        extras = (*extras, "nemo")
    unresolved = check_launch(name, cfg, plan.get("recommended") if scale else None,
                              driver=SCALE_DRIVER if ray else None, extras=extras,
                              container_image=args.container_image, inputs=not args.dryrun)
    if unresolved:  # a dry run runs anywhere: it says what a launch from here would refuse, in one line
        print(f"{name}: note: a launch from this machine would be refused: {'; '.join(unresolved)}", file=sys.stderr)


def tune_space(cfg: RLConfig):
    """What `--tune` searches: the tuner's default space (colocated engines of any TP the Ray placement runs,
    `megatron_spec.layout.colocation_problems`), plus disaggregated placements at the recipe's policy lag when it
    allows one (`backend.async_lag` > 0)."""
    from megatron_spec.sim.tune import TuneSpace

    return TuneSpace(lags=tuple(sorted({0, cfg.backend.async_lag})))


def tune_recipe(name: str, cfg: RLConfig, scale: Scale | None, args: argparse.Namespace):
    """The tuner's best layout for the allocation (`megatron_spec.sim.tune.best_layout`) as the recipe's parallel
    settings: returns the config with it as backend overrides (and the tuner's k for the recipe's drafter; the
    user's own overrides are applied after, so they win), the Scale with its engine TP and placement, and what
    was chosen with the predicted stage times."""
    if scale is None:
        raise ValueError(f"--tune chooses the cluster layout of an at-scale recipe; {name} runs in one process")
    from launchers.checks import policy_config
    from megatron_spec.sim.config import Speculation
    from megatron_spec.sim.tune import best_layout

    model = policy_config(cfg.model.policy, cfg.model.hub_cache)
    if model is None:
        raise ValueError(f"--tune needs the architecture of {cfg.model.policy} (a local config.json or a preset)")
    spec = None
    if cfg.spec is not None:
        spec = Speculation(k=cfg.spec.num_speculative_tokens, acceptance_length=min(TUNE_ACCEPTANCE,
                           cfg.spec.num_speculative_tokens + 1), drafter=cfg.spec.method)
    gpus = args.nodes * args.gpus_per_node
    layout, stages = best_layout(model, gpus, args.gpu, spec=spec, space=tune_space(cfg),
                                 gpu_memory_utilization=TUNE_GPU_MEMORY)
    overrides = {**layout.backend_overrides(), "backend.trainer": "megatron", "backend.generator": "vllm",
                 "backend.vllm.gpu_memory_utilization": TUNE_GPU_MEMORY}
    if spec is not None and layout.method == cfg.spec.method and layout.k > 0:  # the k it ranked best, same drafter
        overrides.update({"spec.num_speculative_tokens": layout.k, "spec.adaptive": layout.adaptive})
    cfg = apply_overrides(cfg, override_args(overrides))
    scale = dataclasses.replace(scale, nodes=args.nodes, gpus_per_node=args.gpus_per_node, parallel=layout.layout,
                                async_lag=layout.async_lag)
    chosen = {"gpus": gpus, "gpu": args.gpu, "train": layout.train.describe(), "train_dp": layout.train_dp,
              "gen_tp": layout.gen_tp, "engines": layout.engines, "placement": layout.placement,
              "async_lag": layout.async_lag, "spec": f"{layout.method} k={layout.k}" + (" adaptive" if
                                                                                       layout.adaptive else ""),
              "predicted_stage_s": {k: round(v, 2) for k, v in stages.items()}}
    return cfg, scale, chosen


def section_fields(sets: dict[str, object], prefix: str) -> dict[str, object]:
    """The fields of one config section among dotted overrides: {"backend.vllm.threads": 1} under "backend.vllm."
    is {"threads": 1}."""
    return {key[len(prefix):]: value for key, value in sets.items() if key.startswith(prefix)}


def run_local(name: str, cfg: RLConfig, scale: Scale | None) -> dict:
    """Run in this process: the embedded GRPO loop (`rl.loop.train`, which hands Ray placements to the driver), or
    an at-scale recipe's layout on the Ray driver."""
    if scale is None:
        from megatron_spec.rl import loop

        return loop.train(cfg)
    driver = importlib.import_module(SCALE_DRIVER)  # its extras were checked before launch
    return driver.train(cfg, scale.layout(cfg))


def executor_plan(name: str, args: argparse.Namespace, cfg: RLConfig, scale: Scale | None) -> dict:
    """The plan `--dryrun` prints: the executor's settings, what runs, and the at-scale layout."""
    ray = needs_ray(cfg, scale)
    allowed = ("local", "ray-slurm") if ray else ("local", "slurm")
    if args.executor not in allowed:
        why = "runs on Ray" if ray else "runs in one process, without Ray"
        raise ValueError(f"{name} {why}: use --executor {' or '.join(allowed)}")
    if args.executor == "local":
        plan = local_plan()
        plan["runs"] = f"{SCALE_DRIVER}.train(cfg, layout)" if scale else "megatron_spec.rl.loop.train(cfg)"
    else:
        account = args.account or ("ACCOUNT" if args.dryrun else None)  # a dry run shows where the account goes
        common = dict(time=args.time, container_image=args.container_image, ssh_host=args.ssh_host,
                      ssh_user=args.ssh_user, job_dir=args.job_dir,
                      container_mounts=[m for m in (args.container_mounts or "").split(",") if m])
        if ray:
            if args.ssh_host:
                raise ValueError("--executor ray-slurm submits slurm/ray.sub with sbatch from the checkout on the "
                                 "cluster: run it on a login node there (without --ssh-host)")
            plan = ray_slurm_plan(account, args.partition, args.nodes, args.gpus_per_node, **common)
        elif args.nodes != 1:
            raise ValueError(f"{name} runs in one process: --nodes must be 1, got {args.nodes}")
        else:  # one task, not one per GPU: the embedded loop is a single process
            plan = slurm_plan(account, args.partition, 1, args.gpus_per_node, ntasks_per_node=1, **common)
        plan["command"] = shlex.join(_remote_argv(name, args))
        if args.container_image:  # the job's packages are the image's: the script imports them before anything
            plan["import_check"] = import_check(SCALE_EXTRAS if scale else ("ray",) if ray else ())
        plan["sbatch_without_nemo_run"] = sbatch_command(plan, plan["command"])
    if scale:
        plan["recommended"] = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "time": scale.time,
                               **scale.layout(cfg, args.nodes, args.gpus_per_node)}
    return plan


def _remote_argv(name: str, args: argparse.Namespace) -> list[str]:
    """This recipe, with the same config arguments, run locally on the cluster (from the packaged checkout)."""
    argv = ["python", f"recipes/{name}.py", *args.overrides]
    if args.config:
        path = os.path.relpath(Path(args.config).resolve(), REPO)
        if path.startswith(".."):
            raise ValueError(f"--config {args.config} is outside the checkout {REPO}, which is what the job gets")
        argv += ["--config", path]
    if args.tune:  # the job tunes for the same allocation, so it runs the layout printed here
        argv += ["--tune", "--gpu", args.gpu, "--nodes", str(args.nodes), "--gpus-per-node", str(args.gpus_per_node)]
    if args.rehearsal:
        argv.append("--rehearsal")
    return [*argv, "--executor", "local"]


def _parser(name: str, doc: str, scale: Scale | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python recipes/{name}.py", description=doc.strip().split("\n\n")[0],
                                epilog="overrides: section.field=value, e.g. grpo.group_size=4 spec=null "
                                "spec.method=ngram run.steps=5")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, applied in order")
    p.add_argument("--config", help="YAML laid over the recipe's config, before the overrides")
    p.add_argument("--dryrun", action="store_true",
                   help="print the resolved config, executor plan and sbatch script; run nothing")
    p.add_argument("--executor", default="local", choices=("local", "slurm", "ray-slurm"),
                   help="local: this process (default); slurm: NeMo-Run's SlurmExecutor; ray-slurm: slurm/ray.sub")
    p.add_argument("--tune", action="store_true",
                   help="at-scale recipes: take the parallel layout from `megatron-spec tune` for --nodes x "
                   "--gpus-per-node GPUs of kind --gpu (overrides still win)")
    p.add_argument("--gpu", default="h100", help="GPU kind the tuner simulates (h100, h200, b200, gb200)")
    p.add_argument("--audit", action="store_true",
                   help="at-scale recipes: print every rank kind's memory at full size (launchers/audit.py: "
                   "fake-tensor parameter counts, analytic states and activations) against --gpu's memory and 2 TB "
                   "of host memory a node; exit 1 when a rank or node does not fit or the rollouts do not split")
    p.add_argument("--audit-json", metavar="FILE", help="with or without --audit: also write the audit as JSON")
    p.add_argument("--rehearsal", action="store_true",
                   help="at-scale recipes: run this recipe's code path at toy width on the allocation at hand "
                   "(launchers/rehearsal.py: toy model, drafter and data under runs/rehearsal/, 4 trainer ranks, "
                   "vLLM TP2, 3 steps)")
    s = p.add_argument_group("slurm and ray-slurm")
    s.add_argument("--account", default=os.environ.get("SBATCH_ACCOUNT"), help="(env SBATCH_ACCOUNT)")
    s.add_argument("--partition", default=os.environ.get("SBATCH_PARTITION"), help="(env SBATCH_PARTITION)")
    s.add_argument("--nodes", type=int, default=scale.nodes if scale else 1)
    s.add_argument("--gpus-per-node", type=int, default=scale.gpus_per_node if scale else 1)
    s.add_argument("--time", default=scale.time if scale else "01:00:00", help="[D-]HH:MM:SS")
    s.add_argument("--container-image", help="container with this package installed (pyxis)")
    s.add_argument("--container-mounts", help="SRC:DST[,SRC:DST...]")
    s.add_argument("--ssh-host", help="submit over SSH from this machine (default: sbatch here)")
    s.add_argument("--ssh-user")
    s.add_argument("--job-dir", help="NeMo-Run's job directory on the cluster")
    return p
