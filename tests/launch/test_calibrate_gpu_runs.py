"""launch.plan --calibrate on three real GPU runs (tests/launch/fixtures/h200-runs: one H200,
BF16, portable spec, three shapes): one run pins its own step time; several runs fit each
kind, and the fit predicts a run it has not seen."""

from __future__ import annotations

import pathlib

import pytest

from launch.planner import cli
from launch.planner.calibrate import CalibrationError, calibrate, calibrate_runs, read_run
from launch.planner.devices import get_device
from launch.planner.efficiency import DEFAULT_EFFICIENCIES

RUNS = pathlib.Path(__file__).parent / "fixtures" / "h200-runs"
NAMES = ("seq4096-mbs1", "seq2048-mbs2-8layers", "seq8192-mbs1")
H200 = get_device("h200-141gb")


def runs(*names):
    return [read_run(RUNS / n) for n in names]


@pytest.mark.parametrize("name", NAMES)
def test_one_run_pins_its_own_step_time(name):
    (run,) = runs(name)
    fit = calibrate(run, H200)
    assert fit.after_s == pytest.approx(run.median_step_s, rel=0.05)
    assert fit.kinds == ("gemm_bf16", "attention", "memory")


def test_one_factor_does_not_carry_to_other_shapes():
    """Why several runs: the portable spec's unfused attention makes attention's share of the
    step grow with seq; one factor fitted at seq 4096 misses seq 2048 x 8 layers and seq 8192
    by more than the planner's +-15% (+22% and -27% measured)."""
    a, b, c = runs(*NAMES)
    fit = calibrate(a, H200)
    from launch.planner.candidate import Candidate
    from launch.planner.throughput import ThroughputOptions, estimate_step
    opts = ThroughputOptions(efficiencies=fit.efficiencies)
    for other in (b, c):
        predicted = estimate_step(Candidate.from_config(other.config, 1), H200, opts).step_s
        assert abs(predicted / other.median_step_s - 1) > 0.15


def test_several_runs_fit_each_kind_and_predict_a_run_left_out():
    fit = calibrate_runs(runs(*NAMES), H200)
    assert fit.kinds == ("gemm_bf16", "attention")
    for run, predicted, left_out in zip(fit.runs, fit.predicted_s, fit.left_out_s, strict=True):
        assert predicted == pytest.approx(run.median_step_s, rel=0.05)
        assert left_out == pytest.approx(run.median_step_s, rel=0.10)  # measured: -2.1%, +3.6%, +5.3%
    # The GEMMs of this H200 run land near the BF16 efficiency fitted to the published H100 rows
    # (0.455 vs 0.483); the unfused attention far below the fused one the planner assumes.
    assert fit.efficiencies.gemm_bf16 == pytest.approx(DEFAULT_EFFICIENCIES.gemm_bf16, rel=0.15)
    assert fit.efficiencies.attention < 0.1 * DEFAULT_EFFICIENCIES.attention


def test_too_few_or_alike_runs_are_refused():
    with pytest.raises(CalibrationError, match="same shape"):
        calibrate_runs(runs(NAMES[0], NAMES[0]), H200)


def test_plan_cli_takes_several_runs(capsys):
    argv = ["--recipe", "llama3-8b", "--gpus", "8", "--gpu", "h200-141gb", "--top", "1"]
    for name in NAMES:
        argv += ["--calibrate", str(RUNS / name)]
    rc = cli.main(argv)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "calibrated on 3 runs, each kind fitted on its own: gemm_bf16 0.483 ->" in out
    assert out.count("left out of the fit") == 3
    assert "different layer specs" in out  # the runs are portable, the recipe plans te
