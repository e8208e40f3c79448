"""Megatron-Core backend: the policy (and its MTP drafter) as a Megatron `GPTModel` with TP / PP / EP, trained by
GRPO through Megatron's schedules (`MegatronPolicy`), HF import, and export of sharded parameters as full HF-named
tensors for our engine and vLLM.

Files, in reading order:
    checks.py     clear errors for bad input (parallel sizes that do not divide, config mismatches)     pure
    mapping.py    names and layouts HF <-> Megatron for one parameter (QKV, gate/up, vocab, experts)    pure
    parallel.py   model-parallel state for given TP / PP / EP sizes, and a gloo spawner for CPU runs
    provider.py   HF config -> TransformerConfig + layer specs -> GPTModel (local spec, TE when installed)
    importer.py   HF safetensors -> this rank's shards (only its slices read from the files)
    exporter.py   this rank's shards -> (hf_name, full tensor), in size-bounded buckets, on every rank
    forward.py    policy logits; MTP logits and loss with the trunk detached (only the MTP layers learn)
    step.py       one GRPO step through Megatron's schedule: micro-batch plan, stage forward (MTP detached or
                  coupled), the rl/grpo loss, gradient reductions and clipping
    optimizer.py  this rank's optimizer: AdamW per shard with fp32 masters of bf16 shards, or Megatron-Core's
                  distributed optimizer (CUDA); the policy and the MTP layers clipped apart
    protocol.py   rank 0 announcing its calls (method name and arguments) to follower ranks, which make them
    refit.py      the policy's refit methods: the weights streamed to the loop or sent into the engines' group
    rank_memory.py  every rank's memory peaks, gathered for the step's metrics
    policy.py     MegatronPolicy: the Policy interface on a GPTModel (train_step, logprobs, export_weights),
                  built from the files above, recompute, distributed checkpoints that reshard (save_sharded /
                  load_sharded, checkpoint.py)
    launch.py     torchrun entry of a recipe: rank 0 runs the RL loop, the other ranks follow it
    cpu.py        lets megatron-core 0.16 build PP models, run forward and its schedules on a machine without CUDA
    hf_export.py  a distributed checkpoint -> HF safetensors, streamed (`megatron-spec export-hf`, export_cli.py)
    bench_export.py `python -m megatron_spec.trainers.megatron.bench_export`: export throughput
    bench_train.py  `python -m megatron_spec.trainers.megatron.bench_train`: Megatron vs embedded train step

`checks`, `mapping`, `hf_export` and `export_cli` never import megatron-core; everything else needs
`pip install -e .[megatron]`.
"""

from __future__ import annotations

import importlib

INSTALL_HINT = "pip install -e .[megatron]  (or: pip install 'megatron-core==0.16.*' --no-deps)"


def require_megatron() -> None:
    """Import megatron.core or raise an ImportError that names the extra to install."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:  # pragma: no cover - exercised where megatron-core is absent
        raise ImportError(f"the Megatron backend needs megatron-core, which is not installed: {INSTALL_HINT}") from e


_LAZY = {
    "Parallelism": "parallel",
    "init_model_parallel": "parallel",
    "destroy_model_parallel": "parallel",
    "spawn": "parallel",
    "build_model": "provider",
    "transformer_config": "provider",
    "import_hf": "importer",
    "export_hf": "exporter",
    "export_buckets": "exporter",
    "trunk_logits": "forward",
    "detached_mtp_logits": "forward",
    "mtp_loss": "forward",
    "MegatronPolicy": "policy",
}


def __getattr__(name: str):
    if name in _LAZY:
        require_megatron()
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["INSTALL_HINT", "require_megatron", *_LAZY]  # pure helpers: .checks, .mapping (e.g. rename_for_vllm)
