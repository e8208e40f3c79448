"""Before a SLURM job: the first save within half its `--time` and the signal before its limit
(`launchers/cadence.py`), the `--signal` the rendered scripts and NeMo-Run ask for, and job.sub passing SLURM's
USR1 on to the process that runs the loop (with a stand-in `srun` that runs the step's command here)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from launchers import cadence, ray_slurm_plan, render_sbatch, slurm_plan
from launchers.executors import nemo_run_signal
from launchers.render import ROOT, sbatch_command
from megatron_spec.rl.config import RunSection


def test_time_limit_parses_slurm_times():
    assert [cadence.time_limit_s(t) for t in ("00:03:00", "04:00:00", "1-02:00:30")] == [180, 14_400, 93_630]


def test_first_save_after_half_the_limit_is_refused_naming_the_fix():
    """235B-like: 10 steps of 1300 s (the simulator's projection) = 3.61 h into a 4 h job, refused with the fields
    to change; save_every_s=3600 brings it to 3600 + 1300 s = 4900 s, inside 7200; without a step time only the
    time cadence can be checked."""
    run = RunSection(save_every=10)
    with pytest.raises(ValueError, match=r"3\.61 h into a 04:00:00 job.*lower run\.save_every, set "
                                         r"run\.save_every_s below 7200"):
        cadence.save_plan(run, "04:00:00", 1300.0)
    ok = cadence.save_plan(RunSection(save_every=10, save_every_s=3600), "04:00:00", 1300.0)
    assert ok == {"signal": "B:USR1@300", "signal_before_s": 300, "save_every": 10, "save_every_s": 3600,
                  "step_s_projected": 1300.0, "first_save_s": 4900}
    assert cadence.save_plan(run, "04:00:00", None)["first_save_s"] is None
    with pytest.raises(ValueError, match="run.save_every_s=8000 s"):
        cadence.save_plan(RunSection(save_every=0, save_every_s=8000), "04:00:00", None)


def test_signal_must_come_before_the_limit():
    with pytest.raises(ValueError, match="run.signal_before_s=300 is not below the job's time limit 00:03:00"):
        cadence.save_plan(RunSection(), "00:03:00", None)
    assert cadence.save_plan(RunSection(signal_before_s=0), "00:03:00", None)["signal"] is None


def test_projected_step_time_is_the_tuned_step_else_the_recipes_own_projection():
    """The tuner's stages carry their `step` (overlap counted); a plan without `--tune` uses the plain-decoding
    projection of the recipe's own layout."""
    tuned = {"gen": 900.0, "train": 400.0, "step": 1000.0}
    assert cadence.projected_step_s({"tuned": {"predicted_stage_s": tuned}, "projected": {"step_s": 7.0}}) == 1000.0
    assert cadence.projected_step_s({"tuned": {"predicted_stage_s": {"gen": 900.0, "train": 400.0}}}) == 1300.0
    assert cadence.projected_step_s({"projected": {"step_s": 1837.5}}) == 1837.5
    assert cadence.projected_step_s({}) is None


def test_235b_recipe_projects_its_own_step_and_sizes_its_checks_by_it(capsys):
    """Without --tune the 235B plan carries the simulator's plain-decoding step on its own layout; the recipe's
    collective timeout covers two of them, 1800 s (the default) does not, and a first save only after 10 steps of
    about half an hour does not fit a 4-hour job: each refusal names its fix, before anything is submitted."""
    from recipes import qwen3_235b_grpo_spec as r235

    argv = ["--executor", "ray-slurm", "--account", "a", "--container-image", "i", "--dryrun"]
    assert r235.main([*argv[-1:]]) == 0
    out = capsys.readouterr().out
    step = float(next(line for line in out.splitlines() if line.startswith("  step_s:")).split()[1])
    assert 1500 < step < 2100 and 2 * step <= r235.qwen3_235b_grpo_spec().backend.init_timeout_s
    assert r235.main([*argv, "backend.init_timeout_s=1800"]) == 2
    err = capsys.readouterr().err
    assert f"backend.init_timeout_s=1800 s is below 2 x the projected step ({step:.0f} s on h100" in err
    assert "set backend.init_timeout_s=4200" in err
    assert r235.main([*argv, "run.save_every_s=null"]) == 2
    assert f"after 10 steps x {step:.0f} s" in capsys.readouterr().err


@pytest.mark.parametrize("make, template", [(slurm_plan, "job.sub"), (ray_slurm_plan, "ray.sub")])
def test_rendered_scripts_ask_for_the_plans_signal(make, template):
    plan = make("A", "cpu", gpus_per_node=0, time="00:10:00")
    cadence.check_save_cadence(plan, type("C", (), {"run": RunSection(signal_before_s=45)})())
    script = render_sbatch(plan, "python x.py", "x")
    assert [line for line in script.splitlines() if "--signal" in line and line.startswith("#SBATCH")] == \
        ["#SBATCH --signal=B:USR1@45"]
    assert "--signal=B:USR1@45" in sbatch_command(plan, "python x.py")
    assert nemo_run_signal(plan) == "USR1@45"
    plan["save"]["signal"] = None
    assert "--signal" not in "".join(l for l in render_sbatch(plan, "x", "x").splitlines() if l.startswith("#SBATCH"))
    assert nemo_run_signal(plan) is None


def test_recipe_dryrun_refuses_a_signal_past_a_short_limit():
    done = subprocess.run([sys.executable, "recipes/tiny_grpo_spec.py", "--executor", "slurm", "--time", "00:03:00",
                           "--dryrun"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "run.signal_before_s=300 is not below" in done.stderr


def test_job_sub_passes_usr1_on_to_the_loop(tmp_path):
    """job.sub with a stand-in `srun` (runs the step's command here): COMMAND is a Python process that installs
    the loop's handlers (`StopRequest.installed`, writing its pid where the template says) and exits 0 once its
    flag is set. USR1 to the batch shell, as `--signal=B:USR1@N` sends it, reaches that process through the
    template's trap; the job's exit code is the command's; the pid file is removed after."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ $1 == -* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    ready = tmp_path / "ready"
    loop_stub = tmp_path / "stub.py"
    loop_stub.write_text(textwrap.dedent(f"""
        import signal, sys
        from pathlib import Path
        from megatron_spec.rl.stop import StopRequest
        stop = StopRequest()
        with stop.installed():
            Path({str(ready)!r}).write_text("1")
            while not stop.requested:
                signal.pause()
        print("stub saw", stop.name)
        sys.exit(0 if stop.name == "SIGUSR1" else 5)
    """))
    pid_file = tmp_path / "driver.pid"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_SUBMIT_DIR": str(ROOT), "COMMAND": f"{sys.executable} {loop_stub}",
           "MEGATRON_SPEC_PID_FILE": str(pid_file), "PYTHONPATH": str(ROOT)}
    job = subprocess.Popen(["bash", str(ROOT / "slurm/job.sub")], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        # the stub's own file says when its handlers are in place (polled, bounded; nothing is timed)
        for _ in range(600):
            if ready.exists() or job.poll() is not None:
                break
            subprocess.run(["sleep", "0.1"])
        assert ready.exists(), job.communicate()[0]
        job.send_signal(signal.SIGUSR1)
        out, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 0, out
    assert "job.sub: USR1 before the time limit passed on to the RL loop" in out
    assert "stub saw SIGUSR1" in out and "job.sub: COMMAND exited with 0" in out
    assert not pid_file.exists()
