"""Dependency rule: megatron_spec.sim never imports torch.distributed, Megatron, vLLM or Ray, and imports torch
only inside the CPU micro-benchmark and operator-census functions."""

import ast
from pathlib import Path

import megatron_spec.sim

SIM = Path(megatron_spec.sim.__file__).parent
FORBIDDEN = ("torch.distributed", "megatron.core", "megatron_core", "vllm", "ray")
TORCH_ALLOWED = {"cpu_profile.py", "cpu_check.py", "cpu_eager.py", "op_census.py"}


def _imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node, [node.module]


def test_no_forbidden_imports():
    for path in SIM.glob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = {id(n) for n in tree.body}
        for node, names in _imports(tree):
            for name in names:
                assert not name.startswith(FORBIDDEN), f"{path.name} imports {name}"
                if name == "torch" or name.startswith("torch."):
                    assert path.name in TORCH_ALLOWED, f"{path.name} imports torch"
                    assert id(node) not in top_level, f"{path.name} imports torch at module level"
