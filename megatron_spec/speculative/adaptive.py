"""Adaptive speculation: pick k (0 = plain decoding) for each engine step so that tokens per second is highest.

For a batch of B sequences, k drafts each give E_k = 1 + sum_{j<=k} prod_{i<=j} a_i tokens per sequence per step
(a_i: the chance draft i stands once drafts < i stood; Leviathan et al.'s (1-a^(k+1))/(1-a) when all are equal),
at a step cost of rho_k(B) plain steps. The controller picks the k with the highest E_k / rho_k(B), and plain
decoding unless some k beats it by `margin` (step-time ratios taken over a few steps wander by about 10 %).

Both factors are measured per batch-size octave (1, 2, 3-4, 5-8, ..., 33-64), not modelled:
- a_i from the octave's own verify steps (`record_acceptance`), decayed, replaced by the last ~16 sequences' where
  those lie far from it (`moved`): the acceptance of the drafter and policy as they are now, at the batch sizes it
  decides for (the sequences left at a rollout's end are its least predictable, so one estimate over all sizes
  would misprice the large ones);
- rho_k from the engine's step timings: a step at k divided by a plain step's time at the same B (`plain_time`),
  the median of the octave's latest WINDOW, plus the switch cost: after plain steps a hidden-state drafter first
  catches up over every position it skipped, and that time beyond the k's ratio is spread over the octave's next
  CATCH_UP_STEPS speculative steps. A ratio at the same B cancels the fixed per-step costs a fitted cost line gets
  wrong on a CPU.

What each octave does (`decide`), in blocks of steps so that switches are rare (`LLMEngine.time_step` says which
steps are timed):
1. plain decoding until it has plain timings (the reference every ratio needs);
2. one block at k = 1 and one at k_max; a k between them is priced on the line between their ratios until it has
   timings of its own (the ratio grows about linearly in k);
3. the best k, re-decided every HOLD steps (between decisions `choose_k` is a counter). Plain decoding needs the
   margin over every k, except where the octave the batch drains into next speculates and its catch-ups cost
   (`chained`): there plain decoding also buys a catch-up later, so a k that merely beats it is taken;
4. now and then a block of a runner-up (`runner_up`): the ks next to the best and plain decoding in turn, or, where
   plain decoding is best, the k it would speculate at if that is predicted within PROBE_NEAR of the bar. Where
   the octave measured no acceptance within PROBE_EVERY_MAX steps the runner-up is priced at STALE_ACCEPT, since
   acceptance moves with the policy and nothing else measures it while speculation is off; a probe whose first
   drafts stood RISE more often than estimated is repeated. A probe that finds nothing new doubles the octave's
   interval (PROBE_EVERY up to PROBE_EVERY_MAX), and a switch starts it over.

`docs/design/adaptive-controller.md` gives the reasons for each rule and the measurements behind them.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from statistics import median

import numpy as np


PRIOR_ACCEPT = 0.7  # per-position acceptance assumed before any is measured: optimistic, so speculation gets tried
PRIOR_SEQS = 4  # how many sequences' worth of evidence that prior counts as
DECAY_SEQS = 8  # the acceptance estimate decays by 1 - ema per this many sequences offered
MIN_SAMPLES = 3  # steps a k needs in an octave before its own ratio rules
BLOCK = 4  # steps an explored or probed k holds its octave: one may be untimed (a switch), MIN_SAMPLES are left
HOLD = 8  # steps a decision holds its octave before it is made again
PROBE_EVERY = 64  # an octave's steps between probes of a runner-up, at first and whenever the choice changed
PROBE_NEAR = 0.95  # where plain decoding is best, a probe only for a k predicted at this much of the bar or more
# (1.045x under the margin, 0.95x where `chained` waives it); where the octave measured no acceptance within
# PROBE_EVERY_MAX steps, predicted at STALE_ACCEPT
RISE = 0.1  # a probe whose first drafts stood this much more often than estimated is repeated: acceptance is rising
STALE_ACCEPT = 0.9  # a good drafter's acceptance (a fresh MTP head on the main job's policy: 0.9-0.96)
PROBE_EVERY_MAX = 512  # the interval doubles up to this while probes confirm the choice
WINDOW = 16  # latest steps kept per (octave, k)
CATCH_UP_STEPS = 64  # about how many speculative steps an octave's catch-up cost is spread over
CHAIN_CATCH_UP = 0.25  # plain steps a catch-up must cost beyond its k's ratio for `chained` to waive the margin:
# between an n-gram drafter's (no catch-up) and a hidden-state head's (about one plain step or more)
PLAIN_WINDOW = 5  # latest plain steps kept per batch size
RECENT_SEQS = 16  # about how many sequences offered the recent acceptance spans (`moved`)
MOVED_SE = 3.0  # a recent acceptance this many standard errors off the estimate replaces it


@dataclass
class Acceptance:
    """Per draft position i, the chance draft i stands once the drafts before it stood: decayed hits over decayed
    sequences offered (`AdaptiveController.record_acceptance` says why so), beside the same over about RECENT_SEQS
    sequences, which replaces it where the two lie far apart (`moved`)."""

    rate: np.ndarray
    hits: list[float]
    offered: list[float]
    recent: list[list[float]]

    @classmethod
    def prior(cls, rate: np.ndarray) -> "Acceptance":
        """An estimate at `rate` (per position) worth PRIOR_SEQS sequences."""
        rate = np.array(rate, dtype=float)
        return cls(rate, (rate * PRIOR_SEQS).tolist(), [float(PRIOR_SEQS)] * len(rate), [[0.0, 0.0] for _ in rate])

    def add(self, i: int, hits: int, offered: int, ema: float) -> None:
        """`offered` sequences reached position i and `hits` of them took its draft."""
        decay = (1.0 - ema) ** (offered / DECAY_SEQS)
        self.hits[i] = decay * self.hits[i] + hits
        self.offered[i] = decay * self.offered[i] + offered
        recent = self.recent[i]
        fast = (1.0 - 1.0 / RECENT_SEQS) ** offered
        recent[:] = fast * recent[0] + hits, fast * recent[1] + offered
        if moved(self.hits[i] / self.offered[i], *recent):
            self.hits[i], self.offered[i] = recent
        self.rate[i] = self.hits[i] / self.offered[i]


@dataclass
class Octave:
    """One batch-size octave's state; `n` counts the steps taken in it, the other step numbers are in that count."""

    k: int = 0  # the k its steps run at until step `until`
    until: int = 0
    n: int = 0
    best: int | None = None  # the latest decision's k (None: not decided yet)
    probing: bool = False  # the block now running is a probe
    next_probe: int = PROBE_EVERY
    interval: int = PROBE_EVERY
    probes: int = 0  # probes so far (their runner-ups take turns)
    probed_accept: float = 0.0  # the estimated acceptance of draft 1 when the probe began
    rising: int = 0  # the k of the last probe if its drafts stood notably more often than estimated (0: not)
    steps: dict[int, deque] = field(default_factory=dict)  # k >= 1 -> (B, seconds) of its latest steps
    catch_up: float = 0.0  # decayed sum of catch-ups' plain steps beyond their k's ratio
    drafted: float = 0.0  # decayed count of speculative steps, catch-ups included
    switches: float = 0.0  # decayed count of the catch-ups among them (`catch_up` / `switches`: one's cost)
    acceptance: Acceptance | None = None  # measured in its own steps (None: nothing yet, the overall one serves)
    measured_at: int = 0  # the controller's step count when its acceptance was last measured

    @property
    def switching(self) -> float:
        """The catch-ups' cost spread over the octave's speculative steps: plain steps added to each k's ratio."""
        return self.catch_up / self.drafted if self.drafted else 0.0


