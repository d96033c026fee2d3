"""PNG plots of a scaling fit: IsoFLOP curves, the fitted loss contours (approach 3) and the
compute-optimal frontier with its 95% bootstrap band."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from launch.scaling.data import Runs, group_by_compute


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on cluster or CI machines
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    _pyplot().close(fig)
    return path


def _budget_grid(runs: Runs) -> np.ndarray:
    return np.geomspace(runs.compute.min() / 2, runs.compute.max() * 10, 60)


def _tokens_along(n: np.ndarray, d: np.ndarray, c: float, xs: np.ndarray) -> np.ndarray:
    """D at each N in xs on one budget's curve: the log-log line through the budget's own (N, D)
    points, so the curve follows how the table spent that budget. C / (6N) assumes C = 6ND, which
    a table whose compute counts more than 6N per token breaks: with N = non-embedding params the
    study's ladder spends 3-21 x 6ND per token (the V x h output layer), and 6ND curves sat 0.2-0.7
    below their own points. One distinct N: C / (6N)."""
    if len(np.unique(n)) < 2:
        return c / (6 * xs)
    slope, intercept = np.polyfit(np.log(n), np.log(d), 1)
    return np.exp(intercept + slope * np.log(xs))


def _isoflop(plt, runs: Runs, approach: int, fitted: dict, path: Path) -> Path:
    """Loss vs N at each budget: the runs, the fitted curve through them, its minimum."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=90)
    groups = fitted.get("groups") or group_by_compute(runs.compute, 0.25)
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(groups)))
    for color, index in zip(colors, groups):
        n, c = runs.params[index], float(np.exp(np.log(runs.compute[index]).mean()))
        ax.scatter(n, runs.loss[index], s=12, color=color, label=f"C={c:.2g}")
        xs = np.geomspace(n.min() / 1.5, n.max() * 1.5, 80)
        if approach == 3:
            ax.plot(xs, fitted["fit"].predict(xs, _tokens_along(n, runs.tokens[index], c, xs)), color=color, linewidth=1)
    if approach == 2:
        for p in fitted["fit"].profiles:
            n = runs.params[p.index]
            xs = np.geomspace(n.min() / 1.2, n.max() * 1.2, 80)
            color = colors[p.group]
            ax.plot(xs, np.polyval(p.coef, np.log(xs)), color=color, linewidth=1)
            ax.plot([p.n_opt], [p.loss_min], "x", color="k")
    ax.set_xscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel(f"{runs.loss_column} L")
    ax.set_title(f"IsoFLOP profiles (approach {approach} fit)")
    ax.grid(alpha=0.3, which="both")
    if len(groups) <= 12:
        ax.legend(fontsize=6, ncol=2)
    return _save(fig, path)


def _contours(plt, runs: Runs, fitted: dict, path: Path) -> Path:
    """Approach 3's L(N, D) over the (N, D) plane, the runs coloured by loss, and the
    compute-optimal N_opt(C), D_opt(C) line."""
    fit = fitted["fit"]
    ns = np.geomspace(runs.params.min() / 2, runs.params.max() * 2, 120)
    ds = np.geomspace(runs.tokens.min() / 2, runs.tokens.max() * 2, 120)
    nn, dd = np.meshgrid(ns, ds)
    fig, ax = plt.subplots(figsize=(6.4, 4.6), dpi=90)
    levels = np.quantile(runs.loss, np.linspace(0, 1, 12))
    cs = ax.contour(nn, dd, fit.predict(nn, dd), levels=np.unique(levels), cmap="magma", linewidths=0.8)
    ax.clabel(cs, fontsize=6, fmt="%.2f")
    sc = ax.scatter(runs.params, runs.tokens, c=runs.loss, cmap="magma", s=10, edgecolors="k", linewidths=0.3)
    fig.colorbar(sc, ax=ax, label=runs.loss_column)
    n_opt, d_opt = fit.optimum(_budget_grid(runs))
    keep = (n_opt >= ns[0]) & (n_opt <= ns[-1]) & (d_opt >= ds[0]) & (d_opt <= ds[-1])
    ax.plot(n_opt[keep], d_opt[keep], "b--", label="compute-optimal frontier (C = 6ND)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters N")
    ax.set_ylabel("tokens D")
    ax.set_title("fitted L(N, D) contours")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _frontier(plt, runs: Runs, approach: int, fitted: dict, path: Path) -> Path:
    """N_opt(C) and D_opt(C) with the 2.5-97.5 percentile band over the bootstrap refits."""
    cs = _budget_grid(runs)
    fit, boots = fitted["fit"], fitted["boots"]
    if approach == 3:
        curves = lambda f: f.optimum(cs)  # noqa: E731
    else:
        curves = lambda f: (np.exp(f.log_kn + f.a * np.log(cs)), np.exp(f.log_kd + f.b * np.log(cs)))  # noqa: E731
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=90)
    best = curves(fit)
    samples = [curves(f) for f in boots]
    for i, (name, color) in enumerate((("N_opt", "C0"), ("D_opt", "C1"))):
        ax.plot(cs, best[i], color=color, label=name)
        if samples:
            lo, hi = np.percentile([s[i] for s in samples], [2.5, 97.5], axis=0)
            ax.fill_between(cs, lo, hi, color=color, alpha=0.25, linewidth=0)
    if approach == 2:
        for p in fit.profiles:
            ax.plot([p.compute], [p.n_opt], "o", color="C0", markersize=4)
            ax.plot([p.compute], [p.d_opt], "o", color="C1", markersize=4)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training compute C (FLOPs; approach 3: C = 6ND)" if approach == 3 else f"training compute C ({runs.compute_source})")
    ax.set_ylabel("compute-optimal N, D")
    ax.set_title(f"compute-optimal frontier, 95% bootstrap band (approach {approach})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return _save(fig, path)


def draw(runs: Runs, approach: int, fitted: dict, out_dir: Path) -> list[Path]:
    """isoflop.png, frontier.png and (approach 3) contours.png in out_dir."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [_isoflop(plt, runs, approach, fitted, out_dir / "isoflop.png"),
             _frontier(plt, runs, approach, fitted, out_dir / "frontier.png")]
    if approach == 3:
        paths.append(_contours(plt, runs, fitted, out_dir / "contours.png"))
    return paths
