"""launch.mup_transfer (issue 44): the mean/SE over seeds, the best-LR pick and its separation,
and the bad input. The benchmark itself is minutes of CPU (docs/benchmarks.md, muP); its
training path is the coordinate check's (tests/pretrain/test_mup_coord_check.py)."""

from __future__ import annotations

import math

import pytest

from launch.mup_transfer import best_lrs, mean_se, summarize
from tests.bad_input import run_cli


def test_mean_and_se_over_seeds_by_hand():
    # 2, 3, 7: mean 4, sample variance (4 + 1 + 9) / 2 = 7, SE sqrt(7 / 3).
    mean, se = mean_se([2.0, 3.0, 7.0])
    assert mean == pytest.approx(4.0) and se == pytest.approx(math.sqrt(7 / 3))
    assert mean_se([5.0]) == (5.0, None)  # one seed: no spread to measure
    assert mean_se([5.0, math.inf, 4.0]) == (math.inf, math.inf)  # one diverged seed: the point diverged
    assert mean_se([5.0, math.nan]) == (math.inf, math.inf)


def test_best_lr_is_the_lowest_mean_and_says_whether_it_is_separated():
    per_seed = {"sp": {"64": {"0.01": [3.0, 3.2], "0.1": [2.4, 2.6], "1": [2.0, math.inf]},
                       "128": {"0.01": [2.0, 2.2], "0.1": [2.1, 2.3]}},
                "mup": {"64": {"0.01": [math.inf, 1.0], "0.1": [math.nan, 1.0]}}}
    stats = summarize(per_seed)
    assert stats["sp"]["64"]["0.1"] == {"mean": pytest.approx(2.5), "se": pytest.approx(0.1)}
    assert stats["sp"]["64"]["1"] == {"mean": math.inf, "se": math.inf}
    best = best_lrs(stats)
    # 64: 0.1 (2.5 ± 0.1) beats 0.01 (3.1 ± 0.1) by 0.6 > sqrt(0.1^2 + 0.1^2) = 0.141.
    assert best["sp"]["64"] == {"lr": "0.1", "mean": pytest.approx(2.5), "se": pytest.approx(0.1),
                                "runner_up": "0.01", "separated": True}
    # 128: 0.01 (2.1) vs 0.1 (2.2), a gap of 0.1 < 0.141: the best is not separated.
    assert best["sp"]["128"]["lr"] == "0.01" and best["sp"]["128"]["runner_up"] == "0.1"
    assert best["sp"]["128"]["separated"] is False
    assert best["mup"]["64"] is None  # every LR diverged


def test_separation_is_unknown_with_one_seed_and_true_against_a_diverged_runner_up():
    best = best_lrs(summarize({"sp": {"64": {"0.01": [3.0], "0.1": [2.0]}},
                               "mup": {"64": {"0.01": [3.0, 3.1], "0.1": [math.inf, 2.0]}}}))
    assert best["sp"]["64"]["lr"] == "0.1" and best["sp"]["64"]["se"] is None
    assert best["sp"]["64"]["separated"] is None
    assert best["mup"]["64"]["lr"] == "0.01" and best["mup"]["64"]["runner_up"] is None
    assert best["mup"]["64"]["separated"] is True


def test_bad_arguments_are_refused_in_one_line(tmp_path):
    for argv in (["--widths", "64", "100"], ["--widths", "64"], ["--lrs", "0.01"], ["--steps", "5"],
                 ["--seeds", "0"], ["--lrs", "0.01", "-1"]):
        result = run_cli("launch.mup_transfer", argv + ["--out", str(tmp_path / "out")])
        assert result.code == 2 and len(result.error_lines) == 1 and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists()
    result = run_cli("launch.mup_transfer", ["--seeds", "0", "--out", str(tmp_path / "out")])
    assert "--seeds >= 1 (got 0)" in result.error_lines[0], result.output
    result = run_cli("pretrain.mup_coord_check", ["--widths", "64", "100"])
    assert result.code == 2 and "multiple of 16" in result.output and len(result.error_lines) == 1, result.output
