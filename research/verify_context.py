"""What a k = 3 step costs in plain steps on this CPU as the sequences get longer: the main job's policy shape
(hidden 96, 8 layers) at 16 and 64 sequences whose contexts hold 20 to 400 prompt tokens before 60 new ones.

`research/verify_width.py` found every width compute-bound from 16 sequences on. A decode step also reads each
sequence's keys and values, once per step whatever the tokens it verifies: a plain step reads them for one token, a
verify step for four. At 64 sequences of a few hundred tokens that cache (8 layers x 256 bytes a token, fp32) is
tens of MB, past this host's 16 MB L3, and a plain step is bound by reading it, as a GPU's decode step is bound by
reading the weights. This measures rho (a k = 3 step over a plain step) and its ceiling at the main job's 3.6
tokens a step, per batch size and context, with random weights as `verify_width` does (same harness, same medians).

    python research/verify_context.py --out research/records/verify_context.json
"""

from __future__ import annotations

import torch

from megatron_spec.drafters.mtp.model import MTP
from megatron_spec.models import CausalLM, preset

# research/ is the script's directory
from verify_width import add_row, k3_row, parse_args, synthetic_prompts, write_record  # noqa: E402

CONTEXTS = (20, 120, 250, 400)  # prompt tokens before the 60 new ones
BATCHES = (16, 64)
NEW_TOKENS = 60


def main() -> int:
    args = parse_args(__doc__.split("\n")[0])
    cfg = preset("tiny-qwen3-deep")
    torch.manual_seed(0)
    policy, head = CausalLM(cfg).eval(), MTP(cfg).eval()
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # a token's keys and values
    rows = []
    for batch in BATCHES:
        for context in CONTEXTS:
            row = {"batch": batch, "prompt_tokens": context,
                   "kv_cache_mb": round(batch * (context + NEW_TOKENS // 2) * kv_bytes / 2**20, 1),
                   **k3_row(policy, head, synthetic_prompts(batch, context), args.rounds, NEW_TOKENS)}
            add_row(rows, row)
    write_record(args, "verify_context", rows, model="tiny-qwen3-deep shape, random weights", new_tokens=NEW_TOKENS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
