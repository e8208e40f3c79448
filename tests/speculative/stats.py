"""Chi-square helpers for the statistical tests. Every test states its false-alarm rate: the threshold is the
99.9 % quantile of the chi-square distribution, so a correct sampler fails one given test with probability 0.001,
and the seeds are fixed, so CI is deterministic."""

import math

import numpy as np


def chi2_quantile_999(df: int) -> float:
    """99.9 % quantile of chi-square(df) by Wilson-Hilferty. It lies above the exact quantile for every df (3 % at
    df=1: 11.16 against 10.83; under 1 % from df=7), so the false-alarm rate is at most 0.001 (0.00084 at df=1)."""
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



# Power controls. Beside each statistical test runs a control: a sampler wrong by a stated amount (a temperature
# off by some per cent, an acceptance biased) at the test's own sample size, whose statistic must exceed the same
# threshold. Under such a sampler Pearson's statistic is approximately noncentral chi-square with the test's degrees
# of freedom and noncentrality lambda = n * sum((q - p)^2 / p) (goodness of fit: n draws from q against p) or
# na * nb / (na + nb) * sum((pa - pb)^2 / pooled) (homogeneity); `power` is the chance it exceeds the threshold.
# A control is asserted only where that chance is >= 0.99 (`assert_rejects`), so that its rejection is what the
# test does on any machine and thread count (rounding that moves a few draws moves the statistic a little), not a
# lucky seed.


def _merged(expected: np.ndarray, min_expected: float, *cells: np.ndarray) -> list[np.ndarray]:
    """`cells` with the cells whose `expected` count is < min_expected merged into one, as the tests merge them."""
    big = expected >= min_expected
    return [np.append(c[big], c[~big].sum()) for c in cells]


def noncentrality_gof(p: np.ndarray, q: np.ndarray, n: int, min_expected: float = 5.0) -> tuple[float, int]:
    """(lambda, df) of `goodness_of_fit` against p for n draws from q (q zero wherever p is)."""
    p2, q2 = _merged(p * n, min_expected, np.asarray(p, float), np.asarray(q, float))
    keep = p2 > 0
    assert q2[~keep].sum() == 0, "q has mass where p has none: the test fails with certainty, no power to compute"
    return float(n * ((q2[keep] - p2[keep]) ** 2 / p2[keep]).sum()), int(keep.sum() - 1)


def noncentrality_homogeneity(pa: np.ndarray, pb: np.ndarray, na: int, nb: int,
                              min_expected: float = 5.0) -> tuple[float, int]:
    """(lambda, df) of `homogeneity` for na draws from pa beside nb draws from pb."""
    pa, pb = np.asarray(pa, float), np.asarray(pb, float)
    pooled = (na * pa + nb * pb) / (na + nb)
    pa2, pb2, pooled2 = _merged(pooled * min(na, nb), min_expected, pa, pb, pooled)
    keep = pooled2 > 0
    return float(na * nb / (na + nb) * ((pa2[keep] - pb2[keep]) ** 2 / pooled2[keep]).sum()), int(keep.sum() - 1)


def chi2_sf(x: float, df: int) -> float:
    """P(chi-square(df) > x) for integer df >= 1: the closed forms of the regularised upper gamma function."""
    h = x / 2
    if h == 0:
        return 1.0
    if df % 2 == 0:
        return math.fsum(math.exp(-h + k * math.log(h) - math.lgamma(k + 1)) for k in range(df // 2))
    return math.erfc(math.sqrt(h)) + math.fsum(math.exp(-h + (k - 0.5) * math.log(h) - math.lgamma(k + 0.5))
                                               for k in range(1, (df + 1) // 2))


def power(lam: float, df: int) -> float:
    """P(noncentral chi-square(df, lam) > chi2_quantile_999(df)): a Poisson(lam / 2) mixture of central chi-squares
    with df + 2j degrees of freedom, summed to 12 standard deviations past the Poisson mean. 0 for df < 1 (a single
    cell: nothing inside the support can be detected). Matches scipy's ncx2.sf to 1e-12."""
    if df < 1:
        return 0.0
    threshold, m = chi2_quantile_999(df), lam / 2
    if m == 0:
        return chi2_sf(threshold, df)
    terms = range(int(m + 12 * math.sqrt(m) + 20))
    return min(1.0, math.fsum(math.exp(-m + j * math.log(m) - math.lgamma(j + 1)) * chi2_sf(threshold, df + 2 * j)
                              for j in terms))


def assert_rejects(chi2: float, df: int, noncentrality: tuple[float, int] | None = None,
                   min_power: float = 0.99) -> None:
    """The control's statistic exceeds the 99.9 % threshold; where the right and wrong distributions are known,
    `noncentrality` (lambda, df) must also give the test power >= min_power against the control."""
    if noncentrality is not None:
        pw = power(*noncentrality)
        assert pw >= min_power, f"power {pw:.4f} < {min_power} against the control (lambda, df = {noncentrality})"
    threshold = chi2_quantile_999(df)
    assert chi2 > threshold, f"control not rejected: chi2 {chi2:.1f} <= {threshold:.1f} (df {df})"
