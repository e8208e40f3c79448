"""Writes `research/records/INDEX.md`: one row per record (file, commit, machine, command, the notes that cite it).

Commit: the code's commit where the record or its file name gives one, otherwise the commit that added the record.
Machine: the record's own `machine` field, shortened. Command: the record's `command` field, else the script its
`benchmark` field names. Run from the repository root: `python research/index_records.py`."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "research" / "records"
NOTEBOOK = ROOT / "research" / "notebook"
PACKAGE_COMMANDS = {"rollout": "megatron-spec bench rollout", "rollout-vs-vllm": "megatron-spec bench rollout --engine vllm",
                    "engine": "megatron-spec bench engine", "step": "megatron-spec bench step"}
HASH = re.compile(r"(?<![0-9a-f])[0-9a-f]{7}(?![0-9a-f])")


def machine(raw) -> str:
    if not raw:
        return ""
    text = str(raw)
    for gpu in ("H100", "H200"):
        if gpu in text:
            return f"one {gpu}"
    cores = re.search(r"(\d+) (?:threads|cpus|CPUs|cores|thread)", text)
    n = f"{cores.group(1)}-thread " if cores else ""
    isa = "AVX-512 " if "AVX512" in text else "AVX2 " if "AVX2" in text else ""
    return f"{n}{isa}EPYC CPU" if "EPYC" in text else text.split(";")[0][:40]


def added_in(path: Path) -> str:
    out = subprocess.run(["git", "log", "--follow", "--diff-filter=A", "--format=%h", "--", str(path)], cwd=ROOT,
                         capture_output=True, text=True).stdout.split()
    return out[-1] if out else ""


def command(data: dict, name: str) -> str:
    if isinstance(data.get("command"), str):
        return data["command"]
    bench = data.get("benchmark")
    if bench in PACKAGE_COMMANDS:
        return PACKAGE_COMMANDS[bench]
    for script in (bench, name.split("_")[0]):
        for folder in ("benchmarks", "research"):
            if script and (ROOT / folder / f"{script}.py").exists():
                return f"python {folder}/{script}.py"
    if name.startswith(("gpu_", "main_job_gpu_", "bench_rollout_gpu_")):
        return "bash benchmarks/gpu_checks.sh"
    if name.startswith("main_job"):
        return "python benchmarks/main_job.py"
    return ""


def citing_notes(name: str) -> list[str]:
    return sorted(p.name for p in NOTEBOOK.glob("*.md") if name in p.read_text(encoding="utf-8"))


RESULTS = ROOT / "docs" / "results.md"


def row(path: Path) -> str:
    data = {}
    if path.suffix == ".json":
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
            data = loaded if isinstance(loaded, dict) else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
    commit = str(data.get("commit") or "")
    if not commit:
        found = HASH.findall(path.name)
        commit = found[0] if found else f"added in {added_in(path)}"
    notes = ", ".join(f"[{n[:13]}](../notebook/{n})" for n in citing_notes(path.name)[:3])
    if f"research/records/{path.name}" in RESULTS.read_text(encoding="utf-8"):
        notes = ", ".join(x for x in ("**[results](../../docs/results.md)**", notes) if x)
    cmd = command(data, path.stem).replace("|", "\\|").replace("\n", " ")
    if len(cmd) > 140:
        cmd = cmd[:137] + "..."
    return f"| `{path.name}` | {commit} | {machine(data.get('machine'))} | {cmd and '`' + cmd + '`'} | {notes} |"


def main() -> None:
    files = sorted(p for p in RECORDS.rglob("*") if p.is_file() and p.suffix != ".png" and p.name != "INDEX.md")
    lines = ["# Records", "",
             "Every measurement's output, frozen; **results** marks the records `docs/results.md` cites. Commit: the code's commit where the record or its name gives one,",
             "otherwise the commit that added the record. Machine: from the record's own `machine` field (blank where it",
             "has none). A PNG beside a JSON is its plot. Commands are as recorded, with the paths of their day",
             "(scripts under `benchmarks/` may since have moved to `research/`). Regenerate with",
             "`python research/index_records.py`.", "",
             "| file | commit | machine | command | cited in |", "|---|---|---|---|---|"]
    lines += [row(p).replace(f"`{p.name}`", f"`{p.relative_to(RECORDS)}`") for p in files]
    (RECORDS / "INDEX.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
