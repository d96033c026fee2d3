"""The one comparison of per-step metrics (losses, grad norms) in the tests: the rule of
`python -m launch.compare_runs` (`compare_records`), raised as an AssertionError.

    worst = assert_steps_close(got, want, rtol=1e-5, what="TP2 loss")

Both sequences must be non-empty and of the same length: a comparison that loops over
`zip(got, want)` passes when a run logged nothing, which reads as parity. `want` is the
reference (launch.compare_runs' run A): tolerances are relative to it.
"""

from __future__ import annotations

from typing import Sequence

from launch.compare_runs import Comparison, compare_records


def _compare(got: Sequence[float], want: Sequence[float], *, rtol: float, what: str, start: int) -> Comparison:
    assert len(want) > 0, f"{what}: the reference has no steps"
    assert len(got) == len(want), f"{what}: {len(got)} steps vs {len(want)} in the reference"
    records = [[{"step": start + i, "value": v} for i, v in enumerate(values)] for values in (want, got)]
    return compare_records(*records, metrics=("value",), rtol=rtol, atol=0.0, names=("reference", what))


def relative_differences(got: Sequence[float], want: Sequence[float], *, what: str = "values") -> list[float]:
    """|got - want| / |want| per step; AssertionError unless both are non-empty and equally long."""
    comparison = _compare(got, want, rtol=0.0, what=what, start=1)
    return [row.cells[0].rel_diff or 0.0 for row in comparison.rows]


def assert_steps_close(got: Sequence[float], want: Sequence[float], *, rtol: float, what: str = "values",
                       start: int = 1) -> float:
    """Each step of `got` within `rtol` (relative) of `want`'s, the first failing step named
    (numbered from `start`); returns the largest relative difference."""
    comparison = _compare(got, want, rtol=rtol, what=what, start=start)
    if not comparison.ok:
        step, cell = comparison.failures[0]
        raise AssertionError(f"{what} step {step}: {cell.b} vs reference {cell.a} "
                             f"({cell.rel_diff:.2e} relative, tolerance {rtol})")
    return max(row.cells[0].rel_diff or 0.0 for row in comparison.rows)


def assert_steps_equal(got: Sequence[float], want: Sequence[float], *, what: str = "values", start: int = 1) -> None:
    """Bitwise equal per step (an exact resume, the same reduction order), both non-empty and
    equally long; the first differing step named (numbered from `start`)."""
    comparison = _compare(got, want, rtol=0.0, what=what, start=start)
    if not comparison.ok:
        step, cell = comparison.failures[0]
        raise AssertionError(f"{what} step {step}: {cell.b} vs reference {cell.a} (must be bitwise equal)")
