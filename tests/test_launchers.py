"""Executor plans, the sbatch scripts rendered from them (golden files), the missing-extra error and the checks before
launch. The Ray-on-SLURM template's multi-node half is tested in tests/test_ray_sub.py; the real NeMo-Run executors
and every template on a live SLURM cluster in tests/slurm (CI's SLURM tier)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import launchers
from launchers import MissingExtra, local_plan, ray_slurm_plan, slurm_plan
from launchers.render import render_sbatch, sbatch_command

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
    line = sbatch_command(plan, "python recipes/x.py --executor local")
    assert line.startswith("COMMAND='python recipes/x.py --executor local' CONTAINER=img GPUS_PER_NODE=8 sbatch")
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


def test_ray_sub_requires_its_inputs():
    env = {k: v for k, v in os.environ.items() if k != "COMMAND"}
    done = subprocess.run(["bash", str(RAY_SUB)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "set COMMAND" in done.stderr


def test_rendered_script_sets_what_the_plan_says():
    """#SBATCH lines from the plan (the partition and GPU lines left out when the plan has none, GPUs added to the
    one-job template, which has no line for them), inputs assigned before the template reads them, container flags
    only where an image is given; bash parses the result."""
    plan = slurm_plan("acct", None, gpus_per_node=2, ntasks_per_node=1, time="00:30:00", env_vars={"X": "a b"})
    text = render_sbatch(plan, "python recipes/tiny_grpo_spec.py --executor local", "tiny")
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == ["#SBATCH --account=acct", "#SBATCH --job-name=tiny", "#SBATCH --nodes=1",
                      "#SBATCH --ntasks-per-node=1", "#SBATCH --time=00:30:00", "#SBATCH --signal=B:USR1@300",
                      "#SBATCH --output=runs/slurm/%x-%j.out", "#SBATCH --gres=gpu:2"]
    assert "COMMAND='python recipes/tiny_grpo_spec.py --executor local'\nexport X='a b'\n" in text
    assert "CONTAINER=" not in text.split("# ---- inputs")[0]
    with_image = render_sbatch(slurm_plan("acct", "batch", gpus_per_node=0, container_image="img:1",
                                          container_mounts=["/d:/d"], job_dir="/scratch/j"), "true", "t")
    head = with_image.split("# ---- inputs")[0]
    assert "CONTAINER=img:1\nMOUNTS=/d:/d\n" in head and "#SBATCH --partition=batch" in head
    assert "#SBATCH --output=/scratch/j/%x-%j.out" in head and "#SBATCH --gres" not in head
    for script in (text, with_image):
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.parametrize("argv, golden", [
    (["recipes/qwen3_235b_grpo_spec.py", "--executor", "ray-slurm", "--account", "A", "--dryrun"],
     "qwen3_235b_ray_slurm_dryrun.txt"),
    (["recipes/tiny_grpo_spec.py", "--executor", "slurm", "--account", "A", "--partition", "batch",
      "--container-image", "nvcr.io/me/megatron-spec:1", "--container-mounts", "/lustre:/lustre", "--dryrun",
      "run.steps=4"], "tiny_slurm_container_dryrun.txt"),
])
def test_dryrun_matches_its_golden_file(argv, golden):
    """`nemo-run ... --dryrun` from the executor plan on, byte for byte: the plan and the rendered sbatch script
    (the resolved config above them is the recipe's, tested in test_recipes; UPDATE_GOLDEN=1 rewrites the files,
    review their diff). The script parses with `bash -n`, and the command it runs is a recipe file that exists,
    whose at-scale driver module exists with its `train`."""
    done = subprocess.run([sys.executable, "-m", "megatron_spec.nemo_run_cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    out = done.stdout[done.stdout.index("# executor plan"):]
    path = ROOT / "tests" / "golden" / golden
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(out)
    assert out == path.read_text()
    script = out.split("# sbatch script", 1)[1].split("\n", 1)[1]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    command = next(line for line in script.splitlines() if line.startswith("COMMAND="))
    recipe = ROOT / command.split()[1]
    assert recipe.is_file() and command.endswith("--executor local'")
    driver = ROOT / "megatron_spec" / "placement" / "driver.py"
    assert "def train(cfg" in driver.read_text()


# ---- checks before launch: each failure a cluster would meet, refused on the submitting machine --------------------

def recipe(name: str):
    from megatron_spec import nemo_run_cli

    return nemo_run_cli.load_recipe(ROOT / "recipes" / f"{name}.py")


@pytest.fixture
def refused(monkeypatch, capsys):
    """Run a recipe's launch (`--executor ray-slurm` / `slurm`, or a local run) with the Hub unreachable, sbatch and
    training replaced by recorders; returns the one error line after asserting exit 2 and that nothing ran."""
    import megatron_spec.rl.loop as loop

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls = []
    monkeypatch.setattr(launchers, "submit", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(loop, "train", lambda cfg: calls.append(cfg))

    def run(name: str, argv: list[str]) -> str:
        assert recipe(name).main(argv) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(err) == 1 and calls == []
        return err[0]

    return run


AT_SCALE_SUBMIT = ["--executor", "ray-slurm", "--account", "a", "--container-image", "img"]


def hub_cache(root: Path, repo: str, config: dict) -> Path:
    """A Hugging Face cache holding `repo` at one snapshot, laid out as huggingface_hub writes it
    (models--org--name/refs/main -> snapshots/<commit>/config.json)."""
    import json

    commit = "0123456789abcdef0123456789abcdef01234567"
    base = root / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))
    return snap


def test_a_hub_name_this_machine_cannot_resolve_is_refused(refused):
    """Qwen/Qwen3-8B, not in the local cache, HF_HUB_OFFLINE set: named with the download command, no preset taken
    in its place, nothing submitted."""
    err = refused("qwen3_8b_grpo_spec", [*AT_SCALE_SUBMIT, "model.hub_cache=/nonexistent/hub"])
    assert ("model.policy hub name Qwen/Qwen3-8B could not be resolved from this machine (HF_HUB_OFFLINE is set; "
            "not in model.hub_cache=/nonexistent/hub)") in err
    assert "hf download Qwen/Qwen3-8B --cache-dir /nonexistent/hub" in err


def test_a_hub_name_in_the_local_cache_resolves_and_its_config_is_the_one_checked(tmp_path, refused, capsys,
                                                                                     monkeypatch):
    """The same hub name found in model.hub_cache resolves (the check reads its cached config.json, not a preset):
    a cached config with 6 attention heads makes TP2's neighbour TP4 fail on 6, where the preset has 32."""
    from launchers.checks import input_problems, policy_config
    from megatron_spec.models import hub
    from megatron_spec.rl.config import ModelSection, RLConfig

    cfg = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 192,
           "max_position_embeddings": 40960}
    snap = hub_cache(tmp_path, "Qwen/Qwen3-8B", cfg)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = RLConfig(model=ModelSection(policy="Qwen/Qwen3-8B", drafter=None, hub_cache=str(tmp_path)), spec=None)
    assert input_problems(run) == [] and hub.resolve("Qwen/Qwen3-8B", str(tmp_path)) == str(snap)
    assert policy_config("Qwen/Qwen3-8B", str(tmp_path)).num_attention_heads == 6
    err = refused("qwen3_8b_grpo_spec", [*AT_SCALE_SUBMIT, f"model.hub_cache={tmp_path}", "backend.megatron.tp=4"])
    assert "train tp=4 does not divide num_attention_heads=6" in err and "Qwen/Qwen3-8B could not" not in err


