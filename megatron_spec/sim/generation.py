"""The `gen` stage: one engine decoding its share of the rollouts as a shrinking continuous batch.

Sequences are represented by the quantiles of the response-length distribution (each quantile stands for an equal
share of the engine's sequences) and treated as a fluid: every engine step advances every running sequence by the
acceptance length tau (1 without speculation), so a sequence of L tokens needs L / tau steps. Between two events
(a quantile finishing, the KV cache filling up) the batch is constant and its context grows linearly, so the cost
of the whole interval is (steps) x (step time at the interval's mid-point context) -- exact for the linear KV term.

Continuous batching as vLLM does it: sequences are admitted while the KV cache has room for their prompt and the
engine runs fewer than `max_num_seqs`; when the growing contexts fill the cache, the most recently admitted
sequences are preempted and later recomputed (their prompt and generated tokens prefilled again). Queued
sequences arrive in a fixed interleaved order of lengths, so every admission wave mixes short and long ones.

What the long tail does: once most sequences have finished the batch is small, each step is bound by reading the
weights, and the verify pass over k+1 tokens costs about the same as one decode step -- speculation pays most
there, and least at the start, where a large batch makes the verify pass compute-bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .calibration import Calibration
from .config import Speculation
from .hardware import Hardware
from .roofline import forward_time
from .shapes import CostShape

GOLDEN = 0.6180339887498949
# Hysteresis between preemption and admission: a full cache preempts sequences worth 5 % of it, and new (or
# preempted) sequences are admitted only below 95 % use, so the engine does not readmit what it just evicted.
WATERMARK = 0.05


@dataclass(frozen=True)
class Engine:
    """One generation engine (tp GPUs) and what its steps cost. A platform with another cost model of a forward
    (the CPU validation harness, `research/sim_cpu`) subclasses it and overrides `_fwd` / `step_time`."""

    target: CostShape
    """Cost shape of the policy."""
    drafter: CostShape | None
    """Cost shape of one draft forward; None for n-gram / history drafters or no speculation."""
    hw: Hardware
    """Device profile."""
    cal: Calibration
    """Calibration constants for that device class."""
    tp: int = 1
    """GPUs of the engine (tensor parallel)."""
    ep: int = 1
    """Expert-parallel ranks inside the engine."""
    dtype_bytes: float = 2
    """Bytes per weight (1 = FP8)."""
    kv_capacity_tokens: float = float("inf")
    """Context tokens the engine's KV cache holds (all sequences together)."""
    max_num_seqs: int = 1024
    """Most sequences run at once."""

    def _fwd(self, shape: CostShape, n: float, q: float, ctx: float, sample: bool = True) -> float:
        return forward_time(shape, self.hw, self.cal, n, q, ctx, self.tp, self.ep, self.dtype_bytes, sample)

    def step_time(self, n_seqs: float, ctx_tokens: float, k: int, tau: float = 1.0) -> float:
        """One engine step over `n_seqs` sequences holding `ctx_tokens` context in total.

        k = 0 is one decode forward. With k > 0: k draft forwards, one after another, then one verify forward over
        k+1 tokens per sequence. The first draft pass runs over all k+1 positions the last verify scored, rejected
        ones included (vLLM's EAGLE / MTP proposer with its default padded drafter batch, `propose` in
        `vllm/v1/spec_decode/llm_base_proposer.py`), the other k-1 over one token per sequence. Every forward pays
        the fixed per-forward overhead (`Calibration.forward_overhead_s`), which is what makes k cheap-looking
        draft forwards expensive at small batch. `tau` does not enter this cost; a platform that overrides the
        method may use it (the CPU harness's engine drafts from the accepted tokens only)."""
        if k == 0:
            return self._fwd(self.target, n_seqs, 1, ctx_tokens)
        t = self._fwd(self.target, n_seqs, k + 1, ctx_tokens)
        if self.drafter is not None:
            t += self._fwd(self.drafter, n_seqs, k + 1, ctx_tokens)
            t += (k - 1) * self._fwd(self.drafter, n_seqs, 1, ctx_tokens)
        return t

    def prefill_time(self, n_seqs: float, tokens_per_seq: float) -> float:
        """Prefill (or recompute after preemption) of `tokens_per_seq` tokens for `n_seqs` sequences."""
        ctx = n_seqs * tokens_per_seq / 2  # causal: on average a token attends to half the prompt
        t = self._fwd(self.target, n_seqs, tokens_per_seq, ctx, sample=False)
        if self.drafter is not None:
            t += self._fwd(self.drafter, n_seqs, tokens_per_seq, ctx, sample=False)
        return t


@dataclass
class GenResult:
    time_s: float = 0.0
    """Wall time of the engine's generation, prefill included."""
    prefill_s: float = 0.0
    """Of which prefill and recompute after preemption."""
    steps: float = 0.0
    """Engine steps (decode or verify)."""
    seq_steps: float = 0.0
    """Sum over steps of the sequences in flight (steps x batch)."""
    spec_steps: float = 0.0
    """Steps that speculated (k > 0)."""
    k_steps: float = 0.0
    """Sum over steps of the k used."""
    preempted: float = 0.0
    """Sequences preempted and recomputed."""
    trace: list[tuple[float, float, int]] = field(default_factory=list)
    """(time, sequences in flight, k) at each event, for plots."""
    batch_steps: list[tuple[float, float, int]] = field(default_factory=list)
    """(sequences in flight, steps, k) of each interval between events: how many steps ran at which batch (what a
    per-batch-size effect such as a CUDA-graph capture limit would act on)."""
    peak_kv_tokens: float = 0.0
    """Most context tokens the KV cache held at once (compare with `Engine.kv_capacity_tokens`)."""

    @property
    def mean_batch(self) -> float:
        """Sequences in flight per step, averaged over steps."""
        return self.seq_steps / self.steps if self.steps else 0.0

    @property
    def mean_k(self) -> float:
        """k averaged over steps (adaptive runs use less than the configured k)."""
        return self.k_steps / self.steps if self.steps else 0.0


