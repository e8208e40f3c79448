"""`--rehearsal` of the at-scale recipes, resolved without running: the toy is the recipe's architecture with only
widths changed, and everything a rehearsal is meant to exercise (backends, placement, async lag, speculation method
and k, online drafter training, checkpoint cadence, the kinds of trainer parallelism) is the recipe's own. The toy
itself (94 layers x 128 experts) takes too long to build for this suite; the SLURM tier builds and runs it
(tests/slurm/test_rehearsal.py)."""

from __future__ import annotations

import io
import shutil
from contextlib import redirect_stdout
from pathlib import Path

import pytest

import megatron_spec.rl.loop as loop
from launchers import rehearsal
from megatron_spec import nemo_run_cli
from megatron_spec.models.presets import PRESETS
from megatron_spec.rl.overrides import to_dict

from .test_recipes import split_dryrun

ROOT = Path(__file__).resolve().parents[1]
BUILD_TOY = rehearsal.build_toy
FLAGSHIPS = {"qwen3_235b_grpo_spec": "qwen3-235b-a22b", "qwen3_8b_grpo_spec": "qwen3-8b"}


@pytest.fixture(autouse=True)
def hub_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(loop, "train", lambda cfg: pytest.fail("a dry run trained"))
    monkeypatch.setattr(rehearsal, "build_toy", lambda *a, **k: pytest.fail("a test built the toy"))


def dryrun(name: str, *argv: str):
    """(resolved config, executor plan) that `python recipes/<name>.py ... --dryrun` prints."""
    module = nemo_run_cli.load_recipe(ROOT / "recipes" / f"{name}.py")
    out = io.StringIO()
    with redirect_stdout(out):
        assert module.main([*argv, "--dryrun"]) == 0
    return (*split_dryrun(out.getvalue()), module)


@pytest.mark.parametrize("name", FLAGSHIPS)
def test_toy_is_the_recipe_architecture_with_widths_shrunk(name):
    """Every architecture field of the recipe's preset is kept (layers, experts, top-k, attention and key-value
    heads, rope, norms) except the widths and the vocabulary (the toy tokenizer's); the widths are the ones vLLM's
    CPU kernels accept (head_dim >= 32; expert width per TP2 worker a multiple of 32)."""
    cfg, plan, module = dryrun(name, "--rehearsal")
    recipe_policy = module.__dict__[name]().model.policy
    arch, full = rehearsal.toy_architecture(recipe_policy), PRESETS[FLAGSHIPS[name]]
    assert plan["rehearsal"]["toy_architecture"] == arch  # the dry run prints the toy it would build
    changed = {k for k in full if arch.get(k) != full[k]}
    assert changed == {"vocab_size", *(k for k in rehearsal.WIDTHS if k in full)}
    assert set(arch) - set(full) <= {"head_dim"}
    assert arch["hidden_size"] == 64 and arch["head_dim"] == 32 and arch["vocab_size"] == 49152
    if name == "qwen3_235b_grpo_spec":
        assert (arch["num_hidden_layers"], arch["num_experts"], arch["num_experts_per_tok"],
                arch["num_attention_heads"], arch["num_key_value_heads"]) == (94, 128, 8, 64, 4)
        assert arch["moe_intermediate_size"] // rehearsal.ENGINE_TP % 32 == 0
    else:
        assert (arch["num_hidden_layers"], arch["num_attention_heads"], arch["num_key_value_heads"]) == (36, 32, 8)
        assert "num_experts" not in arch
    assert cfg.model.policy == f"runs/rehearsal/{name}/toy/policy"


