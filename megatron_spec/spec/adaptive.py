"""Adaptive speculation: pick k (0 = plain decoding) each step so that expected tokens per second is highest.

Cost model, calibrated online from the engine's own timings:
  t_target(B, T)  one target forward of B sequences feeding T tokens each (T=1: decode, T=k+1: verify),
                  fitted as c0 + c1 * B + c2 * B * T by least squares over recent measurements;
  t_draft(B, k)   the drafter's proposing cost, fitted as d0 + d1 * k + d2 * k * B (proportional to k until
                  three distinct (B, k) points exist).
Gain model: per-position acceptance a_i (moving averages of P(draft i accepted | drafts < i accepted)), so
E[tokens per sequence per verify] = 1 + sum_{j<=k} prod_{i<=j} a_i (Leviathan et al.'s (1-a^(k+1))/(1-a) when
all a_i = a). Speculation runs only when B * E / (t_draft + t_target(B, k+1)) beats B / t_target(B, 1) by
`margin`; that is what keeps it from ever being slower than plain decoding. At small B a verify pass costs about
what a decode does (weights are read once either way), so the tail of a rollout gets the deepest k.

Until enough timings exist the controller explores: it alternates plain steps and k=1 steps for the first
`warmup` steps, and afterwards re-measures plain decoding every `probe_every` steps so the model stays honest.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class AdaptiveController:
    def __init__(self, k_max: int, margin: float = 1.03, warmup: int = 2, probe_every: int = 32,
                 window: int = 64, ema: float = 0.1):
        self.k_max, self.margin, self.warmup, self.probe_every, self.ema = k_max, margin, warmup, probe_every, ema
        self.target_obs: deque = deque(maxlen=window)  # (B, T, seconds)
        self.draft_obs: deque = deque(maxlen=window)  # (B, k, seconds)
        self.accept = np.full(k_max, 0.7)  # optimistic prior so speculation gets measured at all
        self.steps = 0
        self.last_choice = 0
        self._fits: dict = {}
        self._decisions: dict[int, tuple[int, int]] = {}  # batch size -> (k, step decided)
        self.decide_every = 8

    # -- measurements -----------------------------------------------------------------------------------------
    def record_target(self, batch: int, tokens: int, seconds: float) -> None:
        self.target_obs.append((batch, tokens, seconds))

    def record_draft(self, batch: int, k: int, seconds: float) -> None:
        self.draft_obs.append((batch, k, seconds))

    def record_acceptance(self, drafted: list[int], accepted: list[int]) -> None:
        """Per sequence: drafts offered and accepted this step; updates the per-position acceptance estimate."""
        for i in range(self.k_max):
            offered = sum(1 for d, a in zip(drafted, accepted) if d > i and a >= i)
            if offered:
                hit = sum(1 for d, a in zip(drafted, accepted) if d > i and a > i) / offered
                self.accept[i] += self.ema * (hit - self.accept[i])

    # -- the model ------------------------------------------------------------------------------------------
    def t_target(self, batch: int, tokens: int) -> float | None:
        """Fitted forward time; None until two different batch x tokens sizes have been timed."""
        fit = self._target_fit()
        return None if fit is None else float(max(fit[0] @ np.array(fit[1](batch, tokens)), 1e-6))

    def t_draft(self, batch: int, k: int) -> float:
        fit = self._draft_fit()
        return 0.0 if fit is None else float(max(fit[0] @ np.array(fit[1](batch, k)), 0.0))

    def _target_fit(self):
        # Refit only when a new timing arrived: the choice runs every engine step, the fit is not free.
        key = ("target", len(self.target_obs), self.target_obs[-1] if self.target_obs else None)
        if self._fits.get("target_key") != key:
            self._fits["target_key"], self._fits["target"] = key, self._fit_target()
        return self._fits["target"]

    def _fit_target(self):
        """t = c0 + c1 * B * T (+ c2 * B once several batch sizes were seen: a run whose batch never shrinks says
        nothing about that term, and an under-determined fit would extrapolate nonsense)."""
        if len({b * t for b, t, _ in self.target_obs}) < 2:
            return None
        with_b = len({b for b, _, _ in self.target_obs}) >= 2 and len({(b, t) for b, t, _ in self.target_obs}) >= 3
        row = (lambda b, t: [1.0, b * t, b]) if with_b else (lambda b, t: [1.0, b * t])
        X = np.array([row(b, t) for b, t, _ in self.target_obs])
        y = np.array([s for _, _, s in self.target_obs])
        return np.linalg.lstsq(X, y, rcond=None)[0], row

    def _draft_fit(self):
        key = ("draft", len(self.draft_obs), self.draft_obs[-1] if self.draft_obs else None)
        if self._fits.get("draft_key") != key:
            self._fits["draft_key"], self._fits["draft"] = key, self._fit_draft()
        return self._fits["draft"]

    def _fit_draft(self):
        """t = d * k until three distinct (B, k) were seen, then d0 + d1 * k + d2 * k * B."""
        if not self.draft_obs:
            return None
        if len({(b, k) for b, k, _ in self.draft_obs}) < 3:
            per_k = sum(t for *_, t in self.draft_obs) / sum(k for _, k, _ in self.draft_obs)
            return np.array([per_k]), lambda b, k: [k]
        row = lambda b, k: [1.0, k, k * b]  # noqa: E731
        X = np.array([row(b, k) for b, k, _ in self.draft_obs])
        y = np.array([t for *_, t in self.draft_obs])
        return np.linalg.lstsq(X, y, rcond=None)[0], row

    def expected_tokens(self, k: int) -> float:
        return 1.0 + float(np.cumprod(self.accept[:k]).sum())

    def rate(self, batch: int, k: int) -> float | None:
        """Expected tokens per second for the batch at draft length k, from the fitted costs."""
        t = self.t_target(batch, k + 1)
        if t is None:
            return None
        cost = t + (self.t_draft(batch, k) if k else 0.0)
        return batch * (self.expected_tokens(k) if k else 1.0) / cost

    def choose_k(self, batch: int) -> int:
        self.steps += 1
        if self.steps <= self.warmup or self.t_target(batch, 1) is None:
            # Too few timings to fit the cost model yet: alternate plain steps with cheap k=1 probes (a k=1 step
            # costs little even where speculation cannot pay; the fit extrapolates to larger k).
            k = 1 if self.steps % 2 else 0
        elif self.steps % self.probe_every == 0:
            k = 0  # re-measure plain decoding so the comparison never goes stale
        else:
            # The choice depends on the batch size and slowly moving estimates: decide again when the batch size
            # changes or every `decide_every` steps, not every step (on a tiny model the decision itself would
            # otherwise cost a noticeable share of a step).
            cached = self._decisions.get(batch)
            if cached is None or self.steps - cached[1] >= self.decide_every:
                self._decisions[batch] = (self.best_k(batch), self.steps)
            k = self._decisions[batch][0]
        self.last_choice = k
        return k

    def best_k(self, batch: int) -> int:
        plain = self.rate(batch, 0)
        best_k, best = 0, plain
        for k in range(1, self.k_max + 1):
            r = self.rate(batch, k)
            if r is not None and plain is not None and r > best and r > plain * self.margin:
                best_k, best = k, r
        return best_k
