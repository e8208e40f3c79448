"""The metrics file a run leaves behind (`RUN_DIR/metrics.jsonl`, one JSON record per step, written by
`rl.logging.StepLogger`) and its reader, for the report, the simulator's comparison and the benchmarks. Stdlib only.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The step records of a run, sorted by step (the last record of a re-run step wins)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}")
    lines = path.read_text(encoding="utf-8").split("\n")
    by_step: dict[int, dict] = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            # Only the last line can be half-written by a crash; anything else is worth a warning.
            if i != len(lines) - 1:
                warnings.warn(f"{path}:{i + 1}: unreadable metrics line skipped")
            continue
        if not isinstance(record, dict) or "step" not in record:
            warnings.warn(f"{path}:{i + 1}: metrics line without a step skipped")
            continue
        by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]
