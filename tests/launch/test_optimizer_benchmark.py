"""launch.optimizer_benchmark: how the tuned LR is picked, the overrides each run gets, and bad
input refused in one line before any run starts. (The runs themselves are the README's numbers.)"""

from __future__ import annotations

from data_pipeline.checks import BAD_INPUT
from launch.optimizer_benchmark import _steps_to, main, optimizer_overrides, tail_loss, tuned
from pretrain.cli import resolve_config


def test_tuned_is_lowest_tail_loss_not_lowest_final_loss():
    runs = [{"lr": 1, "losses": [5, 4, 3, 1.0]}, {"lr": 2, "losses": [5, 2, 2, 2.0]}]
    assert tail_loss(runs[0]["losses"], 3) == (4 + 3 + 1) / 3
    assert tuned(runs, 3)["lr"] == 2  # 2.0 mean over the last 3 vs 2.67
    assert tuned(runs, 1)["lr"] == 1


def test_steps_to_target_uses_a_trailing_mean():
    losses = [9.0] * 10 + [1.0] * 10
    assert _steps_to(losses, 5.0, window=10) == 15  # mean of steps 6..15: (5 x 9 + 5 x 1) / 10
    assert _steps_to(losses, 0.5, window=10) is None


def test_overrides_select_the_optimizer_the_config_reads():
    config = resolve_config("tiny-llama", None, optimizer_overrides("muon", 2e-2, 3e-3))
    assert (config.optimizer.name, config.optimizer.lr, config.optimizer.muon.adamw_lr) == ("muon", 2e-2, 3e-3)
    config = resolve_config("tiny-llama", None, optimizer_overrides("adamw", None, 3e-3))
    assert (config.optimizer.name, config.optimizer.lr) == ("adamw", 3e-3)


def test_bad_input_is_one_line_before_any_run(capsys):
    assert main(["lr-grid", "--muon-lrs", "0"]) == BAD_INPUT
    assert main(["step-time", "--steps", "3", "--warmup", "5"]) == BAD_INPUT
    assert main(["lr-grid", "optimizer.muon.num_ns_step=3"]) == BAD_INPUT
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines), lines
    assert "num_ns_steps" in lines[2]


def test_resume_reuses_runs_of_the_same_grid_only(tmp_path):
    import argparse
    import json

    from launch.optimizer_benchmark import _earlier_runs

    path = tmp_path / "grid.json"
    runs = [{"optimizer": "muon", "lr": 0.01, "losses": [5.0, 4.0]}]
    path.write_text(json.dumps({"steps": 150, "overrides": [], "muon_adamw_lr": 3e-3, "runs": runs}))
    args = argparse.Namespace(json_out=str(path), resume=True, steps=150, overrides=[], muon_adamw_lr=3e-3)
    assert _earlier_runs(args) == runs
    assert _earlier_runs(argparse.Namespace(**{**vars(args), "steps": 100})) == []  # another grid
    assert _earlier_runs(argparse.Namespace(**{**vars(args), "resume": False})) == []


def test_muon_min_lr_lowers_muons_floor_and_keeps_its_adamw_floor():
    config = resolve_config("tiny-llama", None, optimizer_overrides("muon", 7.8125e-5, 3e-3, 3e-5, 3e-4))
    opt = config.optimizer
    assert (opt.lr, opt.min_lr, opt.muon.adamw_lr, opt.muon.adamw_min_lr) == (7.8125e-5, 3e-5, 3e-3, 3e-4)
    # AdamW runs keep the recipe's floor: the Muon-only keys are not passed to them
    assert optimizer_overrides("adamw", 3e-3, 3e-3, 3e-5, 3e-4) == ["optimizer.name=adamw", "optimizer.lr=0.003"]
