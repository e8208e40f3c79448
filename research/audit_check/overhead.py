"""What does a Megatron trainer rank hold on the CPU before it loads anything of the model? The memory audit's fixed
per-process term for CPU runs (`launchers/audit.py`, `CPU_PROCESS_BYTES`), measured once.

A fresh process does what a rank does before its policy is built: imports torch, Megatron-Core and the project's
Megatron trainer, joins a one-rank gloo group and sets up Megatron's parallel state; its peak resident memory
(VmHWM) is then read. Three fresh processes, the largest kept.

    python research/audit_check/overhead.py      (writes research/records/audit_process_overhead.json)
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = r"""
import os
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29611"), RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as dist
import megatron_spec.trainers.megatron.policy  # noqa: F401  what a rank imports
from megatron.core import parallel_state as ps
dist.init_process_group("gloo")
ps.initialize_model_parallel(1, 1)
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024)
"""


def main() -> int:
    peaks = []
    for i in range(3):
        done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, check=True,
                              env={**__import__("os").environ, "PORT": str(29611 + i), "OMP_NUM_THREADS": "2"})
        peaks.append(int(done.stdout.strip().splitlines()[-1]))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    import torch

    record = {"question": "peak resident memory of a Megatron trainer rank's process before it loads the model",
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip() + ", "
              f"{__import__('os').cpu_count()} CPUs", "torch": torch.__version__, "commit": commit,
              "command": "python research/audit_check/overhead.py", "peak_bytes": peaks,
              "process_overhead_bytes": max(peaks)}
    out = ROOT / "research" / "records" / "audit_process_overhead.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
