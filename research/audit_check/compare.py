"""Does the memory audit (`launchers/audit.py`) predict what each Megatron trainer rank of a CPU run holds?

Reads a record of `research/megatron_memory/run.py` (a random 0.74 B Qwen3-MoE, Megatron EP2 x PP2 on 4 gloo ranks,
each rank's peak resident memory measured from outside), audits the same run (`audit(..., gpu="cpu")`: the model's
parameters on meta tensors, the optimizer's states, activations, refit buffers, saves, and the measured per-process
overhead `CPU_PROCESS_BYTES`) and compares rank by rank. Ranks 0-1 hold pipeline stage 0, ranks 2-3 stage 1 (PP is
Megatron-Core's outermost group); rank 0 also runs the loop.

    python research/audit_check/compare.py [research/records/megatron_memory_1024x14.json]
    (writes research/records/audit_vs_measured_cpu.json)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
MIB = 1 << 20


def run_model(record: dict):
    from megatron_spec.models import ModelConfig
    from megatron_spec.models.presets import TINY_VOCAB

    m = record["model"]
    heads, kv = m.get("heads", 16), m.get("kv", 4)
    return ModelConfig(model_type="qwen3_moe", vocab_size=TINY_VOCAB, hidden_size=m["hidden"],
                       num_hidden_layers=m["layers"], num_attention_heads=heads, num_key_value_heads=kv,
                       head_dim=m["hidden"] // heads, intermediate_size=m["moe_ffn"], num_experts=m["experts"],
                       num_experts_per_tok=m["top_k"], moe_intermediate_size=m["moe_ffn"], norm_topk_prob=True,
                       rope_theta=10000.0, max_position_embeddings=512)


def predicted(record: dict) -> list[dict]:
    """The audit of the record's run: one entry per rank (its stage's audit), in rank order."""
    os.environ.setdefault("MM_POLICY", "/nonexistent")
    os.environ.setdefault("MM_OUT", "/nonexistent")
    sys.path.insert(0, str(ROOT / "research" / "megatron_memory"))
    from launchers.audit import audit
    from launchers.checks import prompt_budget
    from recipe import megatron_memory  # research/megatron_memory/recipe.py: the run's own config

    cfg = megatron_memory()
    world = 4
    layout = {"gpus": world, "megatron": {}, "vllm": {"engines": 1, "tensor_parallel_size": 1},
              "ray": {"placement": "inline"}}
    found = audit(cfg, layout, run_model(record), prompt_tokens=prompt_budget(cfg), gpu="cpu")
    per_stage = world // cfg.backend.megatron.pp
    return [found.ranks[r // per_stage].as_json() for r in range(world)]


def compare(record: dict) -> dict:
    out = {}
    for r, rank in enumerate(predicted(record)):
        measured = record["outside_peak_mb"][str(r)]["hwm"]
        out[str(r)] = {"predicted_mb": round(rank["device_bytes"] / MIB, 1), "measured_mb": round(measured, 1),
                       "error": round(rank["device_bytes"] / MIB / measured - 1, 4),
                       "parts_mb": {k: round(v / MIB, 1) for k, v in rank["parts"].items()}}
    return out


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else ROOT / "research/records/megatron_memory_1024x14.json")
    record = json.loads(path.read_text())
    result = {"question": "the memory audit's per-rank prediction against a CPU run's measured peaks",
              "measured": str(path.relative_to(ROOT)), "measured_commit": record.get("commit"),
              "command": "python research/audit_check/compare.py " + str(path.relative_to(ROOT)),
              "ranks": compare(record)}
    result["max_abs_error"] = max(abs(r["error"]) for r in result["ranks"].values())
    (ROOT / "research/records/audit_vs_measured_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
