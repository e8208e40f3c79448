"""Adaptive speculation: pick k (0 = plain decoding) for each engine step so that expected tokens per second is
highest.

Cost model, calibrated online from the engine's own timings:
  t_step(B, T)   everything a decode step of B sequences feeding T tokens each costs except drafting (T=1: plain
                 decode, T=k+1: verify): the target forward, rejection sampling, rollback and bookkeeping, fitted
                 as c0 + c1 * B * T (+ c2 * B once the batch sizes seen span a factor of 2) by least squares, and
                 never so that a step gets cheaper with more sequences or tokens (`fit_step`);
  t_draft(B, k)  the drafter's proposing cost, fitted as d0 + d1 * k + d2 * k * B (proportional to k until
                 three distinct (B, k) points exist).
Timing the whole step rather than the forward alone matters on small models, where sampling and bookkeeping of
k+1 tokens per sequence are a visible share of a step: a model that left them out would speculate where it loses.

Gain model: per-position acceptance a_i (moving averages of P(draft i accepted | drafts < i accepted)), so
E[tokens per sequence per verify] = 1 + sum_{j<=k} prod_{i<=j} a_i (Leviathan et al.'s (1-a^(k+1))/(1-a) when
all a_i = a). Speculation runs only when B * E / (t_draft + t_step(B, k+1)) beats B / t_step(B, 1) by `margin`;
that is what keeps it from ever being slower than plain decoding. At small B a verify pass costs about what a
decode does (weights are read once either way), so the tail of a rollout gets the deepest k.

The controller lives as long as its engine, so in RL it is calibrated after the first rollout. Until it is, it
alternates pairs of plain steps with pairs of k=1 probes (cheap even where speculation cannot pay; the fit
extrapolates to larger k). The engine reports drafting times only for a step that follows a drafting step: after
plain steps a hidden-state drafter or a draft model first catches up over the positions it skipped (an MTP head on
the tiny model at batch 1: ~860 us per draft token so timed, ~490 steady), and a fit from those would keep
speculation off for good once it had been off for a while. Likewise plain-step times only for a plain step that
follows a plain one (`LLMEngine.time_step`), so probes are PROBE_STEPS plain steps in a row. The first timing of
each step size and the first drafting timing are dropped: they carry one-off costs (the first verify of a shape, the
drafter catching up over every prompt) and a fit from one such outlier would rule for the rest of the run. The hot
path (`choose_k` between decisions) is a dict lookup: decisions are refreshed every `decide_every` steps or when a
new batch size appears, and the least-squares fits behind them at most every `refit_every` steps, because on a ~1 ms
step a fit (~0.2 ms) every few steps would itself cost percents.

Measured outcomes overrule the model where it has been tried. A linear fit dominated by a rollout's many small-
batch steps mispredicts its few large ones (n-gram on the deep tiny model, RL rollout at B=64: k=1 predicted at
par, measured 10.3 ms a step for 1.2 tokens against plain's 6.2 ms for one), and the acceptance it multiplies by
is a prior until a position is seen. So every steady step's realized tokens per second is also compared with what
the model predicted for it, per (batch-size octave, k), and once a cell holds CORRECTION_MIN such ratios the
model's rate for that cell is scaled by their median (a median, so one step stalled by the OS does not rule); a k
with too few outcomes of its own shares plain decoding's scale in that octave when it is below 1 (`correction`). The
first step of each GEMM row count (`gemm_rows`) is not counted: it builds GEMM kernels for a row count never met (a
forward at a new row count cost 6.8 ms against 4.1 ms again on the deep tiny model). Ratios expire after CORRECTION_HORIZON
probe periods: a cell the controller stopped choosing gets no new ones, and a stale low median (formed while the
drafter was still catching up, say) would otherwise rule it out for the engine's whole life. In the main job that
lock-in kept one seed at k=1 for all 50 RL steps (acceptance length 2.0 where k=3 gave 3.4).

An outcome corrects only a k that runs, so where the model underprices a deeper k than the one it picks, nothing
would ever show it. Once per probe period an octave whose choice already speculates tries one k deeper for
TRIAL_STEPS steps (`try_deeper`); where plain decoding is the choice nothing is tried, so a setting where
speculation cannot pay pays nothing for the trials.
"""

