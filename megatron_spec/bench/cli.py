"""`megatron-spec bench {engine,rollout,step}`."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "engine": ("megatron_spec.bench.engine", "plain engine vs HF transformers generate (or vLLM: --peer vllm)"),
    "rollout": ("megatron_spec.bench.rollout", "speculative vs plain decoding per drafter, batch and k (ours vs vLLM: --engine vllm)"),
    "step": ("megatron_spec.bench.step", "RL step stage times, plain vs speculative, with the ideal bound"),
}


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measured benchmarks (ratios taken side by side in one process)")
    kinds = bench.add_subparsers(dest="benchmark", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        p = kinds.add_parser(name, help=help_text)
        # Benchmarks import torch and models; load their argument definitions only when asked for.
        p.set_defaults(func=lambda args, module=module: importlib.import_module(module).main(args))
        importlib.import_module(module).add_arguments(p)