def choose_k(engine: Engine, spec: Speculation | None, n_seqs: float, ctx: float) -> int:
    """The k for the current batch: fixed, off above a threshold, or the k' <= k that emits tokens fastest."""
    if spec is None:
        return 0
    if not spec.adaptive:
        return spec.k
    if spec.adaptive_threshold:
        return 0 if n_seqs > spec.adaptive_threshold else spec.k
    rates = [(spec.tau(k) / engine.step_time(n_seqs, ctx, k, spec.tau(k)), -k) for k in range(spec.k + 1)]
    return -max(rates)[1]


def simulate_generation(engine: Engine, n_seqs: float, prompt_len: float, lengths: list[float],
                        spec: Speculation | None = None, max_events: int = 200_000,
                        prompt_share: int = 1) -> GenResult:
    """Generate `n_seqs` sequences on one engine; `lengths` are equally likely response lengths. `prompt_share`
    sequences share each prompt (the GRPO group), and share its prefill: our engine runs a prompt once for all its
    sequences in a prefill step, vLLM's prefix cache reuses its blocks. So a sequence's first prefill costs
    1 / prompt_share of its prompt's; a recompute after preemption (prompt and generated tokens) is its own."""
    if n_seqs <= 0:
        return GenResult()
    longest = prompt_len + max(lengths)
    if longest > engine.kv_capacity_tokens * (1 - WATERMARK):
        raise ValueError(f"generation engine does not fit in memory: its KV cache holds "
                         f"{engine.kv_capacity_tokens:.0f} tokens, one {longest:.0f}-token sequence needs more than "
                         f"{100 * (1 - WATERMARK):.0f} % of it")
    share = n_seqs / len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (i * GOLDEN) % 1.0)
    # Each entry: [remaining tokens, sequences, context tokens per sequence]
    queue = [[float(lengths[i]), share, float(prompt_len)] for i in order]
    running: list[list[float]] = []
    cap = engine.kv_capacity_tokens
    res = GenResult()
    for _ in range(max_events):
        used = sum(c * x for _, c, x in running)
        batch = sum(c for _, c, _ in running)
        wave, wave_tokens = 0.0, 0.0  # sequences admitted now and their context: one batched prefill forward
        while queue and batch < engine.max_num_seqs - 1e-9:
            rem, count, ctx = queue[0]
            if count < 1e-9:  # a negligible sliver left by earlier splits
                queue.pop(0)
                continue
            fit = min(count, (cap * (1 - WATERMARK) - used) / ctx, engine.max_num_seqs - batch)
            if fit <= 1e-9:
                break
            running.append([rem, fit, ctx])
            used += fit * ctx
            batch += fit
            forwarded = fit / prompt_share if ctx == prompt_len else fit  # a fresh prompt or a recompute
            wave += forwarded
            wave_tokens += forwarded * ctx
            if fit >= count - 1e-12:
                queue.pop(0)
            else:
                queue[0][1] = count - fit
        if wave:
            dt = engine.prefill_time(wave, wave_tokens / wave)
            res.time_s += dt
            res.prefill_s += dt
        if not running:
            break
        k = choose_k(engine, spec, batch, used)
        tau = spec.tau(k) if k else 1.0
        steps = min(r for r, _, _ in running) / tau
        growth = batch * tau  # context tokens added per step
        full = (cap - used) / growth if growth > 0 else float("inf")
        preempt = full < steps
        if preempt:
            steps = max(full, 0.0)
        mid_ctx = used + growth * steps / 2
        dt = steps * engine.step_time(batch, mid_ctx, k, tau)
        res.trace.append((res.time_s, batch, k))
        res.batch_steps.append((batch, steps, k))
        res.peak_kv_tokens = max(res.peak_kv_tokens, used + growth * steps)
        res.time_s += dt
        res.steps += steps
        res.seq_steps += steps * batch
        res.spec_steps += steps if k else 0.0
        res.k_steps += steps * k
        for entry in running:
            entry[0] -= steps * tau
            entry[2] += steps * tau
        running = [e for e in running if e[0] > 1e-6]
        if preempt:
            _preempt(running, queue, cap * WATERMARK, res)
    else:
        raise RuntimeError(f"generation did not finish within {max_events} events")
    res.trace.append((res.time_s, 0.0, 0))
    return res


def _preempt(running: list[list[float]], queue: list[list[float]], to_free: float, res: GenResult) -> None:
    """Move the newest sequences back to the head of the queue until `to_free` context tokens are free; they keep
    their progress and pay a recompute prefill of their whole context on re-admission (vLLM's recompute mode).
    When only the oldest group is left it gives up at most half its sequences, so the engine never stalls."""
    while to_free > 0 and running:
        rem, count, ctx = running[-1]
        take = min(count if len(running) > 1 else count / 2, to_free / ctx)
        if take <= 0:
            break
        to_free -= take * ctx
        res.preempted += take
        queue.insert(0, [rem, take, ctx])
        if take >= count - 1e-12:
            running.pop()
        else:
            running[-1][1] = count - take
            break
