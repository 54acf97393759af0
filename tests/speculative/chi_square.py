"""Pearson chi-square tests for the sampling-distribution tests (no scipy here: the p-value is the
regularised upper incomplete gamma function, torch.special.gammaincc)."""

from __future__ import annotations

import torch


def p_value(stat: float, df: int) -> float:
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """(statistic, degrees of freedom) of `counts` (one per category) against `probs`. Categories
    expected fewer than min_expected times are pooled into one (the approximation needs it); a count
    in a category of probability 0 gives an infinite statistic."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    expected = counts.sum() * probs
    if (counts[probs == 0] > 0).any():
        return float("inf"), 1
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of `counts` being draws from `probs`."""
    return p_value(*chi_square(counts, probs))


def same_distribution(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of two count vectors (same categories) coming from one distribution (two-sample test)."""
    a, b = a.double(), b.double()
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    na, nb = a.sum(), b.sum()
    stat = (((nb / na).sqrt() * a - (na / nb).sqrt() * b) ** 2 / (a + b)).sum()
    return p_value(float(stat), int(keep.sum()) - 1)


def counts(samples: list[int] | torch.Tensor, num_categories: int) -> torch.Tensor:
    return torch.bincount(torch.as_tensor(samples, dtype=torch.int64), minlength=num_categories)
