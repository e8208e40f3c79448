"""Dependency rule for the simulator's core: `megatron_spec.sim` is arithmetic over a `ModelConfig`. It never
imports torch.distributed, Megatron, vLLM or Ray, never imports torch at all (the CPU validation harness that
measures with torch lives in `research/sim_cpu`), and never imports that harness."""

import ast
from pathlib import Path

import megatron_spec.sim

SIM = Path(megatron_spec.sim.__file__).parent
FORBIDDEN = ("torch", "megatron.core", "megatron_core", "vllm", "ray", "benchmarks", "research")


def _imports(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield [node.module]


def test_no_forbidden_imports():
    files = sorted(SIM.glob("*.py"))
    assert len(files) > 10
    for path in files:
        for names in _imports(ast.parse(path.read_text())):
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN and not name.startswith(FORBIDDEN), \
                    f"{path.name} imports {name}"
