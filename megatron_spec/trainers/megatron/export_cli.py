"""`megatron-spec export-hf`: the command's arguments; the work is `hf_export.export_checkpoint`, imported when the
command runs (building the parser stays light)."""

from __future__ import annotations

DEFAULT_SHARD_GB = 2.0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "export-hf", help="a Megatron trainer's distributed checkpoint -> HF safetensors (policy and MTP drafter)",
        description="Stream RUN_DIR/checkpoints/step_N (a Megatron trainer's torch_dist checkpoint) into an HF "
                    "checkpoint at OUT, shard by shard; its MTP layers, if any, into the drafter directory OUT/drafter.")
    p.add_argument("checkpoint", help="RUN_DIR/checkpoints/step_N")
    p.add_argument("out", help="output directory (policy; MTP layers under OUT/drafter)")
    p.add_argument("--policy", default=None, help="HF checkpoint whose config.json describes the model "
                                                   "(default: the run's model.policy)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="dtype written (default: the checkpoint's fp32 master weights as they are)")
    p.add_argument("--max-shard-gb", type=float, default=DEFAULT_SHARD_GB, help="largest safetensors file (GiB)")
    p.set_defaults(func=export_command)


def export_command(args) -> int:
    import torch

    from .hf_export import export_checkpoint

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, None: None}[args.dtype]
    if args.max_shard_gb <= 0:
        raise ValueError(f"--max-shard-gb must be > 0, got {args.max_shard_gb}")
    out = export_checkpoint(args.checkpoint, args.out, policy=args.policy, dtype=dtype,
                            max_shard_bytes=int(args.max_shard_gb * 2**30))
    print(f"wrote {out}")
    return 0
