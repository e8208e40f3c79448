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


# Power. Under a wrong sampler Pearson's statistic is approximately noncentral chi-square with the same degrees of
# freedom and noncentrality lambda = n * sum((q - p)^2 / p) (goodness of fit, samples from q tested against p) or
# na * nb / (na + nb) * sum((pa - pb)^2 / pooled) (homogeneity). `power` is the chance that it exceeds the test's
# threshold `chi2_quantile_999(df)`: the chance a given control is rejected.


def _merge(expected: np.ndarray, min_expected: float, *cells: np.ndarray) -> list[np.ndarray]:
    """`cells` with those of `expected` < min_expected merged into one, as the statistics above merge them."""
    big = expected >= min_expected
    return [np.append(c[big], c[~big].sum()) for c in cells]


def noncentrality_gof(p: np.ndarray, q: np.ndarray, n: int, min_expected: float = 5.0) -> tuple[float, int]:
    """(lambda, df) of `goodness_of_fit` against p for n samples drawn from q (cells merged by p's expectation)."""
    p2, q2 = _merge(p * n, min_expected, p, q)
    keep = p2 > 0
    assert q2[~keep].sum() == 0, "q puts mass where p has none: the test rejects it with certainty"
    return float(n * ((q2[keep] - p2[keep]) ** 2 / p2[keep]).sum()), int(keep.sum() - 1)


def noncentrality_homogeneity(pa: np.ndarray, pb: np.ndarray, na: int, nb: int,
                              min_expected: float = 5.0) -> tuple[float, int]:
    """(lambda, df) of `homogeneity` for na samples from pa beside nb from pb (cells merged as it merges them)."""
    pooled = (na * pa + nb * pb) / (na + nb)
    pa2, pb2, pooled2 = _merge(pooled * min(na, nb), min_expected, pa, pb, pooled)
    keep = pooled2 > 0
    lam = na * nb / (na + nb) * ((pa2[keep] - pb2[keep]) ** 2 / pooled2[keep]).sum()
    return float(lam), int(keep.sum() - 1)


def chi2_sf(x: float, df: int) -> float:
    """P(chi-square(df) > x), exact for integer df (the closed forms of the regularised gamma function)."""
    h = x / 2
    if df % 2 == 0:
        return float(sum(math.exp(-h + k * math.log(h) - math.lgamma(k + 1)) for k in range(df // 2))) if h else 1.0
    tail = math.erfc(math.sqrt(h))
    return tail + sum(math.exp(-h + (k - 0.5) * math.log(h) - math.lgamma(k + 0.5)) for k in range(1, (df + 1) // 2))


def power(lam: float, df: int) -> float:
    """P(noncentral chi-square(df, lam) > chi2_quantile_999(df)): the Poisson(lam / 2) mixture of central
    chi-squares with df + 2j degrees of freedom, summed to 12 standard deviations past the Poisson's mean."""
    threshold, m = chi2_quantile_999(df), lam / 2
    last = int(m + 12 * math.sqrt(m) + 20)
    return min(1.0, sum(math.exp(-m + j * math.log(m) - math.lgamma(j + 1)) * chi2_sf(threshold, df + 2 * j)
                        for j in range(last + 1)) if m else chi2_sf(threshold, df))


def assert_rejects(chi2: float, df: int, lam: float | None = None, min_power: float = 0.99) -> None:
    """A power control: the statistic of a sampler that is wrong by a stated amount exceeds the 99.9 % threshold,
    and (where the wrong and right distributions are known, `lam`) the test's power against it is >= min_power,
    so this rejection is what the test does on any machine, not one lucky draw."""
    if lam is not None:
        assert power(lam, df) >= min_power, f"power {power(lam, df):.4f} < {min_power} (lambda {lam:.1f}, df {df})"
    assert chi2 > chi2_quantile_999(df), f"control not rejected: chi2 {chi2:.1f} <= {chi2_quantile_999(df):.1f} (df {df})"
