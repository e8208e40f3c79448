"""Recipes and their YAML: configs equal the recipe functions, `--dryrun` prints and runs nothing, `nemo-run`
delegates to the recipe, at-scale recipes name the extras they miss. `megatron_spec.rl.loop.train` is replaced in
every test that could reach it, so no training runs."""

from __future__ import annotations

import importlib
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

import megatron_spec.rl.loop as loop
from launchers import missing_extras
from megatron_spec import nemo_run_cli
from megatron_spec.cli import main as cli_main
from megatron_spec.rl.config import RLConfig
from megatron_spec.rl.overrides import apply_overrides, from_dict, load_yaml, to_dict
from recipes import gen_configs

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("tiny_grpo_spec", "tiny_moe_grpo_spec", "smollm2_grpo_spec", "qwen3_8b_grpo_spec", "qwen3_235b_grpo_spec")
AT_SCALE = ("qwen3_8b_grpo_spec", "qwen3_235b_grpo_spec")


def recipe(name: str):
    return nemo_run_cli.load_recipe(ROOT / "recipes" / f"{name}.py")


@pytest.fixture(autouse=True)
def hub_offline(monkeypatch):
    """No test here reaches the Hugging Face Hub: hub names resolve from the local cache or not at all."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    """Any path that would start training records the call instead."""
    calls = []
    monkeypatch.setattr(loop, "train", lambda cfg: calls.append(cfg) or {"step": cfg.run.steps - 1})
    return calls


def split_dryrun(out: str) -> tuple[RLConfig, dict]:
    """The resolved config and the executor plan a dry run prints (the sbatch script after them is left out)."""
    config_text, plan_text = out.split("# executor plan")
    plan_text = plan_text.split("# sbatch script")[0]
    return from_dict(yaml.safe_load(config_text)), yaml.safe_load(plan_text.split("\n", 1)[1])


def test_every_recipe_has_a_config_and_back():
    recipes = set(gen_configs.recipe_names())
    configs = {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    assert recipes == configs == set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_config_equals_recipe_and_mirrors_the_dataclasses(name):
    path = ROOT / "configs" / f"{name}.yaml"
    cfg = getattr(recipe(name), name)()
    assert load_yaml(path) == cfg
    # Every field is spelled out (the YAML documents the whole config, not only what differs from the defaults).
    assert yaml.safe_load(path.read_text()) == to_dict(cfg)


def test_reference_recipes_are_what_the_docs_say():
    tiny = recipe("tiny_grpo_spec").tiny_grpo_spec()
    assert tiny.spec is not None and tiny.drafter_train.online  # the README job speculates, drafter trained online
    assert (tiny.model.policy, tiny.model.drafter) == ("checkpoints/tiny-qwen3-deep-careful",
                                                    "checkpoints/tiny-qwen3-deep-careful-mtp")
    assert (ROOT / tiny.model.policy / "config.json").is_file() and (ROOT / tiny.model.drafter).is_dir()  # shipped
    smol = recipe("smollm2_grpo_spec").smollm2_grpo_spec()
    assert smol.model.policy == "smollm2-135m" and smol.model.task == "natural"
    assert smol.spec.method in ("ngram", "history") and smol.model.drafter is None
    big = recipe("qwen3_235b_grpo_spec").SCALE  # 128 H100 at lag 2, k=5, within 80 GB a GPU (its docstring)
    lay = big.parallel
    assert (big.nodes, big.gpus_per_node, lay.tp, lay.pp, lay.cp, lay.ep, lay.engine.tp) == (16, 8, 2, 8, 1, 8, 8)
    assert (lay.colocated, big.gen_gpus, big.async_lag, big.recompute) == (False, 64, 2, "full")


@pytest.mark.parametrize("name", AT_SCALE)
def test_at_scale_recipes_run_what_their_plan_prints(name, capsys):
    """The config an at-scale recipe resolves selects the backends, split, engine TP and placement of its `Scale`,
    and its dry-run plan prints the same; the engines serve a prompt plus `grpo.max_tokens`; the layout is one the
    trainer runs (no context parallelism)."""
    from megatron_spec.layout import support_problems

    mod = recipe(name)
    cfg, scale = getattr(mod, name)(), mod.SCALE
    b, meg = cfg.backend, cfg.backend.megatron
    lay = scale.parallel
    assert (b.trainer, b.generator, b.placement) == ("megatron", "vllm", "colocated" if lay.colocated else
                                                     "disaggregated")
    assert (meg.tp, meg.pp, meg.cp, meg.ep, meg.etp) == (lay.tp, lay.pp, lay.cp, lay.ep, 1)
    assert (meg.first_stage_layers, meg.last_stage_layers) == (lay.first_stage_layers, lay.last_stage_layers)
    assert meg.layout() == replace(lay, engine=None, engines=1, colocated=True)  # the one conversion, both ways
    assert b.vllm.tensor_parallel_size == lay.engine.tp
    assert b.vllm.max_model_len >= cfg.grpo.max_tokens + mod.PROMPT_TOKENS > cfg.grpo.max_tokens
    assert support_problems(meg.layout()) == []
    assert mod.main(["--dryrun"]) == 0
    printed, plan = split_dryrun(capsys.readouterr().out)
    assert printed == cfg
    rec = plan["recommended"]
    world = scale.nodes * scale.gpus_per_node
    assert {k: rec["megatron"][k] for k in ("tp", "pp", "cp", "ep", "etp")} == {
        "tp": meg.tp, "pp": meg.pp, "cp": meg.cp, "ep": meg.ep, "etp": 1}
    assert rec["megatron"]["dp"] * meg.tp * meg.pp * meg.cp == world - scale.gen_gpus  # disaggregated: the rest
    assert rec["vllm"]["tensor_parallel_size"] == lay.engine.tp
    assert rec["vllm"]["engines"] * lay.engine.tp == (scale.gen_gpus or world) and b.async_lag == scale.async_lag
    assert rec["ray"]["placement"] == b.placement and rec["ray"]["bundles"] == world


@pytest.mark.parametrize("name", RECIPES)
def test_dryrun_prints_the_resolved_config_and_runs_nothing(name, capsys, no_training):
    assert recipe(name).main(["grpo.group_size=4", "--dryrun", "run.steps=2"]) == 0
    cfg, plan = split_dryrun(capsys.readouterr().out)
    expected = apply_overrides(getattr(recipe(name), name)(), ["grpo.group_size=4", "run.steps=2"])
    assert cfg == expected and plan["executor"] == "local"
    assert no_training == []
    if name in AT_SCALE:
        assert plan["recommended"]["vllm"]["speculative_config"] == expected.spec.vllm()


def test_config_file_then_overrides(tmp_path, capsys):
    path = tmp_path / "over.yaml"
    path.write_text("spec: null\ngrpo:\n  group_size: 6\n")
    assert recipe("smollm2_grpo_spec").main(["--config", str(path), "grpo.group_size=3", "--dryrun"]) == 0
    cfg, _ = split_dryrun(capsys.readouterr().out)
    base = recipe("smollm2_grpo_spec").smollm2_grpo_spec()
    assert cfg == apply_overrides(base, ["spec=null", "grpo.group_size=3"])


def test_local_executor_runs_the_loop_in_process(no_training, capsys):
    assert recipe("tiny_grpo_spec").main(["run.steps=1", "spec.method=ngram"]) == 0
    expected = apply_overrides(recipe("tiny_grpo_spec").tiny_grpo_spec(), ["run.steps=1", "spec.method=ngram"])
    assert no_training == [expected]
    assert '"step": 0' in capsys.readouterr().out


def test_bad_override_is_one_line_and_trains_nothing(no_training, capsys):
    assert recipe("tiny_grpo_spec").main(["grpo.group_size=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "group_size must be >= 2" in err and no_training == []


def test_nemo_run_command_delegates_to_the_recipe(capsys, no_training):
    path = str(ROOT / "recipes" / "tiny_grpo_spec.py")
    assert nemo_run_cli.main([path, "spec=null", "--dryrun"]) == 0
    cfg, plan = split_dryrun(capsys.readouterr().out)
    assert cfg.spec is None and plan["runs"] == "megatron_spec.rl.loop.train(cfg)" and no_training == []
    assert nemo_run_cli.main([path, "run.steps=1"]) == 0 and len(no_training) == 1
    assert nemo_run_cli.main([str(ROOT / "recipes" / "nope.py")]) == 2
    assert "not a Python file" in capsys.readouterr().err
    assert nemo_run_cli.main([]) == 2


@pytest.mark.parametrize("name", AT_SCALE)
def test_at_scale_recipe_without_extras_names_them(name, capsys, no_training):
    missing = missing_extras(("megatron", "vllm", "ray"))
    if not missing:
        pytest.skip("megatron-core, vLLM and Ray are all installed here")
    assert recipe(name).main([]) == 2
    err = capsys.readouterr().err
    assert f"pip install -e .[{','.join(missing)}]" in err and no_training == []


def test_at_scale_ray_slurm_plan(capsys):
    argv = ["--dryrun", "--executor", "ray-slurm", "--account", "acct", "--partition", "batch",
            "--container-image", "img:1", "--container-mounts", "/data:/data", "spec.num_speculative_tokens=5"]
    assert recipe("qwen3_235b_grpo_spec").main(argv) == 0
    out = capsys.readouterr().out
    cfg, plan = split_dryrun(out)
    assert cfg.spec.num_speculative_tokens == 5
    assert (plan["executor"], plan["account"], plan["partition"], plan["nodes"]) == ("ray-slurm", "acct", "batch", 16)
    assert plan["gpus_per_node"] == 8 and plan["ntasks_per_node"] == 1 and plan["container_mounts"] == ["/data:/data"]
    assert plan["command"] == ("python recipes/qwen3_235b_grpo_spec.py spec.num_speculative_tokens=5 "
                               "--executor local")
    assert "--nodes=16" in plan["sbatch_without_nemo_run"] and "slurm/ray.sub" in plan["sbatch_without_nemo_run"]
    rec = plan["recommended"]
    assert rec["megatron"] == {"tp": 2, "pp": 8, "cp": 1, "ep": 8, "etp": 1, "first_stage_layers": 12,
                               "last_stage_layers": 10, "dp": 4}
    assert rec["vllm"]["tensor_parallel_size"] == 8 and rec["vllm"]["engines"] == 8
    assert rec["vllm"]["speculative_config"]["num_speculative_tokens"] == 5
    script = out.split("# sbatch script", 1)[1]
    assert ("CONTAINER=img:1\nMOUNTS=/data:/data\nIMPORT_CHECK='python -c \"import megatron_spec, megatron.core, vllm, ray\"'"
            "\nGPUS_PER_NODE=8\n") in script and "#SBATCH --nodes=16" in script


def test_embedded_recipe_slurm_plan(capsys):
    argv = ["--executor", "slurm", "--dryrun", "--partition", "cpu", "--gpus-per-node", "0", "--nodes", "1",
            "--time", "00:20:00", "run.steps=3"]
    assert recipe("tiny_grpo_spec").main(argv) == 0
    out = capsys.readouterr().out
    _, plan = split_dryrun(out)
    assert (plan["executor"], plan["partition"], plan["gpus_per_node"], plan["time"]) == ("slurm", "cpu", 0, "00:20:00")
    assert "#SBATCH --partition=cpu" in out and "#SBATCH --gres" not in out  # the rendered slurm/job.sub
    assert plan["nodes"] == 1 and plan["ntasks_per_node"] == 1  # the embedded loop is one process
    assert plan["account"] == "ACCOUNT"  # a dry run without --account shows the placeholder
    assert plan["command"] == "python recipes/tiny_grpo_spec.py run.steps=3 --executor local"


@pytest.mark.parametrize("name, argv, message", [
    ("tiny_grpo_spec", ["--executor", "ray-slurm"], "use --executor local or slurm"),
    ("qwen3_8b_grpo_spec", ["--executor", "slurm"], "use --executor local or ray-slurm"),
    ("smollm2_grpo_spec", ["--executor", "slurm", "--nodes", "2"], "--nodes must be 1"),
    ("tiny_grpo_spec", ["backend.placement=colocated", "--executor", "slurm"], "use --executor local or ray-slurm"),
    ("qwen3_235b_grpo_spec", ["--executor", "ray-slurm", "--ssh-host", "login", "--ssh-user", "me"], "login node"),
])
def test_wrong_executor_shape_is_refused(name, argv, message, capsys):
    assert recipe(name).main([*argv, "--dryrun"]) == 2
    assert message in capsys.readouterr().err


def test_submitting_without_an_account_is_refused(capsys, monkeypatch):
    monkeypatch.delenv("SBATCH_ACCOUNT", raising=False)
    assert recipe("tiny_grpo_spec").main(["--executor", "slurm"]) == 2
    assert "account" in capsys.readouterr().err


def test_scale_layout_is_checked():
    from megatron_spec.layout import Layout

    scale_cls = type(recipe("qwen3_8b_grpo_spec").SCALE)
    with pytest.raises(ValueError, match="does not divide"):
        scale_cls(nodes=1, gpus_per_node=8, parallel=Layout(tp=3, etp=1, engine=Layout()))
    with pytest.raises(ValueError, match="EP\\*PP"):
        scale_cls(nodes=1, gpus_per_node=8, parallel=Layout(pp=2, ep=8, etp=1, engine=Layout()))
    with pytest.raises(ValueError, match="vLLM TP"):
        scale_cls(nodes=1, gpus_per_node=8, parallel=Layout(etp=1, engine=Layout(tp=16)))
    with pytest.raises(ValueError, match="names its vLLM engine"):
        scale_cls(nodes=1, gpus_per_node=8, parallel=Layout(etp=1))


@pytest.fixture
def no_submit(monkeypatch):
    """Submitting records the call instead (nothing may be submitted when a check fails)."""
    import launchers

    calls = []
    monkeypatch.setattr(launchers, "submit", lambda *a, **k: calls.append(a))
    return calls


@pytest.mark.parametrize("name, argv, message", [
    # a layout the model cannot take: Qwen3-235B has 64 attention heads, 4 query groups
    ("qwen3_235b_grpo_spec", ["backend.megatron.tp=3"], "tp=3 does not divide num_attention_heads=64"),
    # more GPUs than the allocation: 8 engines of TP8 beside the trainer on 1 x 8 GPUs
    ("qwen3_235b_grpo_spec", ["--nodes", "1"], "8 generation engines x TP 8 = 64 GPUs, more than the allocation's 8"),
    # a trainer split that does not fit what the engines leave: TP2 x PP8 = 16 per replica on 72 - 64 GPUs
    ("qwen3_235b_grpo_spec", ["--nodes", "9"], "TP*PP*CP = 16 does not divide the 8 devices"),
    ("qwen3_8b_grpo_spec", ["--nodes", "1", "--gpus-per-node", "1"], "TP*PP*CP = 2 does not divide the 1 devices"),
    # chain-length weights for 3 lengths, where the chat task holds 2 (2-3 terms)
    ("qwen3_8b_grpo_spec", ["model.terms_weights=[1,1,1]"], "terms_weights needs 2 non-negative weights"),
])
def test_launch_checks_refuse_before_anything_is_submitted(name, argv, message, capsys, no_submit):
    """Each refusal is one line on stderr naming the problem, exit 2, for a dry run and for a submission alike;
    nothing is submitted. (The recipes' inputs do not resolve on this machine: a submission's line names them too.)"""
    for extra in (["--dryrun"], []):
        assert recipe(name).main(["--executor", "ray-slurm", "--account", "acct", "--container-image", "img",
                                  *argv, *extra]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if "cannot launch" in line]
        assert len(errors) == 1 and message in errors[0] and f"{name} cannot launch" in err
    assert no_submit == []


def test_launch_checks_name_the_driver_the_extras_and_the_drafter(tmp_path, capsys, monkeypatch, no_submit,
                                                                  no_training):
    """An unknown driver module, extras missing where the job would run without a container, a drafter whose
    vocabulary (99) is not the policy's (64) and chain-length weights for 2 lengths where the policy learned 7: all
    named in one error, before anything runs or is submitted."""
    import launchers.checks as checks

    common = importlib.import_module("recipes._common")
    monkeypatch.setattr(common, "SCALE_DRIVER", "megatron_spec.placement.no_such_driver")
    monkeypatch.setattr(checks, "missing_extras", lambda extras: [e for e in extras if e in ("ray", "nemo")])
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"vocab_size": 99}')
    argv = ["backend.placement=colocated", "spec.method=draft_model", f"spec.model={drafter}",
            f"model.drafter={drafter}", "model.terms_weights=[1,1]", "--executor", "ray-slurm", "--account", "acct"]
    assert recipe("tiny_grpo_spec").main(argv) == 2
    err = capsys.readouterr().err
    assert "the driver module megatron_spec.placement.no_such_driver is not in this version" in err
    assert "pip install -e .[ray,nemo]" in err
    assert "terms_weights needs 7 non-negative weights (one per chain length 2..8)" in err
    assert (f"the drafter {drafter} drafts in a vocabulary of 99 tokens, the policy checkpoints/tiny-qwen3-deep-careful "
            "has 64") in err
    assert no_submit == [] and no_training == []
    # with a container image the job's own environment is the image's: only what is checkable here remains
    assert recipe("tiny_grpo_spec").main([*argv, "--container-image", "img"]) == 2
    assert "pip install -e .[ray]" not in capsys.readouterr().err


@pytest.mark.parametrize("name, nodes, model", [("qwen3_235b_grpo_spec", 16, "qwen3-235b-a22b"),
                                                ("qwen3_8b_grpo_spec", 4, "qwen3-8b")])
def test_tune_takes_the_tuners_best_layout(name, nodes, model, capsys):
    """`--tune --dryrun`: the resolved config's backend is `sim.tune.best_layout` for the allocation (the same
    call made here), the plan prints it with its predicted stage times, the chosen layout passes the backend's
    validator (`megatron_spec.layout.check_layout`, Megatron-Core's rules) for the model on those GPUs, and an
    override written on the command line wins over the tuner."""
    from megatron_spec.layout import check_layout
    from megatron_spec.models.presets import preset
    from megatron_spec.sim.config import Speculation
    from megatron_spec.sim.tune import TuneSpace, best_layout

    assert recipe(name).main(["--tune", "--dryrun", "--executor", "ray-slurm", "--account", "a",
                              "backend.async_lag=2"]) == 0
    cfg, plan = split_dryrun(capsys.readouterr().out)
    k = getattr(recipe(name), name)().spec.num_speculative_tokens  # the recipe's k, at the acceptance tune assumes
    space = TuneSpace(lags=(0, 2) if name == "qwen3_235b_grpo_spec" else (0,))  # each recipe's own policy lag
    tuned, stages = best_layout(model, nodes * 8, "h100", spec=Speculation(k=k, acceptance_length=2.8,
                                                                           drafter="eagle3"), space=space)
    meg = cfg.backend.megatron
    assert (meg.tp, meg.pp, meg.ep, meg.cp, meg.first_stage_layers, meg.last_stage_layers) == (
        tuned.train.tp, tuned.train.pp, tuned.train.ep, tuned.train.cp, tuned.train.first_stage_layers,
        tuned.train.last_stage_layers)
    assert cfg.backend.trainer == "megatron" and cfg.backend.placement == tuned.placement
    assert cfg.backend.async_lag == 2  # the override, not the tuner's lag
    assert (cfg.spec.method, cfg.spec.num_speculative_tokens, cfg.spec.adaptive) == ("eagle3", tuned.k, tuned.adaptive)
    chosen = plan["tuned"]
    assert chosen["train"] == tuned.train.describe() and chosen["gen_tp"] == tuned.gen_tp
    assert chosen["predicted_stage_s"] == {k: round(v, 2) for k, v in stages.items()}
    assert set(chosen["predicted_stage_s"]) == {"data", "prepare", "gen", "logprob", "train", "step"}
    check_layout(preset(model), tuned.train, world=nodes * 8)
    assert plan["recommended"]["megatron"]["tp"] == tuned.train.tp
    assert plan["recommended"]["vllm"]["tensor_parallel_size"] == tuned.gen_tp
    assert "--tune --gpu h100" in plan["command"]  # the job tunes for the same allocation


def test_tune_is_for_at_scale_recipes(capsys):
    assert recipe("tiny_grpo_spec").main(["--tune", "--dryrun"]) == 2
    assert "--tune chooses the cluster layout of an at-scale recipe" in capsys.readouterr().err


def test_configs_are_generated_from_their_recipes(tmp_path, capsys):
    """`python -m recipes.gen_configs --check` passes on the shipped configs (each file is exactly what its recipe
    generates), and fails naming the file once one is changed by hand."""
    assert gen_configs.main(["--check", "--out", str(ROOT / "configs")]) == 0
    assert gen_configs.main(["--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {f"{n}.yaml" for n in RECIPES}
    edited = tmp_path / "tiny_grpo_spec.yaml"
    edited.write_text(edited.read_text().replace("max_tokens: 160", "max_tokens: 161"))
    capsys.readouterr()
    assert gen_configs.main(["--check", "--out", str(tmp_path)]) == 1
    assert str(edited) in capsys.readouterr().err


def test_python_and_nemo_run_print_the_same_dryrun():
    """`python recipes/X.py --dryrun` and `nemo-run recipes/X.py --dryrun` are one program: byte-equal output, which
    is the recipe's config and plan; each starts in its own process from the repository root, with no sys.path
    help (recipes and launchers import as installed packages)."""
    args = ["recipes/tiny_grpo_spec.py", "--dryrun", "run.steps=2"]
    nemo_run = [sys.executable, "-c", "import sys; from megatron_spec.nemo_run_cli import main; sys.exit(main())"]
    outs = [subprocess.run(cmd + args, cwd=ROOT, capture_output=True, text=True, check=True).stdout
            for cmd in ([sys.executable], nemo_run)]
    assert outs[0] == outs[1]
    cfg, plan = split_dryrun(outs[0])
    assert cfg == apply_overrides(recipe("tiny_grpo_spec").tiny_grpo_spec(), ["run.steps=2"])
    assert plan["executor"] == "local"


def test_train_without_a_config_runs_the_main_job(no_training, monkeypatch, capsys, tmp_path):
    """`megatron-spec train` with no --config trains the main job's config (the tiny_grpo_spec recipe's), overrides
    on top; outside the repository root it says where the main job lives instead of training something else."""
    monkeypatch.chdir(ROOT)
    assert cli_main(["train", "run.steps=1"]) == 0
    assert no_training == [apply_overrides(recipe("tiny_grpo_spec").tiny_grpo_spec(), ["run.steps=1"])]
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli_main(["train"]) == 2 and len(no_training) == 1
    assert "runs the main job, configs/tiny_grpo_spec.yaml" in capsys.readouterr().err
