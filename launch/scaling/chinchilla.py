"""Chinchilla's approach 3: fit L(N, D) = E + A/N^alpha + B/D^beta to every run.

Fitted the way Epoch AI's replication did it (Besiroglu et al. 2024, "Chinchilla Scaling:
A replication attempt", arXiv 2404.10102, notebook data_analysis.ipynb): in log space
with the log-sum-exp parametrisation a = log A, b = log B, e = log E,

    log L_hat = LSE(a - alpha log N, b - beta log D, e),

minimising the Huber loss (delta 1e-3) of log L - log L_hat with L-BFGS from a grid of
starting points and keeping the best. Huber with so small a delta is nearly an L1 fit: a
few badly converged runs do not pull the exponents. The gradient is analytic (the
replication used finite differences; same optimum, about 6x fewer objective calls).

Intervals are percentile bootstrap: resample the runs with replacement, refit from the
full-data optimum (as the replication did), take the 2.5 and 97.5 percentiles.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from scipy.optimize import minimize

from launch.scaling.data import Runs

HUBER_DELTA = 1e-3
NAMES = ("E", "A", "B", "alpha", "beta")
# Starting grids. "epoch" is the replication's: alpha, beta in 0..2 step 0.5, e in -1..1
# step 0.5, a, b in 0..25 step 5 (4500 starts, minutes on a loaded CPU). "coarse", the
# default, takes every other value of each axis (3^5 = 243 starts); on the replication's
# data both land on the same optimum (tests/launch/test_scaling.py).
GRIDS = {"epoch": {"a": np.arange(0, 30, 5.0), "b": np.arange(0, 30, 5.0), "e": np.arange(-1, 1.5, 0.5),
                   "alpha": np.arange(0, 2.5, 0.5), "beta": np.arange(0, 2.5, 0.5)},
         "coarse": {"a": np.array([0.0, 10, 20]), "b": np.array([0.0, 10, 20]), "e": np.array([-1.0, 0, 1]),
                    "alpha": np.array([0.0, 1, 2]), "beta": np.array([0.0, 1, 2])}}
# For the polish of the best grid start and for bootstrap refits: L-BFGS's default stops
# (ftol 2.2e-9 relative) end early on an objective of ~1e-3 whose valley is long in
# (a, alpha), moving A by ~0.1%; the grid itself runs with the defaults (it only has to
# find the right basin).
LBFGS_OPTIONS = {"ftol": 1e-15, "gtol": 1e-12, "maxiter": 2000}


@dataclass(frozen=True)
class Fit3:
    theta: np.ndarray  # a, b, e, alpha, beta
    objective: float

    @property
    def values(self) -> dict[str, float]:
        a, b, e, alpha, beta = self.theta
        return {"E": float(np.exp(e)), "A": float(np.exp(a)), "B": float(np.exp(b)),
                "alpha": float(alpha), "beta": float(beta)}

    @property
    def exponents(self) -> tuple[float, float]:
        """Compute-optimal N_opt ∝ C^a, D_opt ∝ C^b: a = beta/(alpha+beta), b = alpha/(alpha+beta)."""
        alpha, beta = self.theta[3], self.theta[4]
        return float(beta / (alpha + beta)), float(alpha / (alpha + beta))

    def optimum(self, compute: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """N_opt, D_opt for budgets C = 6ND (Hoffmann et al. eq. 4)."""
        A, B, alpha, beta = np.exp(self.theta[0]), np.exp(self.theta[1]), self.theta[3], self.theta[4]
        g = (alpha * A / (beta * B)) ** (1 / (alpha + beta))
        ea, eb = self.exponents
        return g * (compute / 6) ** ea, (compute / 6) ** eb / g

    def predict(self, params: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return np.exp(_log_predict(self.theta, np.log(params), np.log(tokens)))


def _softmax_lse(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray):
    """log(sum of the three terms' exps) and each term's share of it (plain numpy: scipy's
    logsumexp/softmax cost more than the whole objective on a few hundred runs)."""
    a, b, e, alpha, beta = theta
    t0, t1 = a - alpha * log_n, b - beta * log_d
    m = np.maximum(np.maximum(t0, t1), e)
    x0, x1, x2 = np.exp(t0 - m), np.exp(t1 - m), np.exp(e - m)
    total = x0 + x1 + x2
    return m + np.log(total), (x0 / total, x1 / total, x2 / total)


def _log_predict(theta, log_n, log_d) -> np.ndarray:
    return _softmax_lse(theta, log_n, log_d)[0]


def objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray):
    """Summed Huber loss of the log-space residuals, and its gradient in theta."""
    log_pred, (w0, w1, w2) = _softmax_lse(theta, log_n, log_d)
    r = log_l - log_pred
    abs_r = np.abs(r)
    value = np.sum(np.where(abs_r <= HUBER_DELTA, 0.5 * r * r, HUBER_DELTA * (abs_r - 0.5 * HUBER_DELTA)))
    dr = -np.clip(r, -HUBER_DELTA, HUBER_DELTA)  # d huber / d prediction
    g0, g1 = w0 * dr, w1 * dr
    grad = np.array([g0.sum(), g1.sum(), (w2 * dr).sum(), -(g0 @ log_n), -(g1 @ log_d)])
    return value, grad


def _lbfgs(start: np.ndarray, data: tuple, options: Optional[dict] = None) -> Optional[Fit3]:
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        result = minimize(objective, start, args=data, jac=True, method="L-BFGS-B", options=options)
    if not np.all(np.isfinite(result.x)) or not np.isfinite(result.fun):
        return None
    return Fit3(result.x, float(result.fun))


def grid_starts(name: str = "coarse") -> np.ndarray:
    g = GRIDS[name]
    return np.array([[a, b, e, alpha, beta] for alpha, beta, e, a, b in itertools.product(
        g["alpha"], g["beta"], g["e"], g["a"], g["b"])])


def fit(runs: Runs, grid: str = "coarse") -> Fit3:
    """Best L-BFGS fit over the starting grid (every start is run: the objective has
    several local minima where one term swallows E), then the best one polished with
    tight stopping tolerances."""
    data = (np.log(runs.params), np.log(runs.tokens), np.log(runs.loss))
    best = None
    for start in grid_starts(grid):
        result = _lbfgs(np.asarray(start, dtype=float), data)
        if result is not None and (best is None or result.objective < best.objective):
            best = result
    if best is None:
        raise RuntimeError("no starting point converged to a finite fit")
    polished = _lbfgs(best.theta, data, LBFGS_OPTIONS)
    return polished if polished is not None and polished.objective <= best.objective else best


def bootstrap(runs: Runs, best: Fit3, samples: int, seed: int,
              advance: Callable[[], None] = lambda: None) -> list[Fit3]:
    """Refits on `samples` resamples of the runs (with replacement), each from `best`."""
    rng = np.random.default_rng(seed)
    fits = []
    for _ in range(samples):
        sample = runs.subset(rng.integers(0, len(runs), len(runs)))
        result = _lbfgs(best.theta.copy(), (np.log(sample.params), np.log(sample.tokens), np.log(sample.loss)),
                        LBFGS_OPTIONS)
        if result is not None:
            fits.append(result)
        advance()
    return fits
