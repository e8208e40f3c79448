"""What a plain step costs on a vLLM engine started with speculation, under the whole-step gate.

Three runs of the same rollouts, side by side in one process: `plain` (an engine started without speculation),
`gate_off` (an engine with a `draft_model` drafter, k = 3, inside `speculation(False)`) and `spec` (that engine
speculating). The target is a random tiny Qwen3 and the drafter a perturbed copy of it, as large as the target, so
a drafter forward that still ran on plain steps would show as a large excess of `gate_off` over `plain`. Each
round: 16 prompts x 64 tokens (T = 1, EOS ignored, new seed), every run once, the order reversing each round;
round 0 is the untimed warm-up. Printed and written: each run's median seconds and its ratio to `plain`.

    python benchmarks/vllm_step_gate.py --rounds 5 --out research/records/vllm_step_gate.json

With `VLLM_ENABLE_V1_MULTIPROCESSING=0` both engines run their cores in this process (recorded as `engine_core`),
so no idle engine's processes share the cores with the one generating.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from statistics import median

import torch


class _Mode:
    """A generator's `generate` inside or outside `speculation(False)`."""

    def __init__(self, gen, speculate: bool):
        self.gen, self.speculate = gen, speculate

    def generate(self, prompts, params):
        with self.gen.speculation(self.speculate):
            return self.gen.generate(prompts, params)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from megatron_spec.bench.common import machine
    from megatron_spec.drafters.config import SpecConfig
    from megatron_spec.engine import SamplingParams
    from megatron_spec.generators.vllm import VLLMGenerator
    from megatron_spec.generators.vllm.export import export_target
    from megatron_spec.models import CausalLM, preset

    torch.manual_seed(0)
    target = CausalLM(preset("tiny-qwen3")).eval()
    target.reset_parameters(std=0.15)
    draft = CausalLM(preset("tiny-qwen3")).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    with tempfile.TemporaryDirectory() as root:
        export_target(target, Path(root) / "target")
        export_target(draft, Path(root) / "draft")
        plain = VLLMGenerator(f"{root}/target", max_model_len=256)
        spec = VLLMGenerator(f"{root}/target", SpecConfig("draft_model", 3, model=f"{root}/draft"), drafter=draft,
                             max_model_len=256)
        try:
            runs = {"plain": plain, "gate_off": _Mode(spec, False), "spec": _Mode(spec, True)}
            times = {name: [] for name in runs}
            vocab = target.config.vocab_size
            for r in range(args.rounds + 1):
                g = torch.Generator().manual_seed(r)
                prompts = [torch.randint(3, vocab, (8,), generator=g).tolist() for _ in range(16)]
                params = SamplingParams(temperature=1.0, max_tokens=64, seed=r, ignore_eos=True)
                names = list(runs) if r % 2 else list(runs)[::-1]
                for name in names:
                    start = time.perf_counter()
                    runs[name].generate(prompts, params)
                    if r:
                        times[name].append(time.perf_counter() - start)
        finally:
            plain.close()
            spec.close()
    med = {name: median(t) for name, t in times.items()}
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    result = {"benchmark": "vllm_step_gate", "machine": machine(),
              "engine_core": "in this process" if in_process else "a process of its own per engine",
              "rollout": "16 prompts x 64 tokens, T=1, EOS ignored; tiny-qwen3 random target, draft_model k=3 "
                         "(a perturbed copy of the target)", "rounds": args.rounds, "seconds": times,
              "median_s": med, "ratio_to_plain": {name: m / med["plain"] for name, m in med.items()}}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
