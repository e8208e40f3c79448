"""Executor plans, the NeMo-Run executors built from them (a stand-in `nemo_run` records the calls where the real
one is not installed), the missing-extra error, and the Ray-on-SLURM template run against stand-in SLURM/Ray
commands."""

from __future__ import annotations

import ast
import importlib.machinery
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import launchers
from launchers import MissingExtra, local_plan, ray_slurm_plan, slurm_plan
from launchers.plans import ray_sbatch_command

ROOT = Path(__file__).resolve().parents[1]
RAY_SUB = ROOT / "slurm" / "ray.sub"


def test_slurm_plan_holds_what_was_asked():
    plan = slurm_plan("acct", "batch", nodes=4, gpus_per_node=8, time="1-02:00:00", container_image="img",
                      container_mounts=["/a:/a"], env_vars={"X": "1"})
    assert plan == {
        "executor": "slurm", "account": "acct", "partition": "batch", "nodes": 4, "gpus_per_node": 8,
        "ntasks_per_node": 8, "time": "1-02:00:00", "container_image": "img", "container_mounts": ["/a:/a"],
        "env_vars": {"X": "1"}, "tunnel": {"kind": "local", "job_dir": ""},
    }
    ssh = slurm_plan("acct", gpus_per_node=0, ssh_host="login", ssh_user="me", job_dir="/scratch/me/runs")
    assert ssh["ntasks_per_node"] == 1
    assert ssh["tunnel"] == {"kind": "ssh", "host": "login", "user": "me", "job_dir": "/scratch/me/runs"}


@pytest.mark.parametrize("kwargs, message", [
    (dict(account=""), "account"),
    (dict(nodes=0), "nodes must be"),
    (dict(gpus_per_node=-1), "gpus_per_node"),
    (dict(time="2h"), "HH:MM:SS"),
    (dict(container_mounts=["/a"]), "SRC:DST"),
    (dict(ssh_host="login"), "user"),
])
def test_slurm_plan_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        slurm_plan(**{"account": "acct", **kwargs})


def test_ray_plan_is_one_process_per_node():
    plan = ray_slurm_plan("acct", "batch", nodes=16, gpus_per_node=8, container_image="img")
    assert plan["executor"] == "ray-slurm" and plan["ntasks_per_node"] == 1
    assert plan["ray"]["workers"] == 15 and plan["ray"]["gpus"] == 128
    with pytest.raises(ValueError, match="one Ray process per node"):
        ray_slurm_plan("acct", nodes=2, ntasks_per_node=8)
    line = ray_sbatch_command(plan, "python recipes/x.py --executor local")
    assert line.startswith("COMMAND='python recipes/x.py --executor local' GPUS_PER_NODE=8 CONTAINER=img sbatch")
    for flag in ("--account=acct", "--partition=batch", "--nodes=16", "--gres=gpu:8", "slurm/ray.sub"):
        assert flag in line


def test_local_plan():
    assert local_plan() == {"executor": "local", "nodes": 1, "ntasks_per_node": 1, "env_vars": {}}


def test_missing_nemo_run_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_run", None)  # import of nemo_run fails, as when not installed
    with pytest.raises(MissingExtra, match=r"pip install -e \.\[nemo\]"):
        launchers.slurm_executor("acct", "batch", 1, 8, "01:00:00", "img")
    with pytest.raises(MissingExtra, match=r"\[nemo\]"):
        launchers.local_executor()
    with pytest.raises(ValueError, match="unknown extra"):
        launchers.require_extras(("cuda",), "x")