@pytest.mark.parametrize("name", FLAGSHIPS)
def test_rehearsal_keeps_what_it_rehearses(name):
    """Backends, placement, async lag, speculation method and k, drafter training, checkpoint cadence, precision
    and recompute equal the recipe's; the trainer keeps each kind of parallelism the recipe uses that runs on gloo
    (size 2, on 4 ranks, CP 1; the 235B's TP is left out: beside EP it needs sequence parallelism, whose norms
    need Transformer Engine or Apex); engines have TP 2 on CPU bundles; the run is 3 steps in its own directory."""
    full, full_plan, _ = dryrun(name)
    toy, toy_plan, _ = dryrun(name, "--rehearsal")
    for section in ("drafter_train",):
        assert to_dict(getattr(toy, section)) == to_dict(getattr(full, section))
    b, fb = toy.backend, full.backend
    assert (b.trainer, b.generator, b.placement, b.async_lag, b.refit_transport) == \
        (fb.trainer, fb.generator, fb.placement, fb.async_lag, fb.refit_transport)
    assert to_dict(toy.grpo.rollout_correction) == to_dict(full.grpo.rollout_correction)
    assert toy.grpo.max_trajectory_age == full.grpo.max_trajectory_age
    assert (b.megatron.params_dtype, b.megatron.recompute) == (fb.megatron.params_dtype, fb.megatron.recompute)
    # Megatron-Core's distributed optimizer needs CUDA: a CPU rehearsal runs AdamW on each rank's shards
    assert fb.megatron.optimizer == "megatron" and b.megatron.optimizer == "torch"  # no GPU in this suite
    assert b.megatron.sequence_parallel is False  # its norms need Transformer Engine or Apex, absent on the CPU
    assert (toy.spec.method, toy.spec.num_speculative_tokens, toy.spec.adaptive) == \
        (full.spec.method, full.spec.num_speculative_tokens, full.spec.adaptive)
    assert toy.spec.model == toy.model.drafter == f"runs/rehearsal/{name}/toy/drafter"
    assert toy.run.save_every == full.run.save_every and toy.run.steps == 3
    assert toy.run.out_dir == f"runs/rehearsal/{name}/run"
    assert (toy.data.path, toy.data.format) == (f"runs/rehearsal/{name}/toy/data.parquet", "dapo")
    m, fm = toy_plan["recommended"]["megatron"], full_plan["recommended"]["megatron"]
    kinds = ("pp", "ep") if fm["ep"] > 1 else ("tp", "pp", "ep")  # TP beside EP needs sequence parallelism
    assert {k: m[k] > 1 for k in kinds} == {k: fm[k] > 1 for k in kinds} and (m["tp"] == 1 or fm["ep"] == 1)
    assert max(m[k] for k in ("tp", "pp", "ep")) == 2 and m["cp"] == fm["cp"] == 1
    assert m["tp"] * m["pp"] * m["cp"] * m["dp"] == rehearsal.WORLD
    audit = toy_plan["rehearsal"]["full_size_audit"]  # the recipe itself, at full size on its GPUs
    assert audit["fits"] is True and audit["problems"] == [] and 60 < audit["largest_rank_gb"] < 85.5
    r, fr = toy_plan["recommended"], full_plan["recommended"]
    assert r["ray"]["placement"] == fr["ray"]["placement"] and r["ray"]["async_lag"] == fr["ray"]["async_lag"]
    assert r["ray"]["bundle"] == {"CPU": 1} and r["vllm"]["tensor_parallel_size"] == 2
    assert r["vllm"]["speculative_config"]["method"] == fr["vllm"]["speculative_config"]["method"]
    assert r["vllm"]["speculative_config"]["num_speculative_tokens"] == full.spec.num_speculative_tokens
    engines = 1 if fr["ray"]["placement"] == "disaggregated" else rehearsal.WORLD // 2
    assert r["vllm"]["engines"] == engines
    assert r["gpus"] == rehearsal.WORLD + (2 if fr["ray"]["placement"] == "disaggregated" else 0)


def test_flagship_235b_is_speculation_with_async_lag_2_disaggregated():
    """The 235B recipe's default is the reference projection's configuration: EAGLE-3 at k=5 with policy lag 2, on
    a disaggregated 64 + 64 split of 16 x 8 GPUs (trainer TP2 PP8 EP8 DP4, 8 engines of TP8), no context
    parallelism; sequence parallelism on, without which Megatron-Core refuses to train MoE layers under TP (met by
    the rehearsal at its first train step)."""
    cfg, plan, _ = dryrun("qwen3_235b_grpo_spec")
    assert cfg.backend.megatron.sequence_parallel
    assert (cfg.spec.method, cfg.spec.num_speculative_tokens, cfg.backend.async_lag) == ("eagle3", 5, 2)
    rec = plan["recommended"]
    assert rec["ray"]["placement"] == "disaggregated" and rec["gpus"] == 128
    m = rec["megatron"]
    assert (m["tp"], m["pp"], m["cp"], m["ep"], m["dp"]) == (2, 8, 1, 8, 4)
    assert (rec["vllm"]["engines"], rec["vllm"]["tensor_parallel_size"]) == (8, 8)
    assert m["tp"] * m["pp"] * m["dp"] + 8 * 8 == 128


