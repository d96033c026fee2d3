"""Compare two runs step by step: a layout change or an upgrade should not move the curve.

    # the same recipe at TP1 and at TP2 x PP2, a few steps each, then:
    python -m launch.compare_runs runs/tp1 runs/tp2pp2 --rtol 1e-5
    # other metrics, an absolute floor, a metrics.jsonl given directly
    python -m launch.compare_runs runs/a/metrics.jsonl runs/b --metrics loss,grad_norm,lr --atol 1e-7

RUN_A and RUN_B are run directories (holding `metrics.jsonl`) or the files themselves. The
training records of each are read by step (the last record of a step wins: a resumed run
re-logs the steps after its checkpoint; evaluation records are left out). Each value of B is
compared with A's at the same step: |a - b| <= atol + rtol * |a| (both missing count as
equal). A NaN or infinity in either run is never equal, not even to the same in the other:
two runs that both diverged agree on nothing worth knowing. Prints the per-step table and
exits 0 when every value is within the tolerance, 1 when one is not or is non-finite (the
summary names the first such step and metric), 2 with one `error:` line on bad input: a missing or empty file, different step sets, or a
metric neither run logged.

`compare_records` is the comparison without the files or the table (the tests' per-step
metric comparison uses it): both sequences must be non-empty and cover the same steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

from data_pipeline.checks import finite_float, run_cli
from launch.sweeps.results import read_metrics

DEFAULT_METRICS = ("loss", "grad_norm")


class CompareError(ValueError):
    """The two runs cannot be compared (bad input: exit 2)."""


@dataclasses.dataclass
class Cell:
    metric: str
    a: Optional[float]
    b: Optional[float]
    ok: bool

    @property
    def abs_diff(self) -> Optional[float]:
        return abs(self.a - self.b) if self.a is not None and self.b is not None else None

    @property
    def nonfinite(self) -> bool:
        return any(v is not None and not math.isfinite(v) for v in (self.a, self.b))

    @property
    def rel_diff(self) -> Optional[float]:
        diff = self.abs_diff
        if diff is None or diff == 0:
            return diff
        return diff / abs(self.a) if self.a else math.inf


@dataclasses.dataclass
class Row:
    step: int
    cells: list[Cell]

    @property
    def ok(self) -> bool:
        return all(cell.ok for cell in self.cells)


@dataclasses.dataclass
class Comparison:
    metrics: tuple[str, ...]
    rtol: float
    atol: float
    rows: list[Row]

    @property
    def failures(self) -> list[tuple[int, Cell]]:
        return [(row.step, cell) for row in self.rows for cell in row.cells if not cell.ok]

    @property
    def nonfinite(self) -> list[tuple[int, Cell]]:
        return [(row.step, cell) for row in self.rows for cell in row.cells if cell.nonfinite]

    @property
    def ok(self) -> bool:
        return not self.failures

    def verdict(self) -> str:
        """`same`, `different`, or `non-finite` (a run diverged: reported before any difference)."""
        return "non-finite" if self.nonfinite else "same" if self.ok else "different"

    def summary(self) -> str:
        values = len(self.rows) * len(self.metrics)
        tol = f"rtol {self.rtol:g}, atol {self.atol:g}"
        if self.nonfinite:
            step, cell = self.nonfinite[0]
            return (f"{len(self.nonfinite)} of {values} values are NaN or infinite (a run diverged); first at "
                    f"step {step}: {cell.metric} {_fmt(cell.a)} (A) vs {_fmt(cell.b)} (B)")
        if self.ok:
            return f"{len(self.rows)} steps x {', '.join(self.metrics)}: all {values} values within {tol}"
        step, cell = self.failures[0]
        return (f"{len(self.failures)} of {values} values past {tol}; first at step {step}: "
                f"{cell.metric} {_fmt(cell.a)} vs {_fmt(cell.b)}")


def values_match(a: Optional[float], b: Optional[float], *, rtol: float, atol: float) -> bool:
    """|a - b| <= atol + rtol * |a|; both None match. A NaN or infinity matches nothing, not
    even itself: agreement between two diverged runs is not agreement."""
    if a is None or b is None:
        return a is None and b is None
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    return abs(a - b) <= atol + rtol * abs(a)


def compare_records(records_a: Sequence[dict], records_b: Sequence[dict], *, metrics: Sequence[str] = DEFAULT_METRICS,
                    rtol: float = 1e-5, atol: float = 0.0, names: tuple[str, str] = ("A", "B")) -> Comparison:
    """Per-step comparison of two runs' training records (dicts with `step` and the metrics).

    Strict: both must be non-empty, hold the same steps in the same order, and every metric
    must be logged by at least one run (a misspelt name is an error, not a vacuous pass).
    """
    for name, records in zip(names, (records_a, records_b), strict=True):
        if not records:
            raise CompareError(f"run {name} has no training records to compare")
    steps_a, steps_b = [r["step"] for r in records_a], [r["step"] for r in records_b]
    if steps_a != steps_b:
        raise CompareError(f"the runs cover different steps: {names[0]} {_steps(steps_a)}, "
                           f"{names[1]} {_steps(steps_b)}; train both for the same steps")
    if not metrics:
        raise CompareError("no metrics to compare; pass --metrics, e.g. loss,grad_norm")
    logged = {key for r in (*records_a, *records_b) for key, value in r.items() if value is not None}
    unknown = [m for m in metrics if m not in logged]
    if unknown:
        numeric = sorted(k for k in logged if all(isinstance(r.get(k), (int, float, type(None)))
                                                  for r in records_a))
        raise CompareError(f"neither run logged {', '.join(unknown)}; logged metrics: {', '.join(numeric)}")
    rows = []
    for ra, rb in zip(records_a, records_b, strict=True):
        cells = [Cell(m, ra.get(m), rb.get(m), values_match(ra.get(m), rb.get(m), rtol=rtol, atol=atol))
                 for m in metrics]
        rows.append(Row(ra["step"], cells))
    return Comparison(tuple(metrics), rtol, atol, rows)


def metrics_file(run: str) -> Path:
    """The metrics.jsonl of a run directory, or the file given; CompareError if there is none."""
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise CompareError(f"{path} does not exist; pass a run directory holding metrics.jsonl, or the file")
    return path


def compare_runs(run_a: str, run_b: str, *, metrics: Sequence[str] = DEFAULT_METRICS, rtol: float = 1e-5,
                 atol: float = 0.0) -> Comparison:
    files = [metrics_file(run_a), metrics_file(run_b)]
    records = [read_metrics(path) for path in files]
    for path, recs in zip(files, records, strict=True):
        if not recs:
            raise CompareError(f"{path} holds no training records (empty, or the run failed before step 1)")
    return compare_records(*records, metrics=metrics, rtol=rtol, atol=atol, names=(str(run_a), str(run_b)))


def print_table(comparison: Comparison, run_a: str, run_b: str, *, console) -> None:
    from rich.table import Table

    console.print(f"A = {run_a}\nB = {run_b}", highlight=False, soft_wrap=True)
    table = Table()
    table.add_column("step", justify="right")
    for metric in comparison.metrics:
        table.add_column(f"{metric} A", justify="right")
        table.add_column(f"{metric} B", justify="right")
        table.add_column("rel diff", justify="right")
    table.add_column("")
    for row in comparison.rows:
        cells = [str(row.step)]
        for cell in row.cells:
            diff = cell.rel_diff
            style = "" if cell.ok else "bold red"
            cells += [_fmt(cell.a), _fmt(cell.b), f"[{style}]{_fmt(diff, '.1e')}[/]" if style else _fmt(diff, ".1e")]
        nonfinite = any(cell.nonfinite for cell in row.cells)
        cells.append("[bold red]non-finite[/]" if nonfinite else "" if row.ok else "[bold red]past tol[/]")
        table.add_row(*cells)
    console.print(table)


def _fmt(value: Optional[float], spec: str = ".6g") -> str:
    return "-" if value is None else format(value, spec)


def _steps(steps: list[int]) -> str:
    if steps == list(range(steps[0], steps[0] + len(steps))):
        return f"{steps[0]}..{steps[-1]} ({len(steps)} steps)"
    shown = ", ".join(map(str, steps[:6]))
    return f"[{shown}{', ...' if len(steps) > 6 else ''}] ({len(steps)} steps)"


def _nonnegative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value:g}")
    return value


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.compare_runs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", metavar="RUN_A", help="run directory (or its metrics.jsonl): the reference")
    parser.add_argument("run_b", metavar="RUN_B", help="run directory (or its metrics.jsonl) compared with A")
    parser.add_argument("--rtol", type=_nonnegative_float, default=1e-5, help="relative tolerance (default 1e-5)")
    parser.add_argument("--atol", type=_nonnegative_float, default=0.0, help="absolute tolerance (default 0)")
    parser.add_argument("--metrics", default=",".join(DEFAULT_METRICS),
                        help="comma-separated metrics.jsonl keys (default loss,grad_norm)")
    args = parser.parse_args(argv)
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # a log file or a pipe: no 80-column wrapping of the numbers
        console = Console(width=40 + 36 * len(metrics))

    def body() -> int:
        comparison = compare_runs(args.run_a, args.run_b, metrics=metrics, rtol=args.rtol, atol=args.atol)
        print_table(comparison, args.run_a, args.run_b, console=console)
        verdict = comparison.verdict()
        style = "green" if verdict == "same" else "bold red"
        console.print(f"[{style}]{verdict}[/]: " + comparison.summary(), highlight=False, soft_wrap=True)
        return 0 if comparison.ok else 1

    return run_cli(body, bad_input=(CompareError,))


if __name__ == "__main__":
    sys.exit(main())
