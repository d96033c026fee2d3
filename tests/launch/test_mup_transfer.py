"""launch.mup_transfer (issue 44): the best-LR pick and its bad input. The benchmark itself is
minutes of CPU (README, muP); its training path is the coordinate check's
(tests/pretrain/test_mup_coord_check.py)."""

from __future__ import annotations

import math

from launch.mup_transfer import best_lrs
from tests.bad_input import run_cli


def test_best_lr_is_the_lowest_finite_loss_per_width():
    results = {"sp": {"64": {"0.01": 3.0, "0.1": 2.5, "1": math.inf}, "128": {"0.01": 2.0, "0.1": math.inf}},
               "mup": {"64": {"0.01": math.inf}}}
    assert best_lrs(results) == {"sp": {"64": "0.1", "128": "0.01"}, "mup": {"64": None}}


def test_bad_arguments_are_refused_in_one_line(tmp_path):
    for argv in (["--widths", "64", "100"], ["--widths", "64"], ["--lrs", "0.01"], ["--steps", "5"]):
        result = run_cli("launch.mup_transfer", argv + ["--out", str(tmp_path / "out")])
        assert result.code == 2 and len(result.error_lines) == 1 and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists()
    result = run_cli("pretrain.mup_coord_check", ["--widths", "64", "100"])
    assert result.code == 2 and "multiple of 16" in result.output and len(result.error_lines) == 1, result.output
