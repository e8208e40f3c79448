"""The pipeline bubble of Megatron's schedules, as a factor on the ideal (all stages busy) train time.

1F1B over m micro-batches on pp stages takes (m + pp - 1) micro-batch slots of one stage's forward + backward,
m of them useful: the first micro-batch's forward reaches the last stage after pp - 1 slots and the last
backward drains back as long. Interleaved (v virtual stages per rank, each 1/v of the rank's layers) fills and
drains in (pp - 1) / v slots. A trainer that splits one pass into several schedule calls pays the fill and drain
once per call, so c calls over m micro-batches take m + c (pp - 1) / v slots.

`one_f_one_b` runs the same schedule op by op, for micro-batches of different costs and with the point-to-point
exchange between stages (`p2p_exchange_s`) on the path: what a run of variable-length micro-batches on a host
with a measured link takes (the GPU model keeps the slot count: its micro-batches are packed to one length).
"""

from __future__ import annotations

from collections.abc import Sequence


def bubble_factor(micro_batches: int, pp: int, vpp: int = 1, calls: int = 1) -> float:
    """Slots taken over slots of work: (m + calls x (pp - 1) / vpp) / m."""
    if micro_batches < 1 or pp < 1 or vpp < 1 or not 1 <= calls <= micro_batches:
        raise ValueError(f"need micro_batches >= 1, pp >= 1, vpp >= 1 and 1 <= calls <= micro_batches, got "
                         f"{micro_batches}, {pp}, {vpp}, {calls}")
    return (micro_batches + calls * (pp - 1) / vpp) / micro_batches


def pipeline_train_time(one_stage_s: float, pp: int, micro_batches: int, vpp: int = 1, calls: int = 1) -> float:
    """Seconds of a pass whose whole model takes `one_stage_s` on one stage, split evenly over `pp` stages."""
    return one_stage_s / pp * bubble_factor(micro_batches, pp, vpp, calls)


def p2p_exchange_s(nbytes: float, latency_s: float, bandwidth: float, messages: int = 1) -> float:
    """One stage-to-stage send of `nbytes` (hidden x tokens x dtype bytes of a micro-batch's activation, or its
    gradient): `messages` per-message latencies (2 with Megatron's `variable_seq_lengths`: the shape goes first)
    plus the bytes at the link's bandwidth."""
    return messages * latency_s + nbytes / bandwidth


