"""A chi-square goodness-of-fit check with no scipy: statistic and a critical value."""

from __future__ import annotations

import math

import numpy as np

Z_ONE_IN_A_THOUSAND = 3.0902  # standard normal quantile for alpha = 1e-3


def chi_square(observed: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0):
    """(statistic, critical value at alpha 1e-3, degrees of freedom); rare bins are pooled."""
    n = observed.sum()
    expected = expected_probs * n
    rare = expected < min_expected
    obs = np.append(observed[~rare], observed[rare].sum())
    exp = np.append(expected[~rare], expected[rare].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    # Wilson-Hilferty approximation of the chi-square quantile
    crit = df * (1 - 2 / (9 * df) + Z_ONE_IN_A_THOUSAND * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit, df