def test_the_run_resolves_hub_names_into_its_cache_without_a_network(tmp_path, monkeypatch):
    """Where the job runs, hub names become their snapshot directories (huggingface_hub.snapshot_download with the
    config's cache dir); a local path and a name missing offline are left / refused with the fix."""
    from megatron_spec.models import hub
    from megatron_spec.rl.config import ModelSection, RLConfig
    from megatron_spec.drafters.config import SpecConfig

    snap = hub_cache(tmp_path, "org/drafter", {"speculators_model_type": "eagle3"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = RLConfig(model=ModelSection(policy="checkpoints/tiny-qwen3", drafter="org/drafter", hub_cache=str(tmp_path)),
                   spec=SpecConfig("eagle3", 3, model="org/drafter"))
    out = hub.resolve_config(cfg)
    assert (out.model.policy, out.model.drafter, out.spec.model) == ("checkpoints/tiny-qwen3", str(snap), str(snap))
    with pytest.raises(FileNotFoundError, match="hf download org/missing --cache-dir"):
        hub.resolve("org/missing", str(tmp_path))
    assert not hub.is_hub_name("checkpoints/not-there")  # a path under a local directory is a path, missing or not
    # where the machine may reach the hub, the name goes to snapshot_download with the config's cache dir, which
    # downloads or completes it (replaced here by a recorder: nothing is fetched)
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda name, cache_dir=None, **kw: calls.append((name, cache_dir, kw)) or str(snap))
    assert hub.resolve("org/drafter", str(tmp_path)) == str(snap) and calls == [("org/drafter", str(tmp_path), {})]


def test_a_drafter_directory_that_does_not_exist_is_refused(refused):
    err = refused("qwen3_8b_grpo_spec", [*AT_SCALE_SUBMIT, "model.drafter=checkpoints/qwen3-8b-eagle3",
                                         "spec.model=checkpoints/qwen3-8b-eagle3"])
    assert ("model.drafter checkpoints/qwen3-8b-eagle3 does not exist on this machine: give an existing directory "
            "or a hub name") in err


def test_a_drafter_of_another_method_is_refused(refused):
    """An MTP head given to an EAGLE-3 recipe: named, with both ways out."""
    err = refused("tiny_grpo_spec", ["spec.method=eagle3", "model.drafter=checkpoints/tiny-qwen3-deep-careful-mtp",
                                     "spec.model=checkpoints/tiny-qwen3-deep-careful-mtp"])
    assert ("the drafter checkpoints/tiny-qwen3-deep-careful-mtp holds a mtp drafter, the recipe drafts with "
            "spec.method=eagle3: point model.drafter at a eagle3 checkpoint or set spec.method=mtp") in err


def test_context_parallelism_is_refused_before_launch(refused):
    err = refused("qwen3_235b_grpo_spec", [*AT_SCALE_SUBMIT, "backend.megatron.cp=2"])
    assert "backend.megatron.cp=2: context parallelism is not implemented" in err and "use cp=1" in err


def test_moe_tensor_parallelism_without_sequence_parallelism_is_refused_before_launch(refused):
    """Qwen3-235B trains at TP 2: with sequence parallelism off Megatron-Core would raise at the first train step on
    the cluster; the launch check refuses it here, naming the fix, and submits nothing."""
    err = refused("qwen3_235b_grpo_spec", [*AT_SCALE_SUBMIT, "backend.megatron.sequence_parallel=false"])
    assert ("train tp=2 on an MoE model needs sequence parallelism (Megatron-Core refuses to train MoE layers under "
            "tensor parallelism without it): set backend.megatron.sequence_parallel=true") in err


def test_colocated_engines_of_several_gpus_pass_the_layout_check():
    """The 235B's engines are vLLM TP 8; colocated on GPUs they run (a trainer rank and an engine worker on every
    GPU), so the launch's layout check finds nothing against the placement."""
    from launchers.checks import layout_fit_problems

    mod = recipe("qwen3_235b_grpo_spec")
    cfg = mod.qwen3_235b_grpo_spec()
    cfg.backend.placement, cfg.backend.async_lag = "colocated", 0
    layout = mod.SCALE.layout(cfg)
    assert layout["ray"]["placement"] == "colocated" and layout["vllm"]["tensor_parallel_size"] == 8
    assert [p for p in layout_fit_problems(cfg, layout) if "colocated" in p] == []


def test_sequence_parallelism_on_cpu_bundles_is_a_launch_problem():
    """A layout on CPU bundles (a --rehearsal's) cannot run sequence parallelism (Megatron's torch norms); on GPU
    bundles the recipe's own layout, with it on, has no such problem."""
    from launchers.checks import layout_fit_problems

    mod = recipe("qwen3_235b_grpo_spec")
    cfg = mod.qwen3_235b_grpo_spec()
    layout = mod.SCALE.layout(cfg)
    assert cfg.backend.megatron.sequence_parallel and not [p for p in layout_fit_problems(cfg, layout)
                                                           if "sequence" in p]
    layout["ray"]["bundle"] = {"CPU": 1}
    assert [p for p in layout_fit_problems(cfg, layout) if "sequence" in p] == [
        "train sequence parallelism on CPUs: Megatron-Core's torch norms refuse it without Transformer Engine or "
        "Apex, which need CUDA; set backend.megatron.sequence_parallel=false (an MoE model then needs tp=1)"]


@pytest.mark.parametrize("argv, message", [
    # TP 3 neither divides the 32 GPUs nor a node's 8
    (["backend.vllm.tensor_parallel_size=3"], "vLLM TP 3 does not divide the 8 GPUs of a node"),
    # TP 16 on nodes of 6 GPUs: an engine would take a node and a part of another
    (["backend.vllm.tensor_parallel_size=16", "--gpus-per-node", "6", "backend.megatron.tp=1"],
     "a vLLM engine of TP 16 on nodes of 6 GPUs would split a node between engines"),
])
def test_vllm_tensor_parallel_against_nodes_is_refused(argv, message, refused):
    assert message in refused("qwen3_8b_grpo_spec", [*AT_SCALE_SUBMIT, *argv])


def test_max_model_len_below_prompt_plus_max_tokens_is_refused(refused):
    err = refused("qwen3_235b_grpo_spec", [*AT_SCALE_SUBMIT, "backend.vllm.max_model_len=4096"])
    # the recipe's prompts are capped at data.max_prompt_tokens=1024
    assert ("backend.vllm.max_model_len=4096 is below a prompt of up to 1024 tokens plus grpo.max_tokens=8192: set "
            "backend.vllm.max_model_len=9216") in err


def test_max_tokens_beyond_the_models_context_is_refused(refused):
    """The tiny policy's context is 512 positions (its config.json): 600 new tokens cannot fit, before or after a
    prompt."""
    err = refused("tiny_grpo_spec", ["grpo.max_tokens=600"])
    assert ("grpo.max_tokens=600 plus a prompt of up to 256 tokens exceeds the context of "
            "checkpoints/tiny-qwen3-deep-careful (max_position_embeddings=512): lower grpo.max_tokens to 256") in err


def test_zero_steps_is_refused(refused):
    assert "run.steps must be >= 1 (a run of no steps trains nothing), got 0" in refused("tiny_grpo_spec",
                                                                                         ["run.steps=0"])


@pytest.mark.parametrize("argv, message", [
    (["backend.trainer=embedded"], "the plan prints a Megatron trainer but backend.trainer=embedded: set "
                                   "backend.trainer=megatron"),
    (["backend.generator=embedded"], "the plan prints vLLM engines but backend.generator=embedded: set "
                                     "backend.generator=vllm"),
])
def test_backends_other_than_the_plans_are_refused(argv, message, refused):
    assert message in refused("qwen3_8b_grpo_spec", [*AT_SCALE_SUBMIT, *argv])


def test_a_single_device_recipe_asks_for_one_gpu():
    """Without --gpus-per-node an embedded recipe's SLURM plan asks for one GPU (one process), not a node's eight;
    so does a SLURM plan built without saying."""
    from recipes._common import _parser, executor_plan

    args = _parser("tiny_grpo_spec", "", None).parse_intermixed_args(["--executor", "slurm", "--account", "a"])
    plan = executor_plan("tiny_grpo_spec", args, recipe("tiny_grpo_spec").tiny_grpo_spec(), None)
    assert plan["gpus_per_node"] == 1 and plan["ntasks_per_node"] == 1
    assert slurm_plan("a")["gpus_per_node"] == 1 and slurm_plan("a")["ntasks_per_node"] == 1


@pytest.mark.parametrize("template", ["job.sub", "ray.sub"])
def test_the_container_import_check_runs_before_anything(tmp_path, template):
    """With a container named, the rendered script carries the one-line import of what the job needs; run against
    stand-ins for srun (runs here) and ray, a failing import ends the job with exit 3 and its message before the
    command or any Ray process starts."""
    from launchers.checks import import_check

    line = import_check(("megatron", "vllm", "ray"))
    assert line == 'python -c "import megatron_spec, megatron.core, vllm, ray"'
    plan = (ray_slurm_plan if template == "ray.sub" else slurm_plan)("a", container_image="img:1")
    plan["import_check"] = line
    text = render_sbatch(plan, "echo ran", "t")
    assert f"IMPORT_CHECK='{line}'" in text
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    stubs = {"scontrol": "echo n1", "hostname": "echo 10.0.0.1",
             "srun": 'while [[ $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done; "$@"',
             "ray": f'echo "ray $*" >> {log}'}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n1",
           "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "2",
           "COMMAND": f"echo ran >> {log}",
           "IMPORT_CHECK": f'{sys.executable} -c "import no_such_module_for_this_test"'}
    done = subprocess.run(["bash", str(ROOT / "slurm" / template)], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert "cannot import what the job needs" in done.stderr and "nothing was started" in done.stderr
    assert not log.exists()  # neither the command nor Ray ran


def test_the_loop_trains_on_the_hub_snapshot(tmp_path, monkeypatch):
    """`loop.train` with a hub name for the policy runs on that name's snapshot in model.hub_cache (built here with
    the shipped tiny checkpoint's files; nothing is downloaded): the config the run gets names the snapshot."""
    import shutil

    import megatron_spec.rl.loop as loop
    from megatron_spec.rl.overrides import apply_overrides

    src = ROOT / "checkpoints" / "tiny-qwen3-deep-careful"
    snap = hub_cache(tmp_path, "someone/tiny-qwen3", {})
    for f in src.iterdir():
        shutil.copy(f, snap / f.name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = []
    monkeypatch.setattr(loop, "run", lambda cfg, make: seen.append(cfg) or {})
    cfg = apply_overrides(recipe("tiny_grpo_spec").tiny_grpo_spec(),
                          ["model.policy=someone/tiny-qwen3", f"model.hub_cache={tmp_path}", "run.steps=1"])
    loop.train(cfg)
    assert len(seen) == 1 and seen[0].model.policy == str(snap) and seen[0].model.drafter == cfg.model.drafter


def test_what_the_loop_refuses_at_its_start_is_refused_before_submission(refused):
    """The loop's own config checks (`rl.loop.config_problems`, asked again when it starts on the cluster) run on
    the submitting machine: an EAGLE-3 recipe with MTP layers beside the head, and drafter passes the Megatron
    trainer does not make."""
    err = refused("qwen3_235b_grpo_spec", [*AT_SCALE_SUBMIT, "backend.megatron.mtp_num_layers=1"])
    assert "backend.megatron.mtp_num_layers=1 would build MTP layers beside it: set mtp_num_layers=0" in err
    err = refused("qwen3_8b_grpo_spec", [*AT_SCALE_SUBMIT, "drafter_train.replay=2"])
    assert "drafter_train.updates, replay and minibatches > 1 and ema > 0 are the embedded trainer's" in err