def test_rehearsal_of_a_toy_recipe_is_refused():
    module = nemo_run_cli.load_recipe(ROOT / "recipes" / "tiny_grpo_spec.py")
    assert module.main(["--rehearsal", "--dryrun"]) == 2


def test_data_file_is_dapo_layout_with_verifiable_answers(tmp_path):
    """The rehearsal's data file loads through the data section's own reader as DAPO rows; each answer is the sum
    the prompt asks for, and the recipe's reward (math-verify) scores the boxed answer 1 and another number 0."""
    from megatron_spec.tasks.dataset import load_rows, row_problem
    from megatron_spec.tasks.math_verify_reward import math_verify_reward

    path = rehearsal.write_data(tmp_path / "data.parquet", seed=0)
    rows = load_rows(str(path), "train")
    assert len(rows) == rehearsal.DATA_ROWS
    for row in list(rows)[:8]:
        messages, answer = row_problem(row, "dapo", None, None, None)
        (role, text), = messages
        a, b = (int(x) for x in text.split("What is ")[1].split("?")[0].split(" + "))
        assert role == "user" and answer == str(a + b)
        assert math_verify_reward(f"so \\boxed{{{a + b}}}", answer) == 1.0
        assert math_verify_reward(f"\\boxed{{{a + b + 1}}}", answer) == 0.0


REFUSED = ("qwen3_8b_grpo_spec", ["spec.method=mtp", "backend.megatron.mtp_num_layers=0"], ["online drafter training"])
"""A flagship with overrides that combine what its code path would skip (an MTP head the Megatron trainer does not
train, while drafter_train.online says it is trained), and the stages `problems` names for it."""


def test_rehearsal_refuses_a_stage_it_could_not_show_working(capsys, monkeypatch):
    """A rehearsal that would pass by not doing something (a drafter served frozen while the config says it trains
    online) is refused, here or as a SLURM job, before anything is built or submitted (exit 2), naming each stage
    in run order."""
    import launchers

    name, extra, stages = REFUSED
    module = nemo_run_cli.load_recipe(ROOT / "recipes" / f"{name}.py")
    submitted = []
    monkeypatch.setattr(launchers, "submit", lambda *a, **k: submitted.append(a))
    for argv in ([], ["--executor", "ray-slurm", "--account", "A", "--partition", "cpu", "--gpus-per-node", "0"]):
        assert module.main(["--rehearsal", *argv, *extra]) == 2
        err = capsys.readouterr().err
        assert f"--rehearsal of {name} cannot run: " in err
        named = [stage for stage in stages if f"{stage}: " in err]
        assert named == stages and sorted(named, key=err.index) == stages, err
    assert submitted == []


def test_problems_follow_the_config():
    """The refusal is about what the config combines, not about the recipe: an MTP drafter the Megatron trainer
    would not train (no MTP layers) while drafter_train.online says it is trained is refused, with MTP layers or not
    trained online it is not; the embedded trainer has none of the Megatron stages' problems; dense Qwen3 and
    Qwen3-MoE toys both have a vLLM EAGLE-3 class."""
    cfg, _, _ = dryrun("qwen3_8b_grpo_spec", "--rehearsal")
    arch = rehearsal.toy_architecture("Qwen/Qwen3-8B")
    stages = lambda: [p.split(":")[0] for p in rehearsal.problems(cfg, arch)]  # noqa: E731
    assert stages() == []
    cfg.spec.method, cfg.backend.megatron.mtp_num_layers = "mtp", 0
    assert stages() == ["online drafter training"]
    cfg.drafter_train.online = False
    assert stages() == []
    cfg.drafter_train.online, cfg.backend.megatron.mtp_num_layers = True, 1
    assert stages() == []
    cfg.backend.trainer = "embedded"
    assert stages() == []
    cfg.spec.method = "eagle3"
    assert stages() == [] and rehearsal.problems(cfg, rehearsal.toy_architecture("Qwen/Qwen3-235B-A22B")) == []


