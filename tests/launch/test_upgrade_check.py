"""launch.upgrade_check compare: per-step metrics and final weights of two set-ups' runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from checkpoints_tools.reshard import reshard
from launch import upgrade_check
from models.layout import ParallelLayout
from models.runtime import DTYPES
from pretrain.checkpointing.format import write_latest

FIXTURE = Path(__file__).parents[1] / "pretrain" / "fixtures" / "checkpoint_v2"


def _run(root: Path, losses: list[float], *, bf16: bool = False) -> None:
    """A run directory as `upgrade_check run` leaves it: metrics.jsonl and a checkpoint."""
    step = json.loads((FIXTURE / "continuation.json").read_text())["checkpoint"]
    checkpoints = root / "checkpoints"
    checkpoints.mkdir(parents=True)
    if bf16:  # the same weights rounded to bf16: ~1e-3 relative apart
        reshard(FIXTURE / step, checkpoints / step, layout=ParallelLayout(), dtype=DTYPES["bf16"])
    else:
        shutil.copytree(FIXTURE / step, checkpoints / step)
    write_latest(checkpoints, step)
    lines = [json.dumps({"step": i + 1, "loss": loss, "grad_norm": 1.0 + i}) for i, loss in enumerate(losses)]
    (root / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_equal_runs_pass_and_a_changed_loss_or_weight_fails(tmp_path, capsys):
    _run(tmp_path / "old" / "one-rank", [5.0, 4.5])
    _run(tmp_path / "same" / "one-rank", [5.0, 4.5])
    _run(tmp_path / "loss" / "one-rank", [5.0, 4.5 * (1 + 1e-4)])
    _run(tmp_path / "weights" / "one-rank", [5.0, 4.5], bf16=True)
    check = lambda new: upgrade_check.main(["compare", str(tmp_path / "old"), str(tmp_path / new),  # noqa: E731
                                            "--cases", "one-rank"])
    assert check("same") == 0 and "same" in capsys.readouterr().out
    assert check("loss") == 1 and "DIFFERENT: 1 of 4 values past rtol 1e-05" in capsys.readouterr().out
    assert check("weights") == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and "(weights: " in out
    assert check("missing") == 2 and "does not exist" in capsys.readouterr().err


def test_run_refuses_a_folder_that_is_not_a_checkout(tmp_path):
    with pytest.raises(SystemExit):
        upgrade_check.main(["run", "--out", str(tmp_path / "out"), "--checkout", str(tmp_path)])
