"""What a k = 3 step costs in plain steps on this CPU for narrower and deeper policies than the main job's old one.

`research/verify_width.py` found that a wider policy makes the verify dearer on a 2-core CPU: a verify of 4 tokens
a sequence is compute-bound from a few sequences on. The other way round, a narrower policy does less arithmetic a
token while a step's fixed cost (one call per layer, whatever the tokens) stays, so more tokens fit under that fixed
cost; and a deeper one makes the one-layer MTP head a smaller share of a step. This measures rho (a k = 3 step over a
plain step) and its ceiling at 3.6 tokens a step for (hidden, layers) shapes at 8, 16 and 64 sequences, with the
harness of `verify_width` (random weights, 20 prompt tokens, 80 new ones, EOS ignored, medians of decode steps).
`tiny-qwen3-deep`, the main job's shape, is hidden 96 x 8 layers; `tiny-qwen3-narrow`, tried and not kept
(`research/notebook/README.md`, "A narrower, deeper policy"), is 64 x 12.

    python research/verify_shape.py --out research/records/verify_shape.json
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_spec.drafters.mtp.model import MTP
from megatron_spec.models import CausalLM, preset

# research/ is the script's directory
from verify_width import add_row, k3_row, parse_args, synthetic_prompts, write_record  # noqa: E402

# (hidden, layers, query heads, head dim): one KV head, MLP 3x hidden, as both presets
SHAPES = ((96, 8, 3, 32), (96, 12, 3, 32), (64, 8, 2, 32), (64, 12, 2, 32), (64, 16, 2, 32), (48, 16, 3, 16))
BATCHES = (8, 16, 64)
NEW_TOKENS = 80


def main() -> int:
    args = parse_args(__doc__.split("\n")[0])
    rows = []
    for hidden, layers, heads, head_dim in SHAPES:
        cfg = dataclasses.replace(preset("tiny-qwen3-deep"), hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, head_dim=head_dim, intermediate_size=3 * hidden)
        torch.manual_seed(0)
        policy, head = CausalLM(cfg).eval(), MTP(cfg).eval()
        params = sum(t.numel() for t in policy.parameters())
        for batch in BATCHES:
            row = {"hidden": hidden, "layers": layers, "params": params, "batch": batch,
                   **k3_row(policy, head, synthetic_prompts(batch), args.rounds, NEW_TOKENS)}
            add_row(rows, row)
    write_record(args, "verify_shape", rows, model="random weights", new_tokens=NEW_TOKENS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
