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

Until enough timings exist the controller explores: it alternates plain and speculative steps for the first
`warmup` steps, and afterwards re-measures plain decoding every `probe_every` steps so the model stays honest.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class AdaptiveController:
    def __init__(self, k_max: int, margin: float = 1.03, warmup: int = 4, probe_every: int = 32,
                 window: int = 64, ema: float = 0.1):
        self.k_max, self.margin, self.warmup, self.probe_every, self.ema = k_max, margin, warmup, probe_every, ema
        self.target_obs: deque = deque(maxlen=window)  # (B, T, seconds)
        self.draft_obs: deque = deque(maxlen=window)  # (B, k, seconds)
        self.accept = np.full(k_max, 0.7)  # optimistic prior so speculation gets measured at all
        self.steps = 0
        self.last_choice = 0

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
        if len({(b, t) for b, t, _ in self.target_obs}) < 3:
            return None
        X = np.array([[1.0, b, b * t] for b, t, _ in self.target_obs])
        y = np.array([s for _, _, s in self.target_obs])
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        return float(max(coef @ np.array([1.0, batch, batch * tokens]), 1e-6))

    def t_draft(self, batch: int, k: int) -> float:
        if not self.draft_obs:
            return 0.0
        if len({(b, kk) for b, kk, _ in self.draft_obs}) < 3:
            per_k = sum(t for *_, t in self.draft_obs) / sum(kk for _, kk, _ in self.draft_obs)
            return per_k * k
        X = np.array([[1.0, kk, kk * b] for b, kk, _ in self.draft_obs])
        y = np.array([t for *_, t in self.draft_obs])
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        return float(max(coef @ np.array([1.0, k, k * batch]), 0.0))

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
            # Too few distinct (batch, tokens) timings to fit the cost model yet: alternate to collect them.
            k = self.k_max if self.steps % 2 else 0
        elif self.steps % self.probe_every == 0:
            k = 0  # re-measure plain decoding so the comparison never goes stale
        else:
            plain = self.rate(batch, 0)
            best_k, best = 0, plain
            for k in range(1, self.k_max + 1):
                r = self.rate(batch, k)
                if r is not None and plain is not None and r > best and r > plain * self.margin:
                    best_k, best = k, r
            k = best_k
        self.last_choice = k
        return k
