"""Design IsoFLOP sweeps and fit scaling laws to a table of finished training runs.

    python -m launch.scaling design --recipe tiny-llama --budgets 2e12 4e12 8e12 --dry-run   (launch/scaling/design.py)
    python -m launch.scaling heldout runs/sweeps/isoflop-tiny-llama   (the val_loss noise: launch/scaling/heldout.py)
    python -m launch.scaling study --out runs/scaling-study   (ladder, fit, predict, check: launch/scaling/study.py)

    python -m launch.scaling fit tests/launch/fixtures/scaling/chinchilla_epoch_points.csv --approach 3
    python -m launch.scaling fit runs/sweep/results.csv --approach 2 --bootstrap 500 --plot runs/sweep/scaling
    python -m launch.scaling fit RESULTS.csv --approach 3 --json > fit.json

RESULTS.csv needs columns params, tokens and loss (launch.sweep's results.csv works as it
is: its held-out val_loss is read as the loss, or its final_loss, the last training batch's,
when the runs did not evaluate; --loss-column picks another; rows not `finished` are left out). Approach 3 fits
L = E + A/N^alpha + B/D^beta (launch/scaling/chinchilla.py); approach 2 fits IsoFLOP
parabolas (launch/scaling/isoflop.py). Intervals are 95% percentile bootstrap.
Bad input: one line on stderr, exit 2, before any fitting.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import numpy as np

from data_pipeline.checks import run_cli
from launch.scaling import chinchilla, isoflop
from launch.scaling.data import Runs, ScalingInputError, read_runs

MIN_POINTS = {2: 6, 3: 10}  # approach 3: five parameters need clearly more than five runs


def _interval(value: float, samples: list[float]) -> dict:
    if not samples:
        return {"value": value, "ci95": None, "se": None}
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return {"value": value, "ci95": [float(lo), float(hi)],
            "se": float(np.std(samples, ddof=1)) if len(samples) > 1 else None}


@contextmanager
def _progress(total: int, label: str, quiet: bool):
    """A rich progress bar on stderr (stdout may be the JSON document); none when the
    bootstrap is short or stderr is not a terminal."""
    if quiet or total < 20 or not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress(label, BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda: bar.advance(task)


def run_approach3(runs: Runs, args) -> tuple[dict, dict]:
    best = chinchilla.fit(runs, args.grid)
    with _progress(args.bootstrap, "bootstrap", args.json) as advance:
        boots = chinchilla.bootstrap(runs, best, args.bootstrap, args.seed, advance)
    samples = {k: [b.values[k] for b in boots] for k in chinchilla.NAMES}
    a, b = best.exponents
    doc = {"approach": 3, "n_points": len(runs), "n_bootstrap": len(boots),
           "params": {k: _interval(v, samples[k]) for k, v in best.values.items()},
           "optimal": {"a": _interval(a, [f.exponents[0] for f in boots]),
                       "b": _interval(b, [f.exponents[1] for f in boots])},
           "huber_objective": best.objective}
    return doc, {"fit": best, "boots": boots}


def run_approach2(runs: Runs, groups: list[np.ndarray], args) -> tuple[dict, dict]:
    best = isoflop.fit(runs, groups)
    if best is None:
        raise ScalingInputError("approach 2: fewer than 2 compute budgets have a loss minimum in log N "
                                "(every parabola opens downward: the sizes do not bracket the optimum); "
                                "train smaller and larger models per budget, or use --approach 3")
    with _progress(args.bootstrap, "bootstrap", args.json) as advance:
        boots = isoflop.bootstrap(runs, groups, args.bootstrap, args.seed, advance)
    budgets = []
    for p in best.profiles:
        mine = [q for f in boots for q in f.profiles if q.group == p.group]
        budgets.append({"compute": p.compute, "n_points": int(len(p.index)),
                        "N_opt": _interval(p.n_opt, [q.n_opt for q in mine]),
                        "D_opt": _interval(p.d_opt, [q.d_opt for q in mine]),
                        "loss_min": p.loss_min, "inside_sampled_sizes": p.inside})
    doc = {"approach": 2, "n_points": len(runs), "n_bootstrap": len(boots), "compute_source": runs.compute_source,
           "params": {}, "optimal": {"a": _interval(best.a, [f.a for f in boots]),
                                     "b": _interval(best.b, [f.b for f in boots]), "budgets": budgets}}
    return doc, {"fit": best, "boots": boots, "groups": groups}


def _fmt(entry: dict) -> str:
    ci = entry["ci95"]
    return f"{entry['value']:.5g}" + (f"  [{ci[0]:.5g}, {ci[1]:.5g}]" if ci else "  (no bootstrap)")


def print_text(doc: dict, runs: Runs) -> None:
    skipped = f", {runs.skipped_unfinished} unfinished rows left out" if runs.skipped_unfinished else ""
    print(f"approach {doc['approach']}: {doc['n_points']} runs{skipped}, loss column {runs.loss_column}, "
          f"{doc['n_bootstrap']} bootstrap refits, value [95% interval]")
    if doc["approach"] == 3:
        print("L(N, D) = E + A / N^alpha + B / D^beta")
        for name, entry in doc["params"].items():
            print(f"  {name:<6} {_fmt(entry)}")
        print("compute-optimal: N_opt ∝ C^a, D_opt ∝ C^b, a = beta/(alpha+beta), b = alpha/(alpha+beta)")
    else:
        print(f"IsoFLOP budgets (C = {doc['compute_source']}):")
        for g in doc["optimal"]["budgets"]:
            edge = "" if g["inside_sampled_sizes"] else "  (vertex outside the sizes trained)"
            print(f"  C={g['compute']:.3g} ({g['n_points']} runs): N_opt {_fmt(g['N_opt'])}, "
                  f"D_opt {_fmt(g['D_opt'])}, L_min {g['loss_min']:.4g}{edge}")
        print("fitted: N_opt ∝ C^a, D_opt ∝ C^b")
    for name in ("a", "b"):
        print(f"  {name:<6} {_fmt(doc['optimal'][name])}")


def _check(runs: Runs, args) -> Optional[list[np.ndarray]]:
    need = MIN_POINTS[args.approach]
    if len(runs) < need:
        raise ScalingInputError(f"approach {args.approach} needs at least {need} finished runs; "
                                f"{args.results} has {len(runs)} (train more runs or sizes)")
    if args.approach == 3 and (len(np.unique(runs.params)) < 2 or len(np.unique(runs.tokens)) < 2):
        raise ScalingInputError("approach 3 needs at least 2 distinct params and 2 distinct tokens values "
                                "(alpha and beta are not identifiable otherwise)")
    return isoflop.check_groups(runs, args.group_tolerance) if args.approach == 2 else None


def fit_command(args) -> int:
    if args.bootstrap < 0:
        raise ScalingInputError(f"--bootstrap {args.bootstrap}: must be >= 0")
    if args.group_tolerance <= 0:
        raise ScalingInputError(f"--group-tolerance {args.group_tolerance}: must be > 0 (e.g. 0.25)")
    runs = read_runs(Path(args.results), args.compute_column, args.loss_column)
    groups = _check(runs, args)
    start = time.monotonic()
    doc, fitted = run_approach3(runs, args) if args.approach == 3 else run_approach2(runs, groups, args)
    doc["fit_seconds"] = round(time.monotonic() - start, 2)
    doc["loss_column"] = runs.loss_column
    if args.plot:
        from launch.scaling.plots import draw

        doc["plots"] = [str(p) for p in draw(runs, doc["approach"], fitted, Path(args.plot))]
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print_text(doc, runs)
        for path in doc.get("plots", []):
            print(f"plot: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launch.scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    from launch.scaling.design import add_parser as add_design
    from launch.scaling.heldout import add_parser as add_heldout
    from launch.scaling.study import add_parser as add_study

    add_design(sub)
    add_heldout(sub)
    add_study(sub)
    fit = sub.add_parser("fit", help="fit approach 2 (IsoFLOP) or 3 (parametric L(N, D))")
    fit.add_argument("results", help="CSV with params, tokens, loss (or launch.sweep's results.csv)")
    fit.add_argument("--approach", type=int, choices=(2, 3), required=True)
    fit.add_argument("--bootstrap", type=int, default=200, help="bootstrap refits for the intervals (default 200)")
    fit.add_argument("--seed", type=int, default=0, help="bootstrap resampling seed")
    fit.add_argument("--json", action="store_true", help="print one JSON document")
    fit.add_argument("--plot", metavar="DIR", help="write the PNG plots here")
    fit.add_argument("--compute-column", help="column holding each run's budget (default: `compute` if "
                                              "present, else 6*params*tokens)")
    fit.add_argument("--loss-column", help="column holding each run's loss (default: the first of loss, "
                                           "val_loss, final_loss present)")
    fit.add_argument("--grid", choices=sorted(chinchilla.GRIDS), default="coarse",
                     help="approach 3 starting grid: coarse (243 starts, default) or epoch (the replication's 4500)")
    fit.set_defaults(func=fit_command)
    fit.add_argument("--group-tolerance", type=float, default=0.25,
                     help="approach 2: runs within (1+tol) x of a budget's smallest C share it (default 0.25)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return run_cli(lambda: args.func(args), bad_input=(ScalingInputError,))
