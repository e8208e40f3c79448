"""The main job's rollouts with and without the fused paths of small layers, in one process, alternating.

`before`: the fused decoder layer only up to the kernels' linear's own row bound (FUSED_LAYER_MACS = 0), and the
MTP head's depth through its modules (MTPLayer.one_kernel off); `after`: both as shipped. Each of plain decoding,
MTP at k = 3 on every step and the adaptive controller (k_max 3) gets its own engine per setting, warmed by one
untimed rollout (in RL an engine lives across steps), then `--rounds` rollouts of the main job's shape (8 held-out
prompts x 8 samples, T = 1, up to 160 tokens, stopping at EOS), each round running every engine once, the order of
the two settings alternating between rounds. Printed and written: total seconds per engine and setting, after over
before per engine, and spec over plain per setting.

    python research/fused_rows.py --rounds 8 --out research/records/fused_rows.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

from megatron_spec.bench.common import MAIN_JOB_DRAFTER, MAIN_JOB_POLICY, machine, main_job_models
from megatron_spec.engine import LLMEngine, SamplingParams
from megatron_spec.models import decoder
from megatron_spec.drafters.mtp.model import MTPLayer
from megatron_spec.drafters.config import SpecConfig
from megatron_spec.rl.train_drafter import task_prompts

TARGET, DRAFTER = MAIN_JOB_POLICY, MAIN_JOB_DRAFTER
KINDS = {"plain": None, "k3": SpecConfig("mtp", 3, adaptive=False), "adaptive": SpecConfig("mtp", 3, adaptive=True)}


@contextlib.contextmanager
def setting(name: str):
    """`before` or `after` (see the module docstring) for the block; plans are rebuilt on entry and exit."""
    saved = decoder.FUSED_LAYER_MACS, MTPLayer.one_kernel
    if name == "before":
        decoder.FUSED_LAYER_MACS = 0
        MTPLayer.one_kernel = lambda self, x: False
    decoder.FUSED_PLANS.clear()
    try:
        yield
    finally:
        decoder.FUSED_LAYER_MACS, MTPLayer.one_kernel = saved
        decoder.FUSED_PLANS.clear()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    target, head = main_job_models(args.threads)
    prompts = [q for q in task_prompts(TARGET, 8, seed=7, split="bench") for _ in range(8)]
    engines = {(s, k): LLMEngine(target, max_num_seqs=64, spec=spec, drafter=head if spec else None)
               for s in ("before", "after") for k, spec in KINDS.items()}
    seconds = {key: 0.0 for key in engines}
    warm = SamplingParams(temperature=1.0, max_tokens=160, seed=999)
    for (s, k), engine in engines.items():
        with setting(s):
            engine.generate(prompts, warm)
    for r in range(args.rounds):
        params = SamplingParams(temperature=1.0, max_tokens=160, seed=r)
        for s in ("before", "after") if r % 2 == 0 else ("after", "before"):
            with setting(s):
                for k in KINDS:
                    start = time.perf_counter()
                    engines[(s, k)].generate(prompts, params)
                    seconds[(s, k)] += time.perf_counter() - start
        print(f"round {r}: " + " ".join(f"{s}/{k} {t:.2f}s" for (s, k), t in seconds.items()), flush=True)
    result = {
        "benchmark": "fused_rows", "machine": machine(), "target": TARGET, "drafter": DRAFTER,
        "rollout": "8 prompts x 8 samples, T=1, max 160 tokens, EOS stops", "rounds": args.rounds,
        "seconds": {f"{s}/{k}": t for (s, k), t in seconds.items()},
        "after_over_before": {k: seconds[("before", k)] / seconds[("after", k)] for k in KINDS},
        "spec_over_plain": {s: {k: seconds[(s, "plain")] / seconds[(s, k)] for k in KINDS if k != "plain"}
                            for s in ("before", "after")},
    }
    print(json.dumps({k: v for k, v in result.items() if k in ("after_over_before", "spec_over_plain")}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
