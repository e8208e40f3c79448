"""`key=value` overrides, YAML load/dump and `megatron-spec train` argument handling (no training runs)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from megatron_spec.rl import cli as train_cli
from megatron_spec.rl.config import GRPOSection, ModelSection, RLConfig
from megatron_spec.rl.overrides import apply_overrides, dump_yaml, from_dict, load_yaml, to_dict
from megatron_spec.drafters.config import SpecConfig


def test_values_are_coerced_from_the_annotations():
    cfg = apply_overrides(RLConfig(), [
        "grpo.group_size=4", "grpo.lr=3e-5", "grpo.drop_uniform_groups=true", "drafter_train.online=No",
        "model.task=natural", "model.drafter=null", "run.out_dir='runs/x y'", "spec.num_speculative_tokens=5",
    ])
    assert cfg.grpo.group_size == 4 and type(cfg.grpo.group_size) is int
    assert cfg.grpo.lr == 3e-5 and type(cfg.grpo.lr) is float
    assert cfg.grpo.drop_uniform_groups is True and cfg.drafter_train.online is False
    assert cfg.model.task == "natural" and cfg.model.drafter is None
    assert cfg.run.out_dir == "runs/x y"
    assert cfg.spec == SpecConfig("mtp", 5, adaptive=True)
    assert apply_overrides(RLConfig(), ["grpo.temperature=1"]).grpo.temperature == 1.0  # an int is a valid float


def test_input_config_is_not_mutated():
    cfg = RLConfig()
    apply_overrides(cfg, ["grpo.group_size=4", "spec=null"])
    assert cfg == RLConfig()


def test_spec_null_then_fields_start_a_default_section_in_any_order():
    assert apply_overrides(RLConfig(), ["spec=null"]).spec is None
    assert apply_overrides(RLConfig(spec=None), ["spec.method=ngram"]).spec == SpecConfig(method="ngram")
    a = apply_overrides(RLConfig(), ["spec=null", "spec.num_speculative_tokens=5", "spec.method=history"])
    assert a.spec == SpecConfig("history", 5)
    # Setting a field of an existing section keeps its other fields.
    b = apply_overrides(RLConfig(spec=SpecConfig("ngram", 4, prompt_lookup_max=6)), ["spec.num_speculative_tokens=2"])
    assert b.spec == SpecConfig("ngram", 2, prompt_lookup_max=6)
    # A whole section as a YAML mapping, then a field of it.
    c = apply_overrides(RLConfig(), ["spec={method: ngram, num_speculative_tokens: 2}", "spec.prompt_lookup_max=6"])
    assert c.spec == SpecConfig("ngram", 2, prompt_lookup_max=6)


def test_field_of_a_none_section_without_its_required_field_names_it():
    with pytest.raises(ValueError, match=r"spec\.method"):
        apply_overrides(RLConfig(spec=None), ["spec.num_speculative_tokens=5"])


def test_unknown_keys_list_the_valid_keys_of_their_section():
    with pytest.raises(ValueError, match="unknown key 'grpo.group_sze'") as err:
        apply_overrides(RLConfig(), ["grpo.group_sze=3"])
    assert "did you mean grpo.group_size" in str(err.value)
    assert all(f.name in str(err.value) for f in dataclasses.fields(GRPOSection))
    with pytest.raises(ValueError, match="unknown key 'optim'.*model, data, grpo, spec, drafter_train, run"):
        apply_overrides(RLConfig(), ["optim.lr=1"])
    with pytest.raises(ValueError, match="unknown key 'spec.k'.*num_speculative_tokens"):
        apply_overrides(RLConfig(spec=None), ["spec.k=3"])  # checked even while the section is None
    with pytest.raises(ValueError, match="not a section"):
        apply_overrides(RLConfig(), ["grpo.lr.value=1"])


@pytest.mark.parametrize("override, message", [
    ("grpo.group_size=abc", "grpo.group_size expects int, got 'abc'"),
    ("grpo.group_size=2.5", "grpo.group_size expects int"),
    ("grpo.lr=fast", "grpo.lr expects float"),
    ("drafter_train.online=maybe", "drafter_train.online expects bool"),
    ("grpo=null", "grpo cannot be null"),
    ("grpo.top_k=null", "grpo.top_k cannot be null"),
    ("group_size", "not key=value"),
    ("=3", "not key=value"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_overrides(RLConfig(), [override])


def test_values_are_revalidated_by_the_dataclasses():
    with pytest.raises(ValueError, match=r"grpo\.group_size must be >= 2"):
        apply_overrides(RLConfig(), ["grpo.group_size=1"])
    with pytest.raises(ValueError, match="unknown speculative method 'beam'"):
        apply_overrides(RLConfig(), ["spec.method=beam"])
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        apply_overrides(RLConfig(), ["spec.prompt_lookup_min=5"])


@pytest.mark.parametrize("cfg", [
    RLConfig(),
    RLConfig(model=ModelSection(policy="smollm2-135m", drafter=None, task="natural"), spec=None),
    apply_overrides(RLConfig(), ["spec.method=ngram", "grpo.lr=1e-6", "run.resume=false", "grpo.clip_high=0.28"]),
])
def test_yaml_round_trip(cfg, tmp_path):
    path = tmp_path / "cfg.yaml"
    text = dump_yaml(cfg, path)
    assert path.read_text() == text
    assert load_yaml(path) == cfg
    assert from_dict(to_dict(cfg)) == cfg
    # The run directory's config.yaml is written with dataclasses.asdict: it loads back too.
    path.write_text(yaml.safe_dump(dataclasses.asdict(cfg)))
    assert load_yaml(path) == cfg


def test_yaml_is_laid_over_a_base_and_reads_exponents(tmp_path):
    path = tmp_path / "partial.yaml"
    # YAML 1.1 reads `1e-6` (no dot) as a string; the float field still gets a float.
    path.write_text("grpo:\n  group_size: 4\n  lr: 1e-6\nspec: null\n")
    base = RLConfig(run=dataclasses.replace(RLConfig().run, steps=3))
    cfg = load_yaml(path, base=base)
    assert cfg.grpo.group_size == 4 and cfg.grpo.lr == 1e-6 and cfg.spec is None and cfg.run.steps == 3
    assert load_yaml(path).run.steps == RLConfig().run.steps


def test_yaml_errors_name_the_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("grpo:\n  group_size: 8\n  learning_rate: 0.1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: unknown key 'grpo\.learning_rate'.*lr"):
        load_yaml(path)
    path.write_text("model:\n  policy: 3\n")
    with pytest.raises(ValueError, match=r"model\.policy expects str, got 3"):
        load_yaml(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="top level must be a mapping"):
        load_yaml(path)
    path.write_text("grpo: 3\n")
    with pytest.raises(ValueError, match="grpo must be a mapping"):
        load_yaml(path)
    with pytest.raises(FileNotFoundError):
        load_yaml(tmp_path / "missing.yaml")


@dataclass
class _Inner:
    sizes: tuple[int, ...] = (1, 2)
    """A variable-length tuple."""
    pair: tuple[str, float] = ("a", 1.0)
    """A fixed-length tuple."""
    name: str | None = None
    """An optional str."""


@dataclass
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    """A nested section."""


def test_tuples_and_optional_str_fields_of_any_dataclass(tmp_path):
    cfg = apply_overrides(_Outer(), ["inner.sizes=[4, 8,16]", "inner.pair=b,2", "inner.name=none"])
    assert cfg.inner == _Inner((4, 8, 16), ("b", 2.0), None)
    assert apply_overrides(_Outer(), ["inner.sizes=3"]).inner.sizes == (3,)
    assert from_dict(yaml.safe_load(yaml.safe_dump(to_dict(cfg))), _Outer) == cfg  # lists back to tuples
    with pytest.raises(ValueError, match=r"inner\.pair expects 2 values"):
        apply_overrides(_Outer(), ["inner.pair=a,1,2"])
    with pytest.raises(ValueError, match=r"inner\.sizes\[1\] expects int"):
        apply_overrides(_Outer(), ["inner.sizes=1,x"])


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-spec")
    train_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_train_command_dryrun_prints_the_resolved_config(capsys, monkeypatch, tmp_path):
    import megatron_spec.rl.loop as loop

    monkeypatch.setattr(loop, "train", lambda cfg: pytest.fail("--dryrun must not train"))
    path = tmp_path / "c.yaml"
    dump_yaml(RLConfig(spec=None), path)
    args = _train_parser().parse_args(["train", "--config", str(path), "grpo.group_size=4", "--dryrun"])
    assert args.func(args) == 0
    printed = load_yaml_text(capsys.readouterr().out)
    assert printed == apply_overrides(RLConfig(spec=None), ["grpo.group_size=4"])


def test_train_command_calls_the_loop(capsys, monkeypatch):
    """With no --config the command trains the main job's config (configs/tiny_grpo_spec.yaml, from the repository
    root), overrides on top."""
    import megatron_spec.rl.loop as loop

    seen = []
    monkeypatch.setattr(loop, "train", lambda cfg: seen.append(cfg) or {"step": 0, "loss": 0.5})
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    args = _train_parser().parse_args(["train", "run.steps=1", "spec.method=ngram"])
    assert args.func(args) == 0
    assert seen == [apply_overrides(load_yaml(train_cli.MAIN_JOB), ["run.steps=1", "spec.method=ngram"])]
    assert '"loss": 0.5' in capsys.readouterr().out


def test_train_command_bad_override_fails_before_training(monkeypatch):
    import megatron_spec.rl.loop as loop

    monkeypatch.setattr(loop, "train", lambda cfg: pytest.fail("must not train"))
    args = _train_parser().parse_args(["train", "grpo.group_size=1"])
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        args.func(args)  # megatron_spec.cli.main prints this ValueError as one line, exit code 2


def load_yaml_text(text: str) -> RLConfig:
    return from_dict(yaml.safe_load(text))


def test_vllm_runs_eagerly_on_cpus_and_with_cuda_graphs_on_gpus_unless_told():
    """`backend.vllm.enforce_eager` unset picks by platform; set, it wins on either."""
    from megatron_spec.rl.backend_config import VLLMSection

    assert (VLLMSection().eager(on_cpu=True), VLLMSection().eager(on_cpu=False)) == (True, False)
    assert [VLLMSection(enforce_eager=e).eager(on_cpu=c) for e in (True, False) for c in (True, False)] == \
        [True, True, False, False]
    cfg = apply_overrides(RLConfig(), ["backend.vllm.enforce_eager=false"])
    assert cfg.backend.vllm.enforce_eager is False and not cfg.backend.vllm.eager(on_cpu=True)