class AdaptiveController:
    def __init__(self, k_max: int, margin: float = 1.1, ema: float = 0.1):
        self.k_max, self.margin, self.ema = k_max, margin, ema
        # over all steps, with an optimistic prior so that speculation gets measured at all; an octave's own
        # estimate starts from it (`record_acceptance`)
        self.overall = Acceptance.prior(np.full(k_max, PRIOR_ACCEPT))
        self.accept = self.overall.rate
        self.asked = k_max  # the k of the latest choice
        self._asked_in: Octave | None = None  # the octave of the latest choice
        self.octaves: dict[int, Octave] = {}
        self.plain: dict[int, deque] = {}  # B -> seconds of its latest plain steps
        self._plain_sizes: list[int] = []  # the keys of `plain`, sorted
        self.steps = 0  # decode steps chosen for
        self._fresh = [0, 0]  # draft 1's hits and offers since the latest probe began

    # -- measurements -----------------------------------------------------------------------------------------
    def record_step(self, batch: int, k: int, seconds: float, catch_up: bool = False) -> None:
        """A decode step of `batch` sequences with k drafts each (0: plain) took `seconds`, drafting included;
        `catch_up`: the first drafting step after plain ones (the module docstring says how it counts). A row count
        never met before costs more once (kernels and plans for a new shape: 10 % over the same sizes again, summed
        over a rollout of the deep tiny model at k = 0 and 3); the medians absorb that."""
        if k == 0:
            if batch not in self.plain:
                bisect.insort(self._plain_sizes, batch)
            self.plain.setdefault(batch, deque(maxlen=PLAIN_WINDOW)).append(seconds)
            return
        cell = self._octave(batch)
        decay = 1.0 - 1.0 / CATCH_UP_STEPS
        cell.catch_up, cell.drafted = decay * cell.catch_up, decay * cell.drafted + 1.0
        cell.switches = decay * cell.switches + catch_up
        if not catch_up:
            cell.steps.setdefault(k, deque(maxlen=WINDOW)).append((batch, seconds))
        elif self._plain_sizes and (rho := self._ratio(cell, k)) is not None:
            cell.catch_up += max(seconds / self.plain_time(batch) - rho, 0.0)

    def record_acceptance(self, drafted: list[int], accepted: list[int]) -> None:
        """Per sequence: drafts offered and accepted this step; updates the per-position acceptance estimate.

        Position i counts as reached by every sequence whose first i drafts stood, up to the k this step asked
        for, whether or not its drafter had an i-th token: a lookup drafter (n-gram, history) often finds no
        match, and the verify pass is as wide for that sequence either way (the batch is padded to k + 1). Counting
        only sequences that drafted would price a lookup drafter as if it always had k tokens to offer, and the
        controller would speculate where most rows of the batch pay for a verify pass and get one token.

        The estimate is a ratio of exponentially decayed counts (hits / sequences offered), decayed by 1 - ema for
        every DECAY_SEQS sequences offered, so each step weighs as much as it has sequences and the estimate spans
        about the same number of sequences whatever the batch size. The optimistic prior counts as PRIOR_SEQS
        sequences: one step of 64 sequences all but replaces it. (A moving average with a weight per step took ~20
        steps of a 64-sequence batch to wear the prior off, a third of a rollout spent speculating at a loss; a
        decay per step made the estimate span ~10 sequences at B = 1, where it wandered between 0.67 and 1.0 for a
        drafter at 0.9 and took speculation off and on.) Beside it the same counts decay over about RECENT_SEQS
        sequences; where they lie far from it (`moved`), the drafter meets other text, and they replace it.

        The same counts are kept for the octave of the latest choice (the step being recorded), from the overall
        estimate of the moment as its prior: its decisions read them (module docstring)."""
        cell = self._asked_in
        if cell is not None:
            if cell.acceptance is None:
                cell.acceptance = Acceptance.prior(self.accept)
            cell.measured_at = self.steps
        for i in range(min(self.asked, self.k_max)):
            offered = sum(a >= i for a in accepted)
            if offered:
                hits = sum(d > i and a > i for d, a in zip(drafted, accepted))
                self.overall.add(i, hits, offered, self.ema)
                if cell is not None:
                    cell.acceptance.add(i, hits, offered, self.ema)
                if i == 0:
                    self._fresh = [self._fresh[0] + hits, self._fresh[1] + offered]

    # -- the choice -------------------------------------------------------------------------------------------
    def choose_k(self, batch: int) -> int:
        self.steps += 1
        cell = self._octave(batch)
        cell.n += 1
        if cell.n > cell.until:
            self.decide(cell, batch)
        self.asked, self._asked_in = cell.k, cell  # what `record_acceptance` counts positions up to, and where
        return cell.k

    def decide(self, cell: Octave, batch: int) -> None:
        """Set the octave's k for its next steps (the module docstring's steps 1-4)."""
        if not self._has_plain(batch):
            return self._hold(cell, 0, BLOCK)
        unexplored = [k for k in dict.fromkeys((1, self.k_max)) if len(cell.steps.get(k, ())) < MIN_SAMPLES]
        if unexplored:
            return self._hold(cell, unexplored[0], BLOCK)
        gains = self.speedups(cell)
        bar = 1.0 if self.chained(batch) else self.margin
        best = max(range(self.k_max + 1), key=lambda k: gains[k] if k else bar)
        self._pace_probes(cell, best)
        cell.best = best
        probe = self._probe(cell, best, gains, bar) if cell.n >= cell.next_probe else None
        if probe is not None:
            return self._hold(cell, probe, BLOCK)
        self._hold(cell, best, HOLD)

    def chained(self, batch: int) -> bool:
        """Whether the octave a batch of this size drains into next speculates (by its latest decision), and a
        switch to speculation costs a catch-up there of CHAIN_CATCH_UP plain steps or more. A lookup drafter (n-gram,
        history) catches up on nothing: its switches cost what its steps do, and it keeps the margin."""
        below = self.octaves.get(octave(batch) - 1)
        return (below is not None and bool(below.best) and below.switches > 0
                and below.catch_up / below.switches >= CHAIN_CATCH_UP)

    def _pace_probes(self, cell: Octave, best: int) -> None:
        """Set the interval to the octave's next probe: back to PROBE_EVERY where the choice switched between
        speculating and not, or where a probe, made while speculation was off, found its first drafts standing RISE
        more often than estimated (acceptance is rising: the probe is repeated, `rising`, until the estimate, which
        spans ~80 sequences, catches up); doubled, up to PROBE_EVERY_MAX, after a probe that found nothing new."""
        switched = cell.best is not None and (best > 0) != (cell.best > 0)
        if cell.probing:
            cell.probing = False
            fresh = self._fresh[0] / self._fresh[1] if self._fresh[1] else 0.0
            cell.rising = cell.k if best == 0 and fresh > cell.probed_accept + RISE else 0
            cell.interval = PROBE_EVERY if switched or cell.rising else min(2 * cell.interval, PROBE_EVERY_MAX)
            cell.next_probe = cell.n + cell.interval
        elif switched:
            cell.interval, cell.next_probe = PROBE_EVERY, cell.n + PROBE_EVERY
        if best:
            cell.rising = 0  # speculating measures acceptance anyway

    def _probe(self, cell: Octave, best: int, gains: list[float], bar: float) -> int | None:
        """The k to probe now, or None where plain decoding is best and no k is worth a probe: none predicted at
        PROBE_NEAR x the `bar` plain decoding holds or more, acceptance not rising, and measured in the octave within
        PROBE_EVERY_MAX steps (else it may have moved unseen, and the k is chosen as if the drafter stood at
        STALE_ACCEPT). The prediction takes the better of the octave's acceptance and the one over all steps, per
        position: a dip that turned the octave plain would otherwise be the last thing it measured, for the rest of
        a run (seen on the main job's rollouts at 33-64 sequences, while the octaves still speculating measured
        more)."""
        pick = gains
        if best == 0:
            seen = np.maximum(self.acceptance(cell), self.accept)
            if self.steps - cell.measured_at >= PROBE_EVERY_MAX:
                seen = np.maximum(seen, STALE_ACCEPT)
            pick = self.speedups(cell, seen)
        if not (best or cell.rising or max(pick[1:]) >= PROBE_NEAR * bar):
            cell.next_probe = cell.n + cell.interval
            return None
        cell.probing, cell.probed_accept, self._fresh = True, float(self.acceptance(cell)[0]), [0, 0]
        return cell.rising or self.runner_up(best, pick, cell)

    def runner_up(self, best: int, gains: list[float], cell: Octave) -> int:
        """The k a probe tries: where speculation is off, the k it would speculate at; else the ks next to the best
        and plain decoding, in turn."""
        cell.probes += 1
        if best == 0:
            return max(range(1, self.k_max + 1), key=gains.__getitem__)
        others = sorted({best - 1, min(best + 1, self.k_max), 0} - {best})
        return others[cell.probes % len(others)]

    def speedups(self, cell: Octave, accept: np.ndarray | None = None) -> list[float]:
        """E_k / rho_k for k = 0..k_max in the octave (1.0 at k = 0), at its acceptance or `accept`; rho is
        the k's `_ratio` plus the octave's catch-ups spread over its speculative steps, and a k without MIN_SAMPLES
        steps of its own takes rho from the line between the nearest ks that have them (the flat extension past the
        last)."""
        ratios = {k: rho + cell.switching for k in cell.steps if (rho := self._ratio(cell, k)) is not None}
        known = sorted(ratios)
        gains, tokens = [1.0], self.expected_tokens(self.acceptance(cell) if accept is None else accept)
        for k in range(1, self.k_max + 1):
            lo = max((j for j in known if j <= k), default=known[0])
            hi = min((j for j in known if j >= k), default=known[-1])
            rho = ratios[lo] if hi == lo else ratios[lo] + (ratios[hi] - ratios[lo]) * (k - lo) / (hi - lo)
            gains.append(tokens[k] / rho)
        return gains

    def _ratio(self, cell: Octave, k: int) -> float | None:
        """The median of the k's latest steps in the octave, each over a plain step's time at its own B; None with
        fewer than MIN_SAMPLES."""
        steps = cell.steps.get(k, ())
        return median(seconds / self.plain_time(b) for b, seconds in steps) if len(steps) >= MIN_SAMPLES else None

    def acceptance(self, cell: Octave) -> np.ndarray:
        """The octave's acceptance per draft position: measured in its steps, else (none yet) over all steps."""
        return self.accept if cell.acceptance is None else cell.acceptance.rate

    def expected_tokens(self, accept: np.ndarray | None = None) -> list[float]:
        """1 + sum_{j<=k} prod_{i<=j} a_i for k = 0..k_max (a: the acceptance over all steps unless given)."""
        out, reach = [1.0], 1.0
        for a in (self.accept if accept is None else accept).tolist():
            reach *= a
            out.append(out[-1] + reach)
        return out

    def plain_time(self, batch: int) -> float:
        """A plain step's seconds at `batch`: its latest ones' (`typical`), else the line between the nearest sizes
        timed. Past the sizes timed it errs low (the largest's time above it, time proportional to B below the
        smallest), which prices speculation dearer there, so plain decoding runs and fills the gap."""
        sizes = self._plain_sizes
        i = bisect.bisect_left(sizes, batch)
        if i < len(sizes) and sizes[i] == batch:
            return typical(self.plain[batch])
        if i == len(sizes):
            return typical(self.plain[sizes[-1]])
        hi = typical(self.plain[sizes[i]])
        if i == 0:
            return hi * batch / sizes[0]
        lo = typical(self.plain[sizes[i - 1]])
        return lo + (hi - lo) * (batch - sizes[i - 1]) / (sizes[i] - sizes[i - 1])

    # -- pieces -----------------------------------------------------------------------------------------------
    def _octave(self, batch: int) -> Octave:
        cell = self.octaves.get(octave(batch))
        if cell is None:
            cell = self.octaves[octave(batch)] = Octave()
        return cell

    def _has_plain(self, batch: int) -> bool:
        """A plain step was timed at some batch size of this octave."""
        o = octave(batch)
        lo = bisect.bisect_left(self._plain_sizes, (1 << (o - 1)) + 1 if o else 1)
        return lo < len(self._plain_sizes) and octave(self._plain_sizes[lo]) == o

    @staticmethod
    def _hold(cell: Octave, k: int, steps: int) -> None:
        cell.k, cell.until = k, cell.n + steps - 1


