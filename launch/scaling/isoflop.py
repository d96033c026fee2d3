"""Chinchilla's approach 2: IsoFLOP profiles.

Runs are grouped by compute budget C (launch.scaling.data.group_by_compute). In each group
a parabola of loss in log N is fitted; its vertex is that budget's N_opt, and D_opt is read
off the group's own log D vs log N line at N_opt (exactly C/(6 N_opt) when C = 6ND; right
too when C is a compute column that counts more than 6ND). Then log N_opt and log D_opt are
fitted linearly against log C: N_opt ∝ C^a, D_opt ∝ C^b. Intervals are percentile
bootstrap, resampling runs within each budget so every replicate keeps every budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from launch.scaling.data import Runs, ScalingInputError, group_by_compute

MIN_SIZES = 3  # distinct model sizes a parabola needs


@dataclass(frozen=True)
class Profile:
    group: int  # position in the list of budgets, smallest first
    compute: float  # the group's geometric-mean budget
    index: np.ndarray  # its runs
    coef: np.ndarray  # loss = c2 x^2 + c1 x + c0, x = log N
    n_opt: float
    d_opt: float
    loss_min: float
    inside: bool  # the vertex lies within the sizes trained at this budget


@dataclass(frozen=True)
class Fit2:
    profiles: list[Profile]
    a: float  # N_opt ∝ C^a
    b: float  # D_opt ∝ C^b
    log_kn: float  # log N_opt = log_kn + a log C
    log_kd: float


def check_groups(runs: Runs, tolerance: float) -> list[np.ndarray]:
    """The groups to fit; ScalingInputError when fewer than two budgets have
    MIN_SIZES distinct model sizes (an exponent needs two budgets, a parabola three sizes)."""
    groups = group_by_compute(runs.compute, tolerance)
    usable = [g for g in groups if len(np.unique(runs.params[g])) >= MIN_SIZES]
    if len(usable) < 2:
        sizes = ", ".join(f"C={np.exp(np.log(runs.compute[g]).mean()):.3g}: {len(np.unique(runs.params[g]))}"
                          for g in groups)
        raise ScalingInputError(
            f"approach 2 needs at least 2 compute budgets with >= {MIN_SIZES} model sizes each; "
            f"found {len(usable)} ({len(groups)} budgets by {runs.compute_source}, sizes per budget: {sizes}); "
            "train more sizes per budget, widen --group-tolerance, or use --approach 3")
    return usable


def _profile(runs: Runs, group: int, index: np.ndarray) -> Optional[Profile]:
    x, y = np.log(runs.params[index]), runs.loss[index]
    if len(np.unique(x)) < MIN_SIZES:
        return None
    coef = np.polyfit(x, y, 2)
    if coef[0] <= 0:
        return None  # no minimum: the budget's runs do not bracket the optimum
    x_opt = -coef[1] / (2 * coef[0])
    slope, intercept = np.polyfit(x, np.log(runs.tokens[index]), 1)
    return Profile(group=group, compute=float(np.exp(np.log(runs.compute[index]).mean())), index=index, coef=coef,
                   n_opt=float(np.exp(x_opt)), d_opt=float(np.exp(intercept + slope * x_opt)),
                   loss_min=float(np.polyval(coef, x_opt)), inside=bool(x.min() <= x_opt <= x.max()))


def fit(runs: Runs, groups: list[np.ndarray]) -> Optional[Fit2]:
    """None when fewer than two budgets give a parabola with a minimum."""
    profiles = [p for p in (_profile(runs, i, g) for i, g in enumerate(groups)) if p is not None]
    if len(profiles) < 2:
        return None
    log_c = np.log([p.compute for p in profiles])
    a, log_kn = np.polyfit(log_c, np.log([p.n_opt for p in profiles]), 1)
    b, log_kd = np.polyfit(log_c, np.log([p.d_opt for p in profiles]), 1)
    return Fit2(profiles, float(a), float(b), float(log_kn), float(log_kd))


def bootstrap(runs: Runs, groups: list[np.ndarray], samples: int, seed: int,
              advance: Callable[[], None] = lambda: None) -> list[Fit2]:
    rng = np.random.default_rng(seed)
    fits = []
    for _ in range(samples):
        resampled = [g[rng.integers(0, len(g), len(g))] for g in groups]
        result = fit(runs, resampled)
        if result is not None:
            fits.append(result)
        advance()
    return fits