class _Recorder:
    """A stand-in NeMo-Run class: keeps its keyword arguments."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs


@pytest.fixture
def fake_nemo_run(monkeypatch):
    """A minimal `nemo_run` (and `nemo_run.run.ray.job`) recording what the launchers build and submit."""
    run = types.ModuleType("nemo_run")
    run.__spec__ = importlib.machinery.ModuleSpec("nemo_run", None)
    run.submitted = []
    for name in ("LocalExecutor", "SlurmExecutor", "SSHTunnel", "LocalTunnel"):
        setattr(run, name, type(name, (_Recorder,), {}))

    class Script:
        def __init__(self, inline=""):
            self.inline = inline

    class Experiment:
        def __init__(self, title):
            self.title = title

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def add(self, task, executor, name):
            run.submitted.append(("experiment", self.title, task.inline, executor))

        def run(self, detach):
            run.submitted.append(("run", detach))

    class RayJob:
        def __init__(self, name, executor):
            self.name, self.executor = name, executor

        def start(self, command, workdir):
            run.submitted.append(("ray", self.name, command, workdir, self.executor))

    run.Script, run.Experiment = Script, Experiment
    job = types.ModuleType("nemo_run.run.ray.job")
    job.RayJob = RayJob
    for name, module in {"nemo_run": run, "nemo_run.run": types.ModuleType("nemo_run.run"),
                         "nemo_run.run.ray": types.ModuleType("nemo_run.run.ray"), "nemo_run.run.ray.job": job}.items():
        monkeypatch.setitem(sys.modules, name, module)
    return run


def test_executors_carry_the_plan(fake_nemo_run):
    ex = launchers.slurm_executor("acct", "batch", 2, 4, "00:30:00", "img", container_mounts=["/d:/d"],
                                  ssh_host="login", ssh_user="me")
    assert isinstance(ex, fake_nemo_run.SlurmExecutor)
    kw = ex.kwargs
    assert (kw["account"], kw["partition"], kw["nodes"], kw["gpus_per_node"], kw["ntasks_per_node"]) == (
        "acct", "batch", 2, 4, 4)
    assert kw["time"] == "00:30:00" and kw["container_image"] == "img" and kw["container_mounts"] == ["/d:/d"]
    assert kw["tunnel"].kwargs == {"host": "login", "user": "me", "job_dir": "/home/me/nemo_run"}
    assert kw["exclusive"] is None
    ray = launchers.ray_slurm_executor("acct", "batch", 16, 8, "04:00:00", "img")
    assert ray.kwargs["ntasks_per_node"] == 1 and ray.kwargs["exclusive"] is True and ray.kwargs["nodes"] == 16
    assert isinstance(ray.kwargs["tunnel"], fake_nemo_run.LocalTunnel)
    assert launchers.slurm_executor("acct", None, 1, 0, "00:10:00", None).kwargs["gpus_per_node"] is None
    assert launchers.local_executor(ntasks_per_node=2).kwargs == {"ntasks_per_node": 2, "env_vars": {}}


def test_submit_sends_the_command(fake_nemo_run, tmp_path):
    plan = slurm_plan("acct", "batch", nodes=1, gpus_per_node=1)
    launchers.submit(plan, "tiny", ["python", "recipes/tiny_grpo_spec.py", "run.out_dir=a b"], workdir=tmp_path)
    (kind, title, line, executor), run = fake_nemo_run.submitted
    assert (kind, title, run) == ("experiment", "tiny", ("run", True))
    assert line == "python recipes/tiny_grpo_spec.py 'run.out_dir=a b'" and executor.kwargs["partition"] == "batch"
    fake_nemo_run.submitted.clear()
    launchers.submit(ray_slurm_plan("acct", nodes=2), "big", ["python", "x.py"], workdir=tmp_path)
    assert fake_nemo_run.submitted[0][:4] == ("ray", "big", "python x.py", str(tmp_path))
    with pytest.raises(ValueError, match="in-process"):
        launchers.submit(local_plan(), "x", ["true"], workdir=tmp_path)


def test_recipe_submits_itself_with_executor_local(fake_nemo_run):
    from megatron_spec.nemo_run_cli import load_recipe

    tiny = load_recipe(ROOT / "recipes" / "tiny_grpo_spec.py")
    assert tiny.main(["--executor", "slurm", "--account", "acct", "--partition", "batch", "run.steps=2"]) == 0
    (_, _, line, executor), _ = fake_nemo_run.submitted
    assert line == "python recipes/tiny_grpo_spec.py run.steps=2 --executor local"
    assert executor.kwargs["account"] == "acct" and executor.kwargs["nodes"] == 1


def test_real_nemo_run_builds_the_executors():
    """Against the installed NeMo-Run, where there is one (the API the stand-in above imitates)."""
    run = pytest.importorskip("nemo_run")
    ex = launchers.slurm_executor("acct", "batch", 2, 8, "01:00:00", "img", container_mounts=["/d:/d"])
    assert isinstance(ex, run.SlurmExecutor)
    assert (ex.account, ex.partition, ex.nodes, ex.gpus_per_node, ex.ntasks_per_node) == ("acct", "batch", 2, 8, 8)
    assert isinstance(launchers.ray_slurm_executor("a", "b", 4, 8, "01:00:00", "img").tunnel, run.LocalTunnel)
    assert isinstance(launchers.local_executor(), run.LocalExecutor)


def test_launchers_and_recipes_import_heavy_packages_only_lazily():
    heavy = ("nemo_run", "ray", "vllm", "megatron", "torch.distributed")
    files = [*(ROOT / "launchers").glob("*.py"), *(ROOT / "recipes").glob("*.py")]
    files += [ROOT / "megatron_spec" / p for p in ("nemo_run_cli.py", "rl/overrides.py", "rl/cli.py")]
    for path in files:
        for node in ast.parse(path.read_text()).body:  # module level only: imports inside functions are lazy
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:
                top = [h for h in heavy if name == h or name.startswith(h + ".")]
                assert not top, f"{path.relative_to(ROOT)} imports {name} at module level"


def test_ray_sub_has_its_placeholders_and_inputs():
    text = RAY_SUB.read_text()
    head = text[: text.index("set -euo pipefail")]
    for line in ("#SBATCH --account=ACCOUNT", "#SBATCH --partition=PARTITION", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --exclusive"):
        assert line in head
    for var in ("CONTAINER", "MOUNTS", "COMMAND", "GPUS_PER_NODE", "SETUP_COMMAND", "RAY_PORT", "LOG_DIR"):
        assert f"{var}=${{{var}" in text or f"${{{var}:?" in text, var
    assert subprocess.run(["bash", "-n", str(RAY_SUB)]).returncode == 0


def test_ray_sub_runs_head_workers_and_command(tmp_path):
    """The template against stand-ins for scontrol (3 nodes), srun (runs the step here), ray and hostname:
    workers join the head's address, the command runs on the head with RAY_ADDRESS set, its exit code is the job's."""
    bin_dir, py_dir = tmp_path / "bin", tmp_path / "py" / "ray"
    bin_dir.mkdir()
    py_dir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    stubs = {
        "scontrol": "printf 'n1\\nn2\\nn3\\n'",
        "hostname": "echo 10.0.0.1 10.9.9.9",
        "srun": 'while [[ $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done; "$@"',
        "ray": f'echo "ray $*" >> {log}',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    (py_dir / "__init__.py").write_text("def init(**kw): pass\ndef cluster_resources(): return {'GPU': 12}\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(tmp_path / "py"),
           "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "42",
           "CONTAINER": "img", "GPUS_PER_NODE": "4", "RAY_WAIT_S": "5",
           "COMMAND": f'echo "driver $RAY_ADDRESS $(pwd)" >> {log}; exit 3'}
    done = subprocess.run(["bash", str(RAY_SUB)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    calls = log.read_text().splitlines()
    assert "ray start --head --node-ip-address=10.0.0.1 --port=6379" in calls[0] or any(
        c.startswith("ray start --head --node-ip-address=10.0.0.1") for c in calls)
    assert sum(c.startswith("ray start --address=10.0.0.1:6379 --num-gpus=4") for c in calls) == 2
    assert f"driver 10.0.0.1:6379 {tmp_path}" in calls
    assert "Ray cluster up with 12 GPUs" in done.stdout


def test_ray_sub_requires_its_inputs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CONTAINER", "COMMAND")}
    done = subprocess.run(["bash", str(RAY_SUB)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "set CONTAINER" in done.stderr
