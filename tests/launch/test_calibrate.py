"""launch.plan --calibrate: a tiny CPU run trains, the planner fits that run's efficiency and
then predicts the same run's step time within 5%; bad run directories give one-line errors."""

from __future__ import annotations

import json
import statistics

import pytest
import yaml

from launch.planner import cli
from launch.planner.calibrate import calibrate, read_run
from launch.planner.candidate import Candidate
from launch.planner.devices import get_device
from launch.planner.throughput import ThroughputOptions, estimate_step
from pretrain.config import ExperimentConfig
from tests.distributed import run_ranks

pytestmark = [pytest.mark.distributed]
STEPS = 8


@pytest.fixture(scope="module")
def cpu_run(module_tmp_factory):
    run_dir = module_tmp_factory.mktemp("calibrate") / "run"
    overrides = [
        "runtime.spec=portable", f"schedule.train_steps={STEPS}", "schedule.warmup_steps=1", "schedule.seq_length=64",
        "schedule.micro_batch_size=2", "schedule.global_batch_size=4", "data.demo=true", "logging.log_interval=1",
        "logging.tensorboard=false", f"logging.run_dir={run_dir}",
    ]
    run_ranks(1, "tests.pretrain.workers:train", recipe="tiny-llama", overrides=overrides)
    return run_dir


def test_calibration_recovers_the_runs_step_time(cpu_run):
    records = [json.loads(line) for line in (cpu_run / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records if r.get("step_time_s")]
    assert len(times) == STEPS
    measured = statistics.median(times[STEPS // 4:])  # the warm-up read_run leaves out by default

    cpu = get_device("cpu")
    fit = calibrate(read_run(cpu_run), cpu)
    assert fit.kinds == ("gemm_fp32", "memory")  # tiny-llama trains in fp32
    # The fitted efficiencies, put into a plain estimate of the run's own config, give its time.
    config = ExperimentConfig.model_validate(yaml.safe_load((cpu_run / "config.yaml").read_text()))
    predicted = estimate_step(Candidate.from_config(config, 1), cpu,
                              ThroughputOptions(efficiencies=fit.efficiencies)).step_s
    assert predicted == pytest.approx(measured, rel=0.05)
    assert fit.before_s != pytest.approx(measured, rel=0.05)  # the nominal CPU numbers were off


def test_plan_cli_prints_the_fit_and_plans_with_it(cpu_run, capsys):
    rc = cli.main(["--recipe", "tiny-llama", "--gpus", "1", "--gpu", "cpu", "--calibrate", str(cpu_run),
                   "--seq", "64", "--global-batch", "4", "--micro-batch", "2", "--top", "1", "runtime.spec=portable"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "calibrated on" in out and "gemm_fp32 0.500 ->" in out


def test_bad_run_dirs_are_one_line_errors(tmp_path, capsys):
    rc = cli.main(["--recipe", "tiny-llama", "--gpus", "1", "--gpu", "cpu", "--calibrate", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == cli.BAD_INPUT
    assert "no config.yaml there" in err
