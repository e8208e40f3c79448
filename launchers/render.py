"""sbatch scripts rendered from the templates in `slurm/`: the plan's resources on the `#SBATCH` lines and the job's
inputs assigned at the top, so that `sbatch SCRIPT` runs it as it is and `--dryrun` prints exactly what is
submitted. Plain text in, plain text out (no dependencies)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from .plans import OPEN_FILES, RAY_PORTS, ranks_by_node

ROOT = Path(__file__).resolve().parents[1]

TEMPLATES = {"slurm": "slurm/job.sub", "ray-slurm": "slurm/ray.sub"}
"""Executor -> the template it renders: one task on one node, or a Ray cluster with the command on its head."""

_SBATCH = re.compile(r"^#SBATCH --([a-z-]+)(?:=(.*))?$")
_INPUTS = "# ---- inputs, from the environment"


def sbatch_values(plan: dict, name: str) -> dict[str, str | None]:
    """The `#SBATCH` options a plan sets (None: leave the option out, e.g. no partition, no GPUs). The signal
    before the time limit is the plan's `save` entry's (`launchers.cadence`; a plan without one keeps the
    template's)."""
    gpus = plan["gpus_per_node"]
    values = {"account": plan["account"], "partition": plan["partition"], "job-name": name,
              "nodes": str(plan["nodes"]), "gres": f"gpu:{gpus}" if gpus else None, "time": plan["time"],
              "output": f"{log_dir(plan)}/%x-%j.out"}
    if "save" in plan:
        values["signal"] = plan["save"]["signal"]
    return values


def log_dir(plan: dict) -> str:
    """Where a rendered job writes its output, relative to the directory sbatch runs in (the checkout): the plan's
    job directory, else `runs/slurm` (git-ignored). sbatch does not create it; `submit` does."""
    return plan["tunnel"]["job_dir"] or "runs/slurm"


def job_inputs(plan: dict, command: str) -> dict[str, str]:
    """The template's inputs a plan sets: the command, the container and its mounts where given (with the one-line
    import check the template runs in it before anything starts), GPUs per node."""
    env = {"COMMAND": command}
    if plan.get("container_image"):
        env["CONTAINER"] = plan["container_image"]
    if plan.get("container_mounts"):
        env["MOUNTS"] = ",".join(plan["container_mounts"])
    if plan.get("container_image") and plan.get("import_check"):
        env["IMPORT_CHECK"] = plan["import_check"]
    if plan["executor"] == "ray-slurm":
        env["GPUS_PER_NODE"] = str(plan["gpus_per_node"])
    return env


def ray_inputs(plan: dict) -> dict[str, str]:
    """A ray-slurm plan's node settings by the template's input names: CPUs per task (where the plan fixes them),
    the open-file limit, the interface (where given) and every fixed port."""
    ray = plan["ray"]
    env = {"CPUS_PER_TASK": ray["cpus_per_task"], "RAY_NODE_IFACE": ray["node_iface"],
           "OPEN_FILES": ray["open_files"]["target"], "OPEN_FILES_MIN": ray["open_files"]["min"], **ray["ports"]}
    return {k: str(v) for k, v in env.items() if v is not None}


def ray_defaults() -> dict[str, str]:
    """The template's own defaults of the inputs `ray_inputs` sets (what a plan that changes nothing renders)."""
    return {"OPEN_FILES": str(OPEN_FILES["target"]), "OPEN_FILES_MIN": str(OPEN_FILES["min"]),
            **{k: str(v) for k, v in RAY_PORTS.items()}}


def rank_lines(plan: dict) -> list[str]:
    """An at-scale plan's node-major rank list (`plans.ranks_by_node`) as comments, and RANKS_BY_NODE: each
    node's device units, which the template checks against the nodes that joined and hands the driver."""
    layout = plan.get("recommended")
    if not layout or not layout.get("gpus"):
        return []
    nodes = ranks_by_node(layout, plan["nodes"])
    span = lambda r: f"{r[0]}-{r[1]}" if r[0] != r[1] else str(r[0])  # noqa: E731
    out = ["# node-major ranks of the plan's layout (TP and expert groups inside a node):"]
    for n in nodes:
        parts = [f"units {span(n['units'])}"]
        parts += [f"trainer ranks {span(n['trainer_ranks'])}"] if n["trainer_ranks"] else []
        parts += [f"engines {span(n['engines'])}"] if n["engines"] else []
        out.append(f"#   node {n['node']}: {', '.join(parts)}")
    out.append(f"RANKS_BY_NODE={shlex.quote(' '.join(span(n['units']) for n in nodes))}")
    return out


def render_sbatch(plan: dict, command: str, name: str) -> str:
    """The plan's template with its `#SBATCH` lines set (options the plan leaves out removed, template defaults such
    as `--output` kept where the plan has none) and the inputs assigned just before the template reads them."""
    template = TEMPLATES[plan["executor"]]
    values = sbatch_values(plan, name)
    seen, out = set(), []
    lines = (ROOT / template).read_text().splitlines()
    last = max(i for i, line in enumerate(lines) if _SBATCH.match(line))
    for i, line in enumerate(lines):
        m = _SBATCH.match(line)
        if m and m.group(1) in values:
            seen.add(m.group(1))
            if values[m.group(1)] is not None:
                out.append(f"#SBATCH --{m.group(1)}={values[m.group(1)]}")
        elif line.startswith(_INPUTS):
            out.append(f"# ---- rendered by launchers.render_sbatch from {template} for {name} ----")
            out += [f"{k}={shlex.quote(v)}" for k, v in job_inputs(plan, command).items()]
            if plan["executor"] == "ray-slurm":  # the plan's, unless the environment at submission sets one
                out += [f"{k}=${{{k}:-{shlex.quote(v)}}}" for k, v in ray_inputs(plan).items()]
                out += rank_lines(plan)
            out += [f"export {k}={shlex.quote(v)}" for k, v in plan.get("env_vars", {}).items()]
            out += ["", line]
        else:
            out.append(line)
        if i == last:  # options the template has no line for (e.g. GPUs on job.sub) go after its last one
            out += [f"#SBATCH --{k}={v}" for k, v in values.items() if v is not None and k not in seen]
    return "\n".join(out) + "\n"


def sbatch_command(plan: dict, command: str) -> str:
    """The shell line that submits `command` through the plan's template by hand (inputs from the environment,
    resources on the sbatch line), for users without NeMo-Run."""
    env = job_inputs(plan, command)
    if plan["executor"] == "ray-slurm":  # what differs from the template's defaults
        env.update({k: v for k, v in ray_inputs(plan).items() if ray_defaults().get(k) != v})
    flags = [f"--account={plan['account']}", f"--nodes={plan['nodes']}", f"--time={plan['time']}"]
    if (plan.get("save") or {}).get("signal"):
        flags.append(f"--signal={plan['save']['signal']}")
    if plan.get("partition"):
        flags.append(f"--partition={plan['partition']}")
    flags.append(f"--gres=gpu:{plan['gpus_per_node']}" if plan["gpus_per_node"] else "--gres=none")
    assignments = [f"{k}={shlex.quote(v)}" for k, v in env.items()]
    return " ".join([*assignments, "sbatch", *flags, TEMPLATES[plan["executor"]]])