def moved(estimate: float, hits: float, offered: float) -> bool:
    """Whether the acceptance of about the last RECENT_SEQS sequences (`hits` / `offered`, decayed counts) lies
    MOVED_SE standard errors or more (of `offered` draws at the estimate's rate) from the long `estimate`: the
    drafter meets other text (a new prompt, the policy's style moved), which the estimate, spanning ~80 sequences so
    that noise does not switch speculation on and off, would take as long to follow. Over 16 sequences that is a
    move of 0.23 from 0.9 (a drafter at 0.9 shows 10 or fewer of 16 in 0.3 % of windows), 0.37 from 0.4: large
    moves only, found within ~16 sequences instead of ~80 (`test_adaptive_follows_a_drafter_that_meets_other_text`)."""
    if offered < RECENT_SEQS / 2:
        return False
    rate = min(max(estimate, 0.05), 0.95)  # a standard error however close to 0 or 1 the estimate is
    return abs(hits / offered - estimate) > MOVED_SE * (rate * (1.0 - rate) / offered) ** 0.5


def typical(seconds) -> float:
    """The median of three or more timings, the least of two: a draining batch meets most sizes only once or twice,
    and a step the OS stalled (5x its neighbours, seen) must not become the reference every ratio of its octave is
    taken against. The least errs low, which prices speculation dearer, never cheaper."""
    return median(seconds) if len(seconds) >= 3 else min(seconds)


