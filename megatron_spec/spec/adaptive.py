"""Adaptive speculation: pick k (0 = plain decoding) for each engine step so that expected tokens per second is
highest.

Cost model, calibrated online from the engine's own timings:
  t_step(B, T)   everything a decode step of B sequences feeding T tokens each costs except drafting (T=1: plain
                 decode, T=k+1: verify): the target forward, rejection sampling, rollback and bookkeeping, fitted
                 as c0 + c1 * B * T (+ c2 * B once several batch sizes were seen) by least squares;
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
alternates plain steps with k=1 probes (cheap even where speculation cannot pay; the fit extrapolates to larger
k). The first timing of each step size and the first drafting timing are dropped: they carry one-off costs (the
first verify of a shape, the drafter catching up over every prompt) and a fit from one such outlier would rule
for the rest of the run. The hot path (`choose_k` between decisions) is a dict lookup: decisions are refreshed
every `decide_every` steps or when a new batch size appears, and the least-squares fits behind them at most every
`refit_every` steps, because on a ~1 ms step a fit (~0.2 ms) every few steps would itself cost percents.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class AdaptiveController:
    def __init__(self, k_max: int, margin: float = 1.05, probe_every: int = 64, decide_every: int = 8,
                 refit_every: int = 64, window: int = 32, ema: float = 0.1):
        self.k_max, self.margin, self.probe_every, self.decide_every, self.ema = k_max, margin, probe_every, decide_every, ema
        self.refit_every, self.window = refit_every, window
        self._seen_sizes: set[int] = set()  # step sizes T timed at least once (their first timing is dropped)
        self._seen_draft = False
        self.step_obs: dict[int, deque] = {}  # T -> (B, seconds); a window per T so rare verify sizes stay in the fit
        self.draft_obs: deque = deque(maxlen=4 * window)  # (B, k, seconds)
        self.accept = np.full(k_max, 0.7)  # optimistic prior so speculation gets measured at all
        self.steps = 0
        self.asked = k_max  # the k of the latest choice
        self._decisions: dict[int, tuple[int, int]] = {}  # batch size -> (k, step decided)
        self._fit_step = -refit_every  # when the fits were last refreshed
        self._step_fit = self._draft_fit = None

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
        controller would speculate where most rows of the batch pay for a verify pass and get one token."""
        d, a = np.asarray(drafted)[:, None], np.asarray(accepted)[:, None]
        pos = np.arange(self.k_max)[None]
        offered = ((pos < self.asked) & (a >= pos)).sum(0)
        hits = ((d > pos) & (a > pos)).sum(0)
        seen = offered > 0
        self.accept[seen] += self.ema * (hits[seen] / offered[seen] - self.accept[seen])

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
        if self.steps % self.probe_every == 0:
            return 0  # re-measure plain decoding so the comparison never goes stale
        cached = self._decisions.get(batch)
        if cached is not None and self.steps - cached[1] < self.decide_every:
            return cached[0]
        if not self.calibrated:
            return self.steps % 2  # explore: alternate k=1 probes with plain steps
        k = self.best_k(batch)
        self._decisions[batch] = (k, self.steps)
        return k

    def best_k(self, batch: int) -> int:
        self.refresh_fits()
        rates = self.rates(batch)
        rates[0] *= self.margin  # speculate only for a clear gain: ties and noise go to plain decoding
        return int(np.argmax(rates))

    def rates(self, batch: int) -> np.ndarray:
        """Expected tokens per second for the batch at every draft length k = 0..k_max, from the fitted costs."""
        ks = np.arange(self.k_max + 1)
        cost = self.t_step(batch, ks + 1) + np.where(ks > 0, self.t_draft(batch, ks), 0.0)
        return batch * self.expected_tokens(ks) / cost

    def expected_tokens(self, k):
        """1 + sum_{j<=k} prod_{i<=j} a_i, for one k or an array of them."""
        return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(self.accept))])[k]

    # -- the fitted costs -------------------------------------------------------------------------------------
    def t_step(self, batch: int, tokens):
        """Fitted step time of `batch` sequences feeding `tokens` each (a number or an array)."""
        coef, row = self._step_fit
        return np.maximum(design(row, batch, tokens) @ coef, 1e-6)

    def t_draft(self, batch: int, k):
        if self._draft_fit is None:
            return np.zeros_like(np.asarray(k, dtype=float))
        coef, row = self._draft_fit
        return np.maximum(design(row, batch, k) @ coef, 0.0)

    def refresh_fits(self) -> None:
        if self.steps - self._fit_step < self.refit_every and self._step_fit is not None:
            return
        self._fit_step = self.steps
        self._step_fit, self._draft_fit = self.fit_step(), self.fit_draft()

    def fit_step(self):
        """t = c0 + c1 * B * T (+ c2 * B once several batch sizes were seen: a run whose batch never shrinks says
        nothing about that term, and an under-determined fit would extrapolate nonsense)."""
        b, t, y = np.array([(b, t, s) for t, window in self.step_obs.items() for b, s in window]).T
        with_b = len(set(b)) >= 2 and len(set(zip(b, t))) >= 3
        row = (lambda b, t: [1.0, b * t, b]) if with_b else (lambda b, t: [1.0, b * t])
        return np.linalg.lstsq(design(row, b, t), y, rcond=None)[0], row

    def fit_draft(self):
        """t = d * k until three distinct (B, k) were seen, then d0 + d1 * k + d2 * k * B."""
        if not self.draft_obs:
            return None
        if len({(b, k) for b, k, _ in self.draft_obs}) < 3:
            per_k = sum(t for *_, t in self.draft_obs) / sum(k for _, k, _ in self.draft_obs)
            return np.array([per_k]), lambda b, k: [k]
        row = lambda b, k: [1.0, k, k * b]  # noqa: E731
        b, k, y = np.array(self.draft_obs).T
        return np.linalg.lstsq(design(row, b, k), y, rcond=None)[0], row


def design(row, batch, size) -> np.ndarray:
    """The design matrix [..., features] of `row` at batch sizes and step sizes (numbers or arrays, broadcast)."""
    return np.stack(np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in row(batch, size))), -1)
