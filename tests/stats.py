"""Chi-square goodness of fit with a stated false-alarm rate (docs/design.md, "Tests").

Bins whose expected count is below 5 are merged into one tail bin (and a tail still below 5 is
merged into the smallest remaining bin), so the chi-square approximation holds. The threshold is
the (1 - FALSE_ALARM) quantile of the chi-square distribution with (bins - 1) degrees of freedom:
a correct sampler fails a given test with probability 1e-6, so the suite does not flake, while a
wrong residual shifts the statistic by thousands at 100k+ draws.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from scipy.stats import chi2

FALSE_ALARM = 1e-6


class ChiSquare(NamedTuple):
    statistic: float
    threshold: float
    dof: int

    @property
    def passed(self) -> bool:
        return self.statistic <= self.threshold


def chi_square(
    samples: torch.Tensor,  # [n] int64 category of each draw
    expected_probs: torch.Tensor,  # [C] probabilities of the categories (sum 1)
) -> ChiSquare:
    probs = expected_probs.double().cpu().numpy()
    assert abs(probs.sum() - 1) < 1e-9, probs.sum()
    n = samples.numel()
    counts = np.bincount(samples.cpu().numpy(), minlength=probs.shape[0]).astype(np.float64)
    assert counts.shape[0] == probs.shape[0], "a sample fell outside the categories"
    expected = probs * n
    # A category with zero probability must never be drawn.
    impossible = expected == 0
    assert counts[impossible].sum() == 0, f"drew impossible categories {np.nonzero(impossible & (counts > 0))}"
    small = expected < 5
    obs_bins = list(counts[~small])
    exp_bins = list(expected[~small])
    if small.any():
        obs_bins.append(counts[small].sum())
        exp_bins.append(expected[small].sum())
        if exp_bins[-1] < 5 and len(exp_bins) > 1:
            i = int(np.argmin(exp_bins[:-1]))
            obs_bins[i] += obs_bins.pop()
            exp_bins[i] += exp_bins.pop()
    obs, exp = np.array(obs_bins), np.array(exp_bins)
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return ChiSquare(stat, float(chi2.isf(FALSE_ALARM, max(dof, 1))), dof)
