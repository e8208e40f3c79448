"""The single-machine core never imports torch.distributed, Megatron, vLLM, Ray or NeMo-Run (only distributed/,
launchers/ and recipes/ may), checked on the import statements of every core file."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "megatron_spec"
CORE = ["models", "kernels", "speculative", "drafters", "engine", "rl", "tasks", "sim", "bench",
        "trainers/embedded.py", "generators/embedded.py", "interfaces.py"]
ADAPTERS = {"megatron.py", "vllm.py"}  # a drafter's format adapters to the distributed stacks
FORBIDDEN = ("torch.distributed", "megatron", "vllm", "ray", "nemo_run")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", CORE)
def test_core_does_not_import_distributed_stacks(package):
    root = ROOT / package
    files = [root] if root.is_file() else sorted(f for f in root.rglob("*.py") if f.name not in ADAPTERS)
    assert files, f"no files under {package}"
    bad = [(f.relative_to(ROOT), m) for f in files for m in imported_modules(f)
           if any(m == x or m.startswith(x + ".") for x in FORBIDDEN)]
    assert not bad


def test_the_check_catches_a_violation(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import torch.distributed as dist\nfrom vllm import LLM\n")
    assert {"torch.distributed", "vllm"} <= imported_modules(f)
