"""Executor factories for the recipes: local, SLURM and Ray-on-SLURM.

Every factory has a plain-data twin: `slurm_plan(...)` returns the dict that `slurm_executor(...)` turns into a
NeMo-Run executor, so `--dryrun` can print exactly what would be submitted on a machine without NeMo-Run.
Pure functions, no global state; `nemo_run` is imported only when an executor is built.

    plans.py      local_plan, slurm_plan, ray_slurm_plan (validated dicts, no dependencies)
    executors.py  local_executor, slurm_executor, ray_slurm_executor, build_executor (NeMo-Run objects)
    render.py     render_sbatch, sbatch_command: slurm/job.sub and slurm/ray.sub filled in for a plan
    submit.py     submit(plan, name, command): a NeMo-Run SlurmExecutor task, or the rendered ray.sub through sbatch
    extras.py     MissingExtra and require_extras: the error that names the pip extra to install
    checks.py     check_launch: the checks before launch (imported by the recipes; reads model configs)
"""

from .executors import build_executor, local_executor, ray_slurm_executor, slurm_executor
from .extras import MissingExtra, missing_extras, require_extras
from .plans import local_plan, ray_slurm_plan, slurm_plan
from .render import render_sbatch, sbatch_command
from .submit import submit

__all__ = [
    "build_executor", "local_executor", "slurm_executor", "ray_slurm_executor",
    "local_plan", "slurm_plan", "ray_slurm_plan", "render_sbatch", "sbatch_command",
    "submit", "MissingExtra", "missing_extras", "require_extras",
]
