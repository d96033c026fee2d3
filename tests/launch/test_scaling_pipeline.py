"""The scaling pipeline end to end, a few steps a point: `launch.scaling design` writes an
IsoFLOP spec for tiny-llama sizes on the demo's real text -> `launch.sweep` trains it on CPU
(stable runs and WSD cooldown branches, a held-out evaluation at every point's end) ->
results.csv with val_loss -> `launch.scaling fit --approach 3 --json` fits the held-out loss
-> `launch.scaling heldout` measures its noise. The full-size study: README, "Scaling laws"."""

from __future__ import annotations

import csv
import json
import math

import pytest

from launch.scaling.cli import main as scaling_main
from launch.scaling.heldout import analyse
from launch.sweeps import run as sweep

CPU = ["runtime.spec=portable", "schedule.seq_length=64", "schedule.micro_batch_size=8",
       "schedule.global_batch_size=8", "schedule.warmup_steps=1", "logging.tensorboard=false",
       "logging.log_interval=5", "optimizer.lr=0.01", "optimizer.min_lr=0.001"]


@pytest.mark.slow  # 11 training processes: 2 min 44 s of CPU (16 min wall on a VM at load 30-60)
def test_design_sweep_fit_on_real_text(tmp_path, capsys):
    spec, out = tmp_path / "isoflop.yaml", tmp_path / "sweep"
    assert scaling_main(["design", "--recipe", "tiny-llama", "--budgets", "1.5e10", "3e10", "6e10", "--sizes", "4",
                         "--min-steps", "8", "--eval-batches", "3", "--cooldown-fraction", "0.25",
                         "--out", str(spec), "--out-dir", str(out), *[a for kv in CPU for a in ("--set", kv)]]) == 0
    assert sweep.main([str(spec)]) == 0, capsys.readouterr().err
    ran = capsys.readouterr().out
    branches = ran.count("cooldown branch of")
    assert branches >= 4, ran  # every size trained at several budgets branches its smaller ones
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 10 and all(r["status"] == "finished" for r in rows)
    for r in rows:  # the held-out loss of every point, and the budget it was designed for
        assert 0 < float(r["val_loss"]) < math.log(4000) + 1 and float(r["val_loss_se"]) > 0
        assert abs(float(r["flops"]) / float(r["compute"]) - 1) < 0.1
    assert scaling_main(["fit", str(out / "results.csv"), "--approach", "3", "--bootstrap", "8", "--json"]) == 0
    fit = json.loads(capsys.readouterr().out)
    assert fit["loss_column"] == "val_loss" and fit["n_points"] == len(rows) and fit["approach"] == 3
    assert all(math.isfinite(entry["value"]) for entry in fit["params"].values())
    noise = analyse(out)
    assert noise["points"] == len(rows) and noise["batches"] == 3 and noise["pairs"]