from __future__ import annotations

from collections import deque
from statistics import median

import numpy as np


PRIOR_ACCEPT = 0.7  # per-position acceptance assumed before any is measured: optimistic, so speculation gets tried
PRIOR_SEQS = 4  # how many sequences' worth of evidence that prior counts as
PROBE_STEPS = 2  # plain steps in a row per probe: the engine times only a plain step that follows a plain one
CORRECTION_MIN = 3  # realized/predicted ratios a (batch octave, k) cell needs before they scale its predicted rate
CORRECTION_HORIZON = 4  # probe periods (probe_every steps each) a realized/predicted ratio stays valid
TRIAL_STEPS = CORRECTION_MIN + 2  # steps a trial of one k deeper holds its octave (a new shape's first is dropped)


class AdaptiveController:
    def __init__(self, k_max: int, margin: float = 1.05, probe_every: int = 64, decide_every: int = 8,
                 refit_every: int = 64, window: int = 32, ema: float = 0.1):
        self.k_max, self.margin, self.probe_every = k_max, margin, probe_every
        self.decide_every, self.ema = decide_every, ema
        self.refit_every, self.window = refit_every, window
        self._seen_sizes: set[int] = set()  # step sizes T timed at least once (their first timing is dropped)
        self._seen_draft = False
        self.step_obs: dict[int, deque] = {}  # T -> (B, seconds); a window per T so rare verify sizes stay in the fit
        self.draft_obs: deque = deque(maxlen=4 * window)  # (B, k, seconds)
        self.accept = np.full(k_max, PRIOR_ACCEPT)  # optimistic prior so speculation gets measured at all
        self._hits = [PRIOR_ACCEPT * PRIOR_SEQS] * k_max  # decayed counts behind `accept` (`record_acceptance`)
        self._offered = [float(PRIOR_SEQS)] * k_max
        self.steps = 0
        self.asked = k_max  # the k of the latest choice
        self._decisions: dict[int, tuple[int, int]] = {}  # batch size -> (k, step decided)
        self._fit_step = -refit_every  # when the fits were last refreshed
        self._step_fit = self._draft_fit = None
        self._realized: dict[tuple[int, int], deque] = {}  # (batch octave, k) -> (step, realized / predicted)
        self._outcome_shapes: set[int] = set()  # `gemm_rows` whose first outcome was dropped
        self._trials: dict[int, tuple[int, int]] = {}  # batch octave -> (k on trial, step the trial began)

    # -- measurements -----------------------------------------------------------------------------------------
    def record_step(self, batch: int, tokens: int, seconds: float) -> None:
        if tokens not in self._seen_sizes:
            self._seen_sizes.add(tokens)
            return
        self.step_obs.setdefault(tokens, deque(maxlen=self.window)).append((batch, seconds))

    def record_draft(self, batch: int, k: int, seconds: float) -> None:
        if not self._seen_draft:
            self._seen_draft = True
            return
        self.draft_obs.append((batch, k, seconds))

    def record_acceptance(self, drafted: list[int], accepted: list[int]) -> None:
        """Per sequence: drafts offered and accepted this step; updates the per-position acceptance estimate.

        Position i counts as reached by every sequence whose first i drafts stood, up to the k this step asked
        for, whether or not its drafter had an i-th token: a lookup drafter (n-gram, history) often finds no
        match, and the verify pass is as wide for that sequence either way (the batch is padded to k + 1). Counting
        only sequences that drafted would price a lookup drafter as if it always had k tokens to offer, and the
        controller would speculate where most rows of the batch pay for a verify pass and get one token.

        The estimate is a ratio of exponentially decayed counts (hits / sequences offered, decayed by 1 - ema per
        step), so each step weighs as much as it has sequences, and the optimistic prior counts as PRIOR_SEQS
        sequences: one step of 64 sequences replaces it. (A moving average with a weight per step took ~20 steps of
        a 64-sequence batch to wear the prior off: a third of a rollout spent speculating at a loss.)"""
        decay = 1.0 - self.ema
        for i in range(min(self.asked, self.k_max)):
            offered = sum(a >= i for a in accepted)
            if offered:
                hits = sum(d > i and a > i for d, a in zip(drafted, accepted))
                self._hits[i] = decay * self._hits[i] + hits
                self._offered[i] = decay * self._offered[i] + offered
                self.accept[i] = self._hits[i] / self._offered[i]

    def record_outcome(self, batch: int, k: int, tokens: int, seconds: float) -> None:
        """A steady step of `batch` sequences with k drafts each (0: plain) emitted `tokens` in `seconds`, drafting
        included: kept as a ratio to the rate the model predicts for it (see the module docstring)."""
        if self._step_fit is None or seconds <= 0:
            return  # nothing predicted yet to compare with
        if gemm_rows(batch * (k + 1)) not in self._outcome_shapes:
            self._outcome_shapes.add(gemm_rows(batch * (k + 1)))  # a first step of its shape: one-off costs
            return
        ratio = tokens / seconds / self.rate(batch, k)
        self._realized.setdefault((octave(batch), k), deque(maxlen=self.window)).append((self.steps, ratio))

    def correction(self, batch: int, k: int) -> float:
        """The median realized/predicted ratio of the (batch octave, k) cell. A draft length without enough outcomes
        of its own shares a slowdown that plain decoding shows in the same octave, not a speed-up: left at 1, an
        untried k would be favoured whenever plain steps ran slower than the model predicts (a slower spell of the
        host, say; seen at B=64 with plain corrected to 0.79, where k=2, never tried, kept its full predicted rate,
        won the comparison and lost 27 % of a rollout), while plain steps running faster than predicted say nothing
        about verify steps, and the lack of data must never tip a choice towards speculating."""
        own = self._correction(batch, k)
        if own is None and k:
            own = min(1.0, self._correction(batch, 0) or 1.0)
        return 1.0 if own is None else own

    def _correction(self, batch: int, k: int) -> float | None:
        since = self.steps - CORRECTION_HORIZON * self.probe_every
        ratios = [r for step, r in self._realized.get((octave(batch), k), ()) if step > since]
        return median(ratios) if len(ratios) >= CORRECTION_MIN else None

    @property
    def calibrated(self) -> bool:
        """Two step sizes (B * T) and one drafting timing: the least a fit can extrapolate from."""
        sizes = {b * t for t, obs in self.step_obs.items() for b, _ in obs}
        return len(sizes) >= 2 and bool(self.draft_obs)

    # -- the choice -------------------------------------------------------------------------------------------
    def choose_k(self, batch: int) -> int:
        self.asked = self._choose(batch)  # what `record_acceptance` counts positions up to
        return self.asked

    def _choose(self, batch: int) -> int:
        self.steps += 1
        if -self.steps % self.probe_every < PROBE_STEPS:  # the last steps of every probe_every
            return 0  # re-measure plain decoding so the comparison never goes stale (the engine times the second)
        trial = self._trials.get(octave(batch))
        if trial and self.steps - trial[1] < TRIAL_STEPS:
            return trial[0]
        cached = self._decisions.get(batch)
        if cached is not None and self.steps - cached[1] < self.decide_every:
            return cached[0]
        if not self.calibrated:
            return 1 if self.steps % 4 >= 2 else 0  # explore: pairs of k=1 probes (the engine times the second)
        k = self.best_k(batch)
        self._decisions[batch] = (k, self.steps)
        return self.try_deeper(batch, k)

    def try_deeper(self, batch: int, k: int) -> int:
        """k + 1 instead of the chosen k for the octave's next TRIAL_STEPS steps, where k >= 1 pays, k + 1 has no
        outcomes of its own in the octave and no trial began there within a probe period; else k.

        The fitted cost is linear in B * T, but a CPU's kernels do more rows per second the more rows they get, so
        on a large batch the fit prices a deep verify dearer than it runs, and an untried k never gets the outcomes
        that would correct it (traced in the main job's rollouts: at B=33-64 k=1 or 2 chosen and k=3 never tried,
        where k=3 on every step was faster). A trial only ever goes one deeper than a k that already pays, so where speculation
        loses (k = 0) nothing is tried, and a deeper k that loses is tried again only after its outcomes expire
        (CORRECTION_HORIZON probe periods)."""
        cell = octave(batch)
        trial = self._trials.get(cell)
        if not 1 <= k < self.k_max or self._correction(batch, k + 1) is not None \
                or (trial and self.steps - trial[1] < self.probe_every):
            return k
        self._trials[cell] = (k + 1, self.steps)
        return k + 1

    def best_k(self, batch: int) -> int:
        self.refresh_fits()
        rates = [r * self.correction(batch, k) for k, r in enumerate(self.rates(batch))]
        rates[0] *= self.margin  # speculate only for a clear gain: ties and noise go to plain decoding
        return max(range(len(rates)), key=rates.__getitem__)

    def rates(self, batch: int) -> list[float]:
        """Expected tokens per second for the batch at every draft length k = 0..k_max, from the fitted costs."""
        gains = self.expected_tokens()
        return [batch * gains[k] / self.cost(batch, k) for k in range(self.k_max + 1)]

    def rate(self, batch: int, k: int) -> float:
        """`rates(batch)[k]` alone."""
        return batch * self.expected_tokens()[k] / self.cost(batch, k)

    def cost(self, batch: int, k: int) -> float:
        """Fitted seconds of a step with k drafts per sequence, drafting included."""
        return self.t_step(batch, k + 1) + (self.t_draft(batch, k) if k else 0.0)

    def expected_tokens(self) -> list[float]:
        """1 + sum_{j<=k} prod_{i<=j} a_i for k = 0..k_max."""
        out, reach = [1.0], 1.0
        for a in self.accept.tolist():
            reach *= a
            out.append(out[-1] + reach)
        return out

    # -- the fitted costs -------------------------------------------------------------------------------------
    # Plain Python on a handful of floats, not numpy: a decision runs between two ~1 ms engine steps, where a
    # numpy call's fixed cost is not what a micro-benchmark shows (its code and data are out of cache by then):
    # the numpy version of `best_k` took ~240 us per call inside a tiny-model rollout (30 us in a loop), and the
    # refit ~490 us, which cost 5 % of every step while speculation was off.
    def t_step(self, batch: int, tokens: int) -> float:
        """Fitted step time of `batch` sequences feeding `tokens` each."""
        coef, row = self._step_fit
        return max(dot(coef, row(batch, tokens)), 1e-6)

    def t_draft(self, batch: int, k: int) -> float:
        if self._draft_fit is None:
            return 0.0
        coef, row = self._draft_fit
        return max(dot(coef, row(batch, k)), 0.0)

    def refresh_fits(self) -> None:
        if self.steps - self._fit_step < self.refit_every and self._step_fit is not None:
            return
        self._fit_step = self.steps
        self._step_fit, self._draft_fit = self.fit_step(), self.fit_draft()

    def fit_step(self):
        """t = c0 + c1 * B * T (+ c2 * B once the batch sizes seen span a factor of 2: a run whose batch never
        shrank says nothing about that term). A fit in which a step gets cheaper with more sequences or more tokens
        per sequence (c1 < 0, or c1 + c2 < 0) is noise, not physics: the next simpler one is used instead, down to
        the mean step time. Seen on the deep tiny model at B=64 with max_tokens binding: three slow steps at
        B=61-63 as the batch began to drain, fitted with the B term, priced a plain step at 60 ms at B=37 and 118 ms
        at B=6 (against ~7 ms measured), and the controller chose k=5 there, since under a huge fixed cost the most
        tokens per step wins."""
        obs = [(b, t, s) for t, window in self.step_obs.items() for b, s in window]
        sizes = [b for b, _, _ in obs]
        rows = [lambda b, t: (1.0, b * t), lambda b, t: (1.0,)]
        if max(sizes) >= 2 * min(sizes) and len({(b, t) for b, t, _ in obs}) >= 3:
            rows.insert(0, lambda b, t: (1.0, b * t, b))
        for row in rows:  # the last, a constant, is always physical
            coef = least_squares([row(b, t) for b, t, _ in obs], [s for *_, s in obs])
            if physical(coef):
                break
        return coef, row

    def fit_draft(self):
        """t = d * k until three distinct (B, k) were seen, then d0 + d1 * k + d2 * k * B."""
        if not self.draft_obs:
            return None
        if len({(b, k) for b, k, _ in self.draft_obs}) < 3:
            per_k = sum(t for *_, t in self.draft_obs) / sum(k for _, k, _ in self.draft_obs)
            return (per_k,), lambda b, k: (k,)
        row = lambda b, k: (1.0, k, k * b)  # noqa: E731
        return least_squares([row(b, k) for b, k, _ in self.draft_obs], [t for *_, t in self.draft_obs]), row


