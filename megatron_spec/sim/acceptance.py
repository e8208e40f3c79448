"""Acceptance arithmetic of speculative decoding, as pure functions.

A verify pass over k drafted tokens emits the accepted prefix plus one token from the target (the correction on
a rejection, the bonus token when all k are accepted). With alpha_i the probability that draft position i is
accepted given positions 1..i-1 were, the expected tokens per verify ("acceptance length", tau) is

    tau(k) = 1 + sum_{i=1..k} prod_{j<=i} alpha_j

which for a constant per-token acceptance a is the geometric sum (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def tau_from_positions(alphas: Sequence[float], k: int | None = None) -> float:
    """Acceptance length using the first `k` (default: all) per-position acceptance probabilities."""
    k = len(alphas) if k is None else k
    if k > len(alphas):
        raise ValueError(f"k={k} needs {k} per-position acceptance values, got {len(alphas)}")
    tau, survive = 1.0, 1.0
    for a in alphas[:k]:
        survive *= a
        tau += survive
    return tau


def tau_from_rate(a: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): acceptance length for a constant per-token acceptance `a`."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"per-token acceptance must be in [0, 1], got {a}")
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def rate_from_tau(tau: float, k: int) -> float:
    """Invert `tau_from_rate` by bisection (it is increasing in `a`); needs 1 <= tau <= k+1."""
    check_tau(tau, k)
    if tau >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if tau_from_rate(mid, k) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def per_position_from_taus(taus: Mapping[int, float]) -> tuple[float, ...]:
    """The per-position acceptance a drafter's measured acceptance lengths at several k imply.

    Between two measured depths k_a < k_b (k_a = 0, tau = 1 before the first) the conditional acceptance is taken
    constant, x, so tau(k_b) - tau(k_a) = P_a (x + x^2 + ... + x^(k_b - k_a)), P_a being the chance that all k_a
    first positions were accepted; x is solved by bisection (the sum grows with x). The result, of length max(k),
    reproduces every given tau exactly, and the acceptance length at an unmeasured k follows from the drafter's own
    decay with depth rather than from one constant rate fitted at one k."""
    if not taus:
        raise ValueError("per_position_from_taus needs at least one (k, tau)")
    alphas: list[float] = []
    k_a, tau_a, survive = 0, 1.0, 1.0
    for k_b in sorted(taus):
        tau_b = taus[k_b]
        check_tau(tau_b, k_b)
        if k_b <= k_a or tau_b < tau_a - 1e-12:
            raise ValueError(f"acceptance lengths must grow with k: tau({k_a}) = {tau_a}, tau({k_b}) = {tau_b}")
        n, gain = k_b - k_a, tau_b - tau_a
        if gain > survive * n + 1e-9:
            raise ValueError(f"tau({k_b}) = {tau_b} needs more than full acceptance after tau({k_a}) = {tau_a}")
        lo, hi = 0.0, 1.0
        for _ in range(100):
            mid = (lo + hi) / 2
            if survive * sum(mid ** i for i in range(1, n + 1)) < gain:
                lo = mid
            else:
                hi = mid
        x = (lo + hi) / 2
        alphas += [x] * n
        survive *= x ** n
        k_a, tau_a = k_b, tau_b
    return tuple(alphas)


def check_tau(tau: float, k: int) -> None:
    """A verify pass emits between 1 and k+1 tokens, so the mean must too."""
    if k < 0:
        raise ValueError(f"k (speculative tokens) must be >= 0, got {k}")
    if tau > k + 1 + 1e-9:
        raise ValueError(f"acceptance length {tau} exceeds k+1 = {k + 1}: a verify pass over k={k} drafted "
                         f"tokens emits at most k+1 tokens")
    if tau < 1.0:
        raise ValueError(f"acceptance length {tau} is below 1: every verify pass emits at least one token")


def speedup_floor(tau_a: float, tau_b: float, k_a: int, k_b: int, speedup_a: float | None = None) -> float:
    """Lowest possible S(k_b) / S(k_a) for a model whose per-step cost grows at most linearly in k.

    A speculative step costs C(k) = V(k) + k D: V the verify pass and the fixed per-step work, a sum (or roofline
    max) of terms that are constant or linear through the origin in the k+1 tokens verified, so V(k) / (k+1) never
    grows with k; D one draft forward (same batch and context at every k). In a fluid batch every sequence
    advances tau tokens per step, so the step count scales as 1 / tau and S(k) = tau(k) C_AR / C(k), C_AR being the
    decode step's cost over the same batch / context profile.

    Without more information C(k_b) / C(k_a) <= max((k_b+1)/(k_a+1), k_b/k_a), so
    S(k_b)/S(k_a) >= (tau_b/tau_a) / that factor.

    With `speedup_a` = S(k_a) the bound tightens: a verify pass never costs less than a decode step at the same
    batch, V(k_a) >= C_AR, so at most C(k_a) - C_AR is spent on the k_a drafts, and
        C(k_b) <= r C_AR + (k_b/k_a) (C(k_a) - C_AR),   r = (k_b+1)/(k_a+1) < k_b/k_a,
    with C_AR / C(k_a) = S(k_a) / tau_a (the AR run is the baseline of the speedup). The equality case is a verify
    pass that costs exactly a decode at k_a and grows in proportion to its tokens from there: a kink at k_a.

    A measured ratio below the floor means the system has a super-linear cost in k (a capacity cliff), which no
    roofline reproduces. Used to check the reference paper's k sweep for consistency (docs/design/simulator.md).
    """
    if not 0 < k_a < k_b:
        raise ValueError(f"need 0 < k_a < k_b, got k_a={k_a}, k_b={k_b}")
    growth = max((k_b + 1) / (k_a + 1), k_b / k_a)
    if speedup_a is not None:
        if not 0 < speedup_a <= tau_a + 1e-9:
            raise ValueError(f"speedup at k_a must be in (0, tau_a = {tau_a}], got {speedup_a}: a verify step "
                             "never costs less than a decode step, so the speedup is below the acceptance length")
        growth -= (k_b / k_a - (k_b + 1) / (k_a + 1)) * speedup_a / tau_a
    return (tau_b / tau_a) / growth
