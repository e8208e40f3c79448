"""What an MTP or EAGLE-3 head drafts, from scratch: the reference the engine's cached drafting and the drafter's
unrolled training are both held to."""

import torch

from megatron_spec.drafters.mtp.model import MTP


def reference_hidden_drafts(target, head, tokens, k, chained=None):
    """Drafts from scratch with no cache: every depth over the full sequence, then the chain, as full forwards.
    Returns the k greedy drafts and their logits [k, V]. Each draft is fed onward as the next token, or, given
    `chained` (k tokens), those stand in for the drafts (as if the sequence's own continuation had been drafted)."""
    is_mtp = isinstance(head, MTP)
    depths = len(head.layers) if is_mtp else 1
    with torch.no_grad():
        out = target.trunk(torch.tensor([tokens[:-1]]), capture=() if is_mtp else head.capture_layers)
        hidden = out.hidden if is_mtp else head.fuse(out.layers)
        ext, L = list(tokens), len(tokens)

        def run(depth, h, ids):
            if is_mtp:
                return head(h, torch.tensor([ids]), None, target.embed, target.lm_head, layer=depth)
            return head(h, torch.tensor([ids]), None, target.embed)

        drafts, found = [], []
        for j in range(k):
            depth = min(j, depths - 1)
            if j < depths:
                inputs = hidden  # what the last depth read at positions 0..L-2 (its keys there come from these)
                hidden, logits = run(depth, hidden, ext[j + 1 : j + L])
                state = hidden[:, -1:]
            else:
                inputs = torch.cat([inputs, state], 1)  # the chain reads its own previous state one position on
                n = inputs.shape[1]
                out, logits = run(depth, inputs, ext[depth + 1 : depth + 1 + n])
                state = out[:, -1:]
            found.append(logits[0, -1])
            drafts.append(int(logits[0, -1].argmax()))
            ext.append(drafts[-1] if chained is None else chained[j])
    return drafts, torch.stack(found) if found else torch.empty(0)  # a round may offer no draft
