"""A drafter is one folder: a toy method written as a folder of a package is found by the registry's discovery alone
and runs in the engine, and no method name is spelled in `megatron_spec` outside its own folder and the registry."""

import importlib
import re
import sys
import textwrap
from pathlib import Path

import pytest

import megatron_spec
from megatron_spec.drafters import registry
from megatron_spec.drafters.config import SpecConfig
from megatron_spec.engine import LLMEngine, SamplingParams

ROOT = Path(megatron_spec.__file__).parent
PROMPTS = [[40] * 6, [5, 6, 7, 5, 6, 7], [3], [20, 21, 20, 21, 20]]

TOY = {
    "__init__.py": '"""A toy drafter: k copies of the last token."""\n',
    "proposer.py": """
        from megatron_spec.drafters.proposer import Drafts, Proposer


        class RepeatLast(Proposer):
            def propose(self, seqs, k):
                return Drafts([[s.tokens[-1]] * min(k, s.remaining - 1) for s in seqs])
        """,
    "method.py": """
        from megatron_spec.drafters.registry import DrafterMethod, register


        def _proposer(spec, target, drafter):
            from .proposer import RepeatLast

            return RepeatLast()


        register(DrafterMethod("toy_repeat", _proposer))
        """,
}


@pytest.fixture
def toy_package(tmp_path, monkeypatch):
    """A package `toy_drafters` with the one folder `repeat/`, importable for one test; its method is removed
    after."""
    folder = tmp_path / "toy_drafters" / "repeat"
    folder.mkdir(parents=True)
    (folder.parent / "__init__.py").write_text("")
    for name, text in TOY.items():
        (folder / name).write_text(textwrap.dedent(text).lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "toy_drafters"
    registry.unregister("toy_repeat")
    for name in [m for m in sys.modules if m == "toy_drafters" or m.startswith("toy_drafters.")]:
        del sys.modules[name]


def test_a_drafter_folder_is_discovered_and_runs_in_the_engine(tiny_model, toy_package):
    """Before discovery the name is unknown; after `discover` over the package it is listed and drafts: greedy
    output equals plain greedy output token for token, with drafts both accepted and rejected (the prompts repeat
    tokens)."""
    with pytest.raises(ValueError, match="unknown speculative method 'toy_repeat'"):
        SpecConfig("toy_repeat")
    registry.discover(toy_package)
    assert "toy_repeat" in registry.method_names()
    params = SamplingParams(temperature=0, max_tokens=20)
    plain = LLMEngine(tiny_model, max_num_seqs=2).generate(PROMPTS, params)
    fast = LLMEngine(tiny_model, max_num_seqs=2, spec=SpecConfig("toy_repeat", 3)).generate(PROMPTS, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    drafted = sum(o.spec.get("drafted", 0) for o in fast)
    accepted = sum(o.spec.get("accepted", 0) for o in fast)
    assert 0 < accepted < drafted


def test_the_built_in_drafters_are_their_folders():
    """Every registered method comes from the `method.py` of a folder of `megatron_spec.drafters` named after it:
    taken out of the registry, it is back once that module runs again (and only then)."""
    for name in registry.method_names():
        entry = registry.drafter_method(name)
        registry.unregister(name)
        try:
            assert name not in registry.method_names()
            importlib.reload(importlib.import_module(f"megatron_spec.drafters.{name}.method"))
            assert registry.drafter_method(name).name == name
        finally:
            if name not in registry.method_names():
                registry.register(entry)


def stray_names(root: Path, names: tuple[str, ...]) -> list[str]:
    """`path:line` of each quoted method name (`"mtp"`, `'eagle3'`) in a `.py` file under `root` outside
    `drafters/<that name>/` and `drafters/registry.py`."""
    pattern = re.compile(r"""['"](%s)['"]""" % "|".join(map(re.escape, names)))
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "drafters/registry.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for m in pattern.finditer(line):
                if not rel.startswith(f"drafters/{m.group(1)}/"):
                    found.append(f"{rel}:{number}")
    return found


def test_no_method_name_is_spelled_outside_its_folder():
    assert stray_names(ROOT, registry.method_names()) == []


def test_the_name_check_finds_a_stray_name(tmp_path):
    """The check is able to fail: a name in another module, or in another method's folder, is reported; in its own
    folder and in the registry it is not."""
    files = {"rl/loop.py": 'if method == "mtp":\n    pass\n', "drafters/eagle3/x.py": "k = 'mtp'\n",
             "drafters/mtp/x.py": 'kind = "mtp"\n', "drafters/registry.py": 'DEFAULT = "mtp"\n'}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert stray_names(tmp_path, ("mtp", "eagle3")) == ["drafters/eagle3/x.py:1", "rl/loop.py:1"]