def one_f_one_b(forward_s: Sequence[Sequence[float]], backward_s: Sequence[Sequence[float]],
                p2p_s: Sequence[float] = ()) -> float:
    """Seconds of one non-interleaved 1F1B schedule call: `forward_s[s][i]` / `backward_s[s][i]` is stage s's work
    on micro-batch i, `p2p_s[i]` the exchange of micro-batch i between neighbouring stages (0 if not given).

    Megatron's order per stage s of pp: pp - 1 - s warm-up forwards, then one forward and one backward at a time,
    then the remaining backwards. A forward waits for the previous stage's forward of the same micro-batch plus the
    exchange, a backward for the next stage's backward (the last stage for its own forward); a stage runs its ops
    one after another. Uniform costs give (m + pp - 1) (f + b), the slot count of `bubble_factor`."""
    pp, m = len(forward_s), len(forward_s[0])
    if pp < 1 or m < 1 or len(backward_s) != pp or any(len(x) != m for x in (*forward_s, *backward_s)):
        raise ValueError(f"one_f_one_b needs pp >= 1 stages of m >= 1 forward and backward costs each, got "
                         f"{[len(x) for x in forward_s]} / {[len(x) for x in backward_s]}")
    p2p = list(p2p_s) or [0.0] * m
    if len(p2p) != m:
        raise ValueError(f"one_f_one_b: {len(p2p)} exchange times for {m} micro-batches")
    orders = []
    for s in range(pp):
        warm = min(pp - 1 - s, m)
        ops = [("F", i) for i in range(warm)]
        for j in range(m - warm):
            ops += [("F", warm + j), ("B", j)]
        orders.append(ops + [("B", i) for i in range(m - warm, m)])
    done: dict[tuple[str, int, int], float] = {}
    free, nxt = [0.0] * pp, [0] * pp
    while any(nxt[s] < len(orders[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            while nxt[s] < len(orders[s]):
                kind, i = orders[s][nxt[s]]
                if kind == "F":
                    dep, hop = (("F", s - 1, i), p2p[i]) if s > 0 else (None, 0.0)
                else:
                    dep, hop = (("B", s + 1, i), p2p[i]) if s < pp - 1 else (("F", s, i), 0.0)
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] + hop if dep is not None else 0.0)
                free[s] = done[(kind, s, i)] = start + (forward_s if kind == "F" else backward_s)[s][i]
                nxt[s] += 1
                moved = True
        if not moved:  # cannot happen for this order; a guard against an endless loop
            raise RuntimeError("one_f_one_b: the schedule deadlocked")
    return max(free)


def pipelined_from_one_stage(forward_s: float, backward_s: float, micro_tokens: Sequence[float], pp: int,
                             calls: Sequence[Sequence[int]], exchange_s: Sequence[float] = ()) -> float:
    """Schedule seconds at `pp` stages of a pass that one stage ran in `forward_s` + `backward_s`: each micro-batch
    takes its share of both in proportion to its tokens, each stage 1 / pp of that (even stages), and each
    schedule call in `calls` (lists of micro-batch indices, in order) is its own `one_f_one_b`, filling and
    draining alone. `exchange_s[i]`: micro-batch i's stage-to-stage exchange (`p2p_exchange_s`)."""
    total = float(sum(micro_tokens))
    if total <= 0 or pp < 1:
        raise ValueError(f"need micro-batches with tokens and pp >= 1, got {total} tokens, pp {pp}")
    if sorted(i for call in calls for i in call) != list(range(len(micro_tokens))):
        raise ValueError("calls must cover every micro-batch exactly once")
    exchange = list(exchange_s) or [0.0] * len(micro_tokens)
    seconds = 0.0
    for call in calls:
        share = [micro_tokens[i] / total / pp for i in call]
        seconds += one_f_one_b([[forward_s * x for x in share]] * pp, [[backward_s * x for x in share]] * pp,
                               [exchange[i] for i in call])
    return seconds


def cpu_pipeline_s(schedule_s: float, rest_s: float, micro_batches: Sequence[tuple[int, int]], hidden: int,
                   pp: int, one_call: bool, dtype_bytes: int = 4, forward_share: float = 0.6) -> float:
    """A pipelined Megatron train step on the CPU host predicted from the same step on one stage: its schedule
    seconds (`schedule_s`, forward and backward of every micro-batch, `forward_share` of it forward: 0.6 measured
    on the tiny MoE; the result moves under 1 % between 0.5 and 0.7) and the rest of the step (`rest_s`, kept
    whole: on the tiny MoE each PP2 rank spent 1.0-2.5x the PP1 run's time outside the schedule, not half, since
    per-step bookkeeping outweighs its optimizer there and the stages add collectives). `micro_batches` are (rows,
    tokens) in schedule order; `one_call`: one schedule call over all of them, sending each shape before its activation
    where the shapes differ (Megatron's `variable_seq_lengths`), else one call per run of equal shapes. Every
    exchange sends rows x tokens x hidden x dtype bytes over the host's measured gloo link."""
    from .hardware import CPU_GLOO_P2P_BW, CPU_GLOO_P2P_LATENCY_S

    shapes = [tuple(mb) for mb in micro_batches]
    if one_call:
        calls = [list(range(len(shapes)))]
    else:
        calls = []
        for i, shape in enumerate(shapes):
            if calls and shapes[calls[-1][-1]] == shape:
                calls[-1].append(i)
            else:
                calls.append([i])
    messages = 2 if one_call and len(set(shapes)) > 1 else 1
    exchange = [p2p_exchange_s(rows * tokens * hidden * dtype_bytes, CPU_GLOO_P2P_LATENCY_S, CPU_GLOO_P2P_BW,
                               messages) for rows, tokens in shapes]
    tokens = [rows * t for rows, t in shapes]
    return pipelined_from_one_stage(schedule_s * forward_share, schedule_s * (1 - forward_share), tokens, pp, calls,
                                    exchange) + rest_s
