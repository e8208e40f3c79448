"""Chi-square helpers for the statistical tests. Every test states its false-alarm rate: the threshold is the
99.9 % quantile of the chi-square distribution, so a correct sampler fails one given test with probability 0.001,
and the seeds are fixed, so CI is deterministic."""

import math

import numpy as np


def chi2_quantile_999(df: int) -> float:
    """99.9 % quantile of chi-square(df) by Wilson-Hilferty (within 1 % of the exact value for df >= 1 here;
    exact for df=1 is 10.83, this gives 10.9)."""
    if df < 1:  # a single cell: the statistic is exactly 0 when the sampler is right
        return 0.0
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson chi-square of observed counts against probabilities, merging cells with < min_expected counts."""
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a token with zero target probability was emitted"
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum() - 1)


def homogeneity(a: np.ndarray, b: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """Two-sample chi-square: do count vectors a and b come from the same distribution?"""
    pooled = a + b
    na, nb = a.sum(), b.sum()
    big = pooled * min(na, nb) / (na + nb) >= min_expected
    a2 = np.append(a[big], a[~big].sum())
    b2 = np.append(b[big], b[~big].sum())
    keep = (a2 + b2) > 0
    a2, b2 = a2[keep], b2[keep]
    tot = a2 + b2
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    return float(((a2 - ea) ** 2 / ea).sum() + ((b2 - eb) ** 2 / eb).sum()), int(len(tot) - 1)
