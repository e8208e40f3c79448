"""Speculation statistics summed over completions (benchmarks and the RL step report the same figures)."""

from __future__ import annotations


def speculation_summary(outs) -> dict:
    """Drafted / accepted / verify steps over `Completion`s, the mean acceptance length (tokens emitted per verify
    step, the bonus token included, as the reference paper counts it) and the acceptance rate per draft position."""
    drafted = sum(o.spec.get("drafted", 0) for o in outs)
    accepted = sum(o.spec.get("accepted", 0) for o in outs)
    steps = sum(o.spec.get("verify_steps", 0) for o in outs)
    width = max([len(o.spec.get("drafted_per_pos", [])) for o in outs] + [0])
    acc_pos, off_pos = [0] * width, [0] * width
    for o in outs:
        for i, (a, d) in enumerate(zip(o.spec.get("accepted_per_pos", []), o.spec.get("drafted_per_pos", []))):
            acc_pos[i] += a
            off_pos[i] += d
    return {"drafted": drafted, "accepted": accepted, "verify_steps": steps,
            "acceptance_length": (accepted + steps) / steps if steps else None,
            "per_position": [a / d if d else None for a, d in zip(acc_pos, off_pos)]}
