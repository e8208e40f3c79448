"""What every recipe file shares: the command line, config resolution, executor plans and the local run.

A recipe file is one function returning its `RLConfig` plus, for the at-scale models, a `Scale` (cluster shape and
parallelism); its `main(argv)` hands both to `recipe_main`:

    python recipes/<name>.py [key=value ...] [--config YAML] [--dryrun] [--executor local|slurm|ray-slurm] [...]

The config is the recipe's function, then the YAML laid over it, then the overrides in order. `--dryrun` prints the
resolved config and the executor plan and runs nothing (no optional dependency needed). `local` runs in this
process; `slurm` / `ray-slurm` submit, through NeMo-Run, this same command with `--executor local` on the cluster.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from launchers import MissingExtra, local_plan, ray_slurm_plan, require_extras, slurm_plan
from launchers.plans import ray_sbatch_command
from megatron_spec.layout import Layout, check_layout
from megatron_spec.rl.config import RLConfig
from megatron_spec.rl.overrides import apply_overrides, dump_yaml, load_yaml

REPO = Path(__file__).resolve().parents[1]

SCALE_EXTRAS = ("megatron", "vllm", "ray")
"""What an at-scale recipe needs to run: Megatron-Core trains, vLLM generates, Ray places both."""

SCALE_DRIVER = "megatron_spec.backends.ray.driver"
"""Module whose `train(cfg, layout)` runs an at-scale recipe on the Ray cluster this process is attached to."""


@dataclass(frozen=True)
class Scale:
    """Recommended cluster and parallelism of an at-scale recipe (Megatron-Core names in brackets)."""

    nodes: int
    """SLURM nodes."""
    gpus_per_node: int
    """GPUs per node; the policy trains on all of them and, colocated, vLLM generates on all of them in turn."""
    tp: int = 1
    """Megatron tensor parallel size [tensor_model_parallel_size]."""
    pp: int = 1
    """Megatron pipeline parallel size [pipeline_model_parallel_size]."""
    cp: int = 1
    """Megatron context parallel size: long rollouts split over ranks [context_parallel_size]."""
    ep: int = 1
    """Megatron expert parallel size, expert tensor parallel 1 [expert_model_parallel_size]."""
    vllm_tp: int = 1
    """vLLM tensor parallel size of one generation engine; world / vllm_tp engines run data parallel."""
    colocated: bool = True
    """Training and generation share the GPUs (vLLM sleeps while Megatron trains) instead of separate pools."""
    time: str = "04:00:00"
    """SLURM time limit of one job; runs longer than that resume from their last checkpoint."""

    def __post_init__(self) -> None:
        # The device grid, by the one layout validator the backend and the simulator use; the recipe checks its
        # model against the same validator (the layer split of its pipeline stages is the model's business).
        world = self.nodes * self.gpus_per_node
        check_layout(None, Layout(tp=self.tp, pp=self.pp, ep=self.ep, etp=1, cp=self.cp), world)
        if world % self.vllm_tp:
            raise ValueError(f"vLLM TP={self.vllm_tp} does not divide the {world} GPUs")

    def layout(self, cfg: RLConfig) -> dict:
        """Plain data for --dryrun and for the at-scale driver: who runs where, and vLLM's speculative_config."""
        world = self.nodes * self.gpus_per_node
        return {
            "gpus": world,
            "megatron": {"tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "etp": 1,
                         "dp": world // (self.tp * self.pp * self.cp)},
            "vllm": {"tensor_parallel_size": self.vllm_tp, "engines": world // self.vllm_tp,
                     "speculative_config": cfg.spec.vllm() if cfg.spec else None},
            "ray": {"placement": "colocated" if self.colocated else "disaggregated",
                    "bundles": world, "bundle": {"GPU": 1}},
        }


def recipe_main(build: Callable[[], RLConfig], argv: list[str] | None = None, scale: Scale | None = None) -> int:
    """Parse `argv`, resolve the config, then print (--dryrun), run locally or submit. Returns the exit code;
    bad input is one line on stderr (exit 2), not a traceback."""
    name = build.__name__
    doc = getattr(sys.modules.get(build.__module__), "__doc__", None) or build.__doc__ or ""
    args = _parser(name, doc, scale).parse_intermixed_args(argv)
    try:
        cfg = build()
        if args.config:
            cfg = load_yaml(args.config, base=cfg)
        cfg = apply_overrides(cfg, args.overrides)
        plan = executor_plan(name, args, cfg, scale)
        if args.dryrun:
            print(f"# {name}: resolved config\n{dump_yaml(cfg)}")
            plan_text = yaml.safe_dump(plan, sort_keys=False, width=200)
            print(f"# executor plan (--dryrun: nothing runs)\n{plan_text}", end="")
            return 0
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


def run_local(name: str, cfg: RLConfig, scale: Scale | None) -> dict:
    """Run in this process: the embedded GRPO loop, or (at-scale recipes) the Ray driver on an existing cluster."""
    if scale is None:
        from megatron_spec.rl import loop

        return loop.train(cfg)
    require_extras(SCALE_EXTRAS, f"{name} (Megatron-Core training, vLLM generation, Ray placement)")
    try:
        driver = importlib.import_module(SCALE_DRIVER)
    except ModuleNotFoundError as err:
        raise NotImplementedError(f"the at-scale driver {SCALE_DRIVER} is not in this version ({err}); "
                                  "the tiny and smollm2 recipes run on the embedded engine") from err
    return driver.train(cfg, scale.layout(cfg))


def executor_plan(name: str, args: argparse.Namespace, cfg: RLConfig, scale: Scale | None) -> dict:
    """The plan `--dryrun` prints: the executor's settings, what runs, and the at-scale layout."""
    allowed = ("local", "ray-slurm") if scale else ("local", "slurm")
    if args.executor not in allowed:
        why = "runs on Ray" if scale else "runs in one process, without Ray"
        raise ValueError(f"{name} {why}: use --executor {' or '.join(allowed)}")
    if args.executor == "local":
        plan = local_plan()
        plan["runs"] = f"{SCALE_DRIVER}.train(cfg, layout)" if scale else "megatron_spec.rl.loop.train(cfg)"
    else:
        account = args.account or ("ACCOUNT" if args.dryrun else None)  # a dry run shows where the account goes
        common = dict(time=args.time, container_image=args.container_image, ssh_host=args.ssh_host,
                      ssh_user=args.ssh_user, job_dir=args.job_dir,
                      container_mounts=[m for m in (args.container_mounts or "").split(",") if m])
        if scale:
            plan = ray_slurm_plan(account, args.partition, args.nodes, args.gpus_per_node, **common)
        elif args.nodes != 1:
            raise ValueError(f"{name} runs in one process: --nodes must be 1, got {args.nodes}")
        else:  # one task, not one per GPU: the embedded loop is a single process
            plan = slurm_plan(account, args.partition, 1, args.gpus_per_node, ntasks_per_node=1, **common)
        plan["command"] = shlex.join(_remote_argv(name, args))
        if scale:
            plan["sbatch_without_nemo_run"] = ray_sbatch_command(plan, plan["command"])
    if scale:
        plan["recommended"] = {"nodes": scale.nodes, "gpus_per_node": scale.gpus_per_node, "time": scale.time,
                               **scale.layout(cfg)}
    return plan


def _remote_argv(name: str, args: argparse.Namespace) -> list[str]:
    """This recipe, with the same config arguments, run locally on the cluster (from the packaged checkout)."""
    argv = ["python", f"recipes/{name}.py", *args.overrides]
    if args.config:
        path = os.path.relpath(Path(args.config).resolve(), REPO)
        if path.startswith(".."):
            raise ValueError(f"--config {args.config} is outside the checkout {REPO}, which is what the job gets")
        argv += ["--config", path]
    return [*argv, "--executor", "local"]


def _parser(name: str, doc: str, scale: Scale | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python recipes/{name}.py", description=doc.strip().split("\n\n")[0],
                                epilog="overrides: section.field=value, e.g. grpo.group_size=4 spec=null "
                                "spec.method=ngram run.steps=5")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, applied in order")
    p.add_argument("--config", help="YAML laid over the recipe's config, before the overrides")
    p.add_argument("--dryrun", action="store_true", help="print the resolved config and executor plan; run nothing")
    p.add_argument("--executor", default="local", choices=("local", "slurm", "ray-slurm"),
                   help="local: this process (default); slurm / ray-slurm: submit through NeMo-Run")
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