def physical(coef: tuple[float, ...]) -> bool:
    """A step-time fit (c0, c1[, c2]) whose step does not get cheaper with more tokens per sequence or more
    sequences: c1 >= 0 and c1 + c2 >= 0."""
    return len(coef) < 2 or (coef[1] >= 0 and coef[1] + (coef[2] if len(coef) > 2 else 0.0) >= 0)


def gemm_rows(rows: int) -> int:
    """The row count a step of `rows` input rows runs its GEMMs at: above 8, padded to a multiple of 8
    (`models.packed.ROW_MULTIPLE`, which this pure module does not import). Only a count never met builds kernels,
    so only its first outcome is dropped: keyed by (batch, k), the trials of a deeper k in a draining batch (a new
    size nearly every step) lost most of their outcomes to it and could not correct the model."""
    return rows if rows <= 8 else -(-rows // 8) * 8


def octave(batch: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, ..., 33-64: cells whose step costs are alike."""
    return (batch - 1).bit_length()


def dot(a, b) -> float:
    return sum(x * y for x, y in zip(a, b))


def least_squares(rows: list[tuple[float, ...]], y: list[float]) -> tuple[float, ...]:
    """argmin ||X c - y|| for a few columns, by the normal equations with a relative ridge of 1e-9 (so a rank-
    deficient design, e.g. every observation at one k, gives a finite near-minimum-norm answer instead of failing),
    solved by Gaussian elimination with partial pivoting."""
    n = len(rows[0])
    a = [[dot([r[i] for r in rows], [r[j] for r in rows]) for j in range(n)] for i in range(n)]
    rhs = [dot([r[i] for r in rows], y) for i in range(n)]
    ridge = 1e-9 * max(a[i][i] for i in range(n))
    for i in range(n):
        a[i][i] += ridge
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot], rhs[col], rhs[pivot] = a[pivot], a[col], rhs[pivot], rhs[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            a[r] = [x - f * z for x, z in zip(a[r], a[col])]
            rhs[r] -= f * rhs[col]
    coef = [0.0] * n
    for i in reversed(range(n)):
        coef[i] = (rhs[i] - dot(a[i][i + 1 :], coef[i + 1 :])) / a[i][i]
    return tuple(coef)
