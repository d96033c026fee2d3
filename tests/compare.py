"""The one comparison of per-step metrics (losses, grad norms) in the tests.

    worst = assert_steps_close(got, want, rtol=1e-5, what="TP2 loss")

Both sequences must be non-empty and of the same length: a comparison that loops over
`zip(got, want)` passes when a run logged nothing, which reads as parity.
"""

from __future__ import annotations

from typing import Sequence


def relative_differences(got: Sequence[float], want: Sequence[float], *, what: str = "values") -> list[float]:
    """|got - want| / |want| per step; AssertionError unless both are non-empty and equally long."""
    assert len(want) > 0, f"{what}: the reference has no steps"
    assert len(got) == len(want), f"{what}: {len(got)} steps vs {len(want)} in the reference"
    return [abs(g - w) / abs(w) if w else abs(g - w) for g, w in zip(got, want, strict=True)]


def assert_steps_close(got: Sequence[float], want: Sequence[float], *, rtol: float, what: str = "values",
                       start: int = 1) -> float:
    """Each step of `got` within `rtol` (relative) of `want`'s, the first failing step named
    (numbered from `start`); returns the largest relative difference."""
    diffs = relative_differences(got, want, what=what)
    for step, (g, w, d) in enumerate(zip(got, want, diffs, strict=True), start=start):
        assert d <= rtol, f"{what} step {step}: {g} vs reference {w} ({d:.2e} relative, tolerance {rtol})"
    return max(diffs)


def assert_steps_equal(got: Sequence[float], want: Sequence[float], *, what: str = "values", start: int = 1) -> None:
    """Bitwise equal per step (an exact resume, the same reduction order), both non-empty and
    equally long; the first differing step named (numbered from `start`)."""
    relative_differences(got, want, what=what)
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=start):
        assert g == w, f"{what} step {step}: {g} vs reference {w} (must be bitwise equal)"