def test_shaped_toy_repeats_its_token_and_its_eagle3_head_fuses_evenly():
    """`shape_policy` makes a random toy (the 8B's 36 layers at toy width) put probability above 0.999 on repeating
    its last token at every position of a random prompt, through all its layers; `shape_drafter` sets the EAGLE-3
    fusion to the mean of the three captured states (each block the identity over 3) and leaves `lm_head` the
    target's."""
    import torch

    from megatron_spec.models import CausalLM, ModelConfig
    from megatron_spec.drafters.eagle3.model import Eagle3Head

    torch.manual_seed(0)
    model = rehearsal.shape_policy(CausalLM(ModelConfig(**rehearsal.toy_architecture("Qwen/Qwen3-8B")))).eval()
    ids = torch.randint(0, 49152, (1, 24))
    with torch.no_grad():
        probs = model(ids).float().softmax(-1)
    assert probs[0, torch.arange(24), ids[0]].min() > 0.999
    head = rehearsal.shape_drafter(Eagle3Head.from_target(model))
    h = head.fc.weight.shape[0]
    assert torch.equal(head.fc.weight, torch.eye(h).repeat(1, 3) / 3)
    assert torch.equal(head.lm_head.weight, model.lm_head.weight)


def test_build_toy_writes_a_loadable_policy_drafter_and_data(tmp_path):
    """`build_toy` at a small width and depth (the flagship's own is for the SLURM tier): the policy loads with its
    tokenizer and chat template, the EAGLE-3 head loads against it (the drafter's fingerprint check), the data file
    is there; a drafter removed later is rebuilt for the same policy weights while the policy is left untouched."""
    import torch

    from megatron_spec.models import from_pretrained
    from megatron_spec.drafters.files import load_drafter
    from megatron_spec.models.gguf import load_tokenizer
    from megatron_spec.rl.overrides import apply_overrides

    cfg, _, _ = dryrun("qwen3_8b_grpo_spec", "--rehearsal")
    cfg = apply_overrides(cfg, [f"model.policy={tmp_path / 'policy'}", f"model.drafter={tmp_path / 'drafter'}",
                                f"spec.model={tmp_path / 'drafter'}", f"data.path={tmp_path / 'data.parquet'}"])
    arch = {**rehearsal.toy_architecture("Qwen/Qwen3-8B"), "num_hidden_layers": 2}
    build = BUILD_TOY  # the module's own function (the autouse fixture replaces it with a refusal)
    build(cfg, arch)
    policy = from_pretrained(tmp_path / "policy")
    assert policy.config.num_hidden_layers == 2 and policy.config.vocab_size == 49152
    assert load_tokenizer(tmp_path / "policy").apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    head = load_drafter(tmp_path / "drafter", policy.config)
    assert torch.equal(head.lm_head.weight, policy.lm_head.weight) and (tmp_path / "data.parquet").is_file()
    stamp = (tmp_path / "policy" / "model.safetensors").stat().st_mtime_ns
    first = (tmp_path / "drafter" / "model.safetensors").read_bytes()
    shutil.rmtree(tmp_path / "drafter")
    build(cfg, arch)
    assert (tmp_path / "policy" / "model.safetensors").stat().st_mtime_ns == stamp
    assert (tmp_path / "drafter" / "model.safetensors").read_bytes() == first


def test_a_recipe_that_does_not_fit_at_full_size_is_not_rehearsed(capsys):
    """The 8B recipe with torch AdamW's unsharded states (124 GB a GPU by the audit): its rehearsal is refused before
    any toy input is built, naming the audit's problem."""
    from recipes import qwen3_8b_grpo_spec as r8

    assert r8.main(["--rehearsal", "backend.megatron.optimizer=torch"]) == 2
    err = capsys.readouterr().err
    assert "--rehearsal of qwen3_8b_grpo_spec: the recipe does not fit its GPUs at full size" in err
    assert "set backend.megatron.optimizer=megatron" in err
