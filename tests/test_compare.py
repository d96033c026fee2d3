"""tests/compare.py refuses what a bare zip would pass: empty and short runs."""

import pytest

from tests.compare import assert_steps_close, assert_steps_equal


@pytest.mark.parametrize("check", [
    lambda got, want: assert_steps_close(got, want, rtol=1e-5),
    lambda got, want: assert_steps_equal(got, want),
])
@pytest.mark.parametrize("got, want, message", [
    ([], [], "the reference has no steps"),
    ([], [1.0, 2.0], "0 steps vs 2"),
    ([1.0], [1.0, 2.0], "1 steps vs 2"),
    ([1.0, 2.0, 3.0], [1.0, 2.0], "3 steps vs 2"),
])
def test_empty_or_short_runs_fail(check, got, want, message):
    with pytest.raises(AssertionError, match=message):
        check(got, want)


def test_a_differing_step_is_named():
    with pytest.raises(AssertionError, match="loss step 5: 2.1 vs reference 2.0"):
        assert_steps_close([1.0, 2.1], [1.0, 2.0], rtol=1e-3, what="loss", start=4)
    with pytest.raises(AssertionError, match="step 2: 2.0000001 vs reference 2.0"):
        assert_steps_equal([1.0, 2.0000001], [1.0, 2.0])
    assert assert_steps_close([1.0, 2.0000001], [1.0, 2.0], rtol=1e-6) == pytest.approx(5e-8)