def octave(batch: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, ..., 33-64: cells whose step costs are alike."""
    return (batch - 1).bit_length()


GATE_WINDOW = 3  # latest steps per mode whose least cost prices it
GATE_FIRST = 12  # RL steps a decision holds before the other mode is measured again, at first and after a switch
GATE_MAX = 48  # the interval doubles up to this while re-measuring confirms the decision


@dataclass
class WholeStepGate:
    """Whether speculation pays for the whole RL step once the online drafter's training, which keeps the drafter
    fresh, is counted: the engine's controller above prices decode steps and cannot see that training, which runs in
    the train stage. Per generated token, a speculative step costs its generation plus the drafter's training and a
    plain step its generation (the policy's own training is the same in both, so it cancels); each mode is priced by
    the least of its latest GATE_WINDOW steps, and speculation runs only where it costs `margin` times less. The
first `warmup` steps run plain and are not priced (first-use costs would be charged to whichever mode ran them).

    Off means a plain step: plain generation (no drafting, no drafter upkeep) and no drafter training, so it costs
    what a `spec=null` run's step does. After the warm-up the gate takes one plain step, then one speculative step,
    decides, and re-measures the mode it is not in with one step every `interval` RL steps (GATE_FIRST,
    doubled up to GATE_MAX while the decision holds, reset when it switches). A drafter left untrained while
    speculation is off is measured as it is on the next speculative step; where it went stale, speculation stays
    off, which is right for that host: it could not pay there with a fresh one either.

    A speculative step's drafter training gets what its generation saved as a time budget (`drafter_budget`): cut
    there, the step costs about a plain one, so measuring speculation on a host where it cannot pay costs next to
    nothing; the time it took is then a lower bound of the training's cost, enough to price the step as not paying.
    A step whose generation alone saves nothing, or less than the training as last measured (`drafter_cost`),
    skips the training and is priced with that last cost."""

    margin: float = 1.02
    warmup: int = 1  # first RL steps, plain and not priced: they pay for first-use costs (kernels, allocations)
    costs: dict = field(default_factory=lambda: {True: deque(maxlen=GATE_WINDOW), False: deque(maxlen=GATE_WINDOW)})
    decided: bool | None = None  # the latest decision (None: not both modes measured yet)
    interval: int = GATE_FIRST
    next_probe: int = 0
    steps: int = 0  # RL steps recorded
    drafter_cost: float | None = None  # the drafter's training per generated token, as last measured

    def speculate(self) -> bool:
        """The mode of the next RL step: True speculates (and trains the drafter)."""
        if self.warmup > 0:
            return False
        for mode in (False, True):
            if not self.costs[mode]:
                return mode
        return self.decided if self.steps < self.next_probe else not self.decided

    def record(self, speculated: bool, gen_s: float, drafter_s: float, tokens: int,
               beside_s: float | None = None) -> None:
        """An RL step in the given mode: its generation's seconds, the drafter training's seconds (0 when plain or
        skipped; cut at its budget, a lower bound of the whole training's) and the tokens it generated.

        `beside_s`: with generation run ahead of training (an async lag), the seconds of the step's other work
        (the policy's update, the refit), which run beside the engines' generation: the step then costs the longer
        of the two sides, `max(gen_s, beside_s + drafter_s)`, so speculation pays only while generation is the
        longer side and by more than the drafter's training adds to the other. None: the stages run one after
        another and the policy's own work, the same in both modes, cancels."""
        if tokens <= 0:
            raise ValueError(f"a step that generated {tokens} tokens cannot be priced")
        if self.warmup > 0:
            self.warmup -= 1
            return
        if speculated and drafter_s > 0:
            self.drafter_cost = drafter_s / tokens
        if beside_s is not None:
            cost = max(gen_s, beside_s + drafter_s) / tokens
        elif speculated and drafter_s == 0:
            cost = self.estimate(gen_s, tokens)
        else:
            cost = (gen_s + drafter_s) / tokens
        self.costs[speculated].append(cost)
        self.steps += 1
        if not (self.costs[True] and self.costs[False]):
            return
        was = self.decided
        self.decided = self.pays()
        if was is None or was != self.decided:
            self.interval = GATE_FIRST
        elif speculated != self.decided:  # a re-measure that confirmed the decision
            self.interval = min(2 * self.interval, GATE_MAX)
        if was is None or was != self.decided or speculated != self.decided:
            self.next_probe = self.steps + self.interval

    def drafter_budget(self, gen_s: float, tokens: int) -> float | None:
        """Seconds the drafter's training may take on a speculative step whose gen stage took `gen_s` for `tokens`
        tokens, with the step still costing plain decoding's cost over `margin`: None (no bound) before plain
        decoding is priced, 0 (skip the training; the step is then priced at its `estimate`) where that leaves no
        more than the training as last measured."""
        if not self.costs[False]:
            return None
        budget = (self.cost(False) / self.margin - gen_s / tokens) * tokens
        return budget if budget > (self.drafter_cost or 0.0) * tokens else 0.0

    def estimate(self, gen_s: float, tokens: int) -> float:
        """A speculative step's cost per token with the drafter's training as last measured (none yet: 0)."""
        return gen_s / max(tokens, 1) + (self.drafter_cost or 0.0)

    def pays(self) -> bool:
        """Speculation's whole-step cost per token, `margin` times, is below plain decoding's."""
        spec, plain = self.cost(True), self.cost(False)
        return spec * self.margin < plain

    def cost(self, speculated: bool) -> float:
        """Seconds per generated token of the mode's gen stage (+ drafter training): the least of its latest steps.
        Another job's load on a shared host only ever slows a step down, by up to several times for one step, so the
        least cost is the mode's own; a median of the one or two steps measured early takes such a spike for it and
        trains the drafter on the strength of it."""
        return min(self.costs[speculated])

    def state_dict(self) -> dict:
        """Everything the next decisions depend on, for a checkpoint: a resumed run then picks the modes the
        uninterrupted run would have picked from the same measured costs."""
        fields = ("margin", "warmup", "decided", "interval", "next_probe", "steps", "drafter_cost")
        return {"costs": {mode: list(q) for mode, q in self.costs.items()}, **{f: getattr(self, f) for f in fields}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved."""
        for name, value in state.items():
            if name == "costs":
                self.costs = {mode: deque(q, maxlen=GATE_WINDOW) for mode, q in value.items()}
            else:
                setattr(self, name, value)

    def state(self) -> dict:
        """What the step's metrics log: both modes' costs per token and the latest decision."""
        out = {"gate_pays": self.decided}
        for mode, key in ((True, "gate_spec_cost"), (False, "gate_plain_cost")):
            out[key] = self.cost(mode) if self.costs[mode] else None
        return out
