"""The scaling study end to end, a few steps a point: `launch.scaling study` designs an IsoFLOP
ladder of tiny-llama sizes on the demo's real text -> `launch.sweep` trains it on CPU (stable
runs and WSD cooldown branches, a held-out evaluation at every point's end) -> approach 3 is
fitted to val_loss with N = non-embedding params, with a bootstrap -> the next size at 2x the
largest budget is predicted, trained and compared -> study.json. Then `launch.scaling fit --json`
refits the same table and `launch.scaling heldout` measures its noise. The full-size study:
README, "The end-to-end study"."""

from __future__ import annotations

import csv
import json
import math

import pytest
import yaml

from launch.scaling.cli import main as scaling_main
from launch.scaling.heldout import analyse
from models.config import ModelConfig
from models.flops import non_embedding_params, total_params


def _rows(path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # 11 training processes (10 ladder points: approach 3's minimum; the target): ~3 min of CPU
def test_study_on_real_text(tmp_path, capsys):
    out = tmp_path / "study"
    assert scaling_main(["study", "--out", str(out), "--budgets", "1.5e10", "3e10", "--sizes", "5",
                         "--min-steps", "8", "--eval-batches", "3", "--cooldown-fraction", "0.25",
                         "--bootstrap", "8"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("cooldown branch of") == 5, printed  # each size's smaller budget branches
    rows = _rows(out / "ladder" / "results.csv")
    assert len(rows) == 10 and all(r["status"] == "finished" for r in rows)
    for r in rows:  # the held-out loss of every point, and the budget it was designed for
        assert 0 < float(r["val_loss"]) < math.log(4000) + 1 and float(r["val_loss_se"]) > 0
        assert abs(float(r["flops"]) / float(r["compute"]) - 1) < 0.1
    # The fit's N is each point's non-embedding count, from the model the point really trained.
    fitted = {r["point"]: int(r["params"]) for r in _rows(out / "fit.csv")}
    for r in rows:
        model = ModelConfig(**yaml.safe_load((out / "ladder" / "points" / r["point"] / "config.yaml").read_text())["model"])
        assert fitted[r["point"]] == non_embedding_params(model) < total_params(model) == int(r["params"])
        assert model.num_query_groups == model.num_attention_heads  # the study's tiny-llama family: MHA
    study = json.loads((out / "study.json").read_text())
    target, compute = study["target"], study["compute"]
    assert study["n_points"] == 10 and study["params_count"] == "non-embedding" and study["n_bootstrap"] == 8
    assert target["params"] > max(fitted.values()) and target["budget"] == 2 * 3e10
    for name, value in study["fit"].items():  # each parameter's bootstrap interval
        lo, hi = study["fit_ci95"][name]
        assert lo <= hi and math.isfinite(value), (name, value, lo, hi)
    lo, hi = target["ci95"]
    assert lo <= target["predicted"] <= hi and math.isfinite(target["predicted"])
    measured = _rows(out / "target" / "results.csv")[0]
    assert measured["status"] == "finished" and float(measured["val_loss"]) == target["val_loss"]
    assert target["error"] == pytest.approx(target["val_loss"] - target["predicted"])
    assert compute["branches"] == printed.count("cooldown branch of") and 0 < compute["saved_fraction"] < 1
    assert "[study] target" in printed and f"{target['predicted']:.4f}" in printed
    assert scaling_main(["fit", str(out / "fit.csv"), "--approach", "3", "--bootstrap", "8", "--json"]) == 0
    fit = json.loads(capsys.readouterr().out)
    assert fit["loss_column"] == "val_loss" and fit["n_points"] == 10 and fit["approach"] == 3
    assert all(math.isfinite(entry["value"]) for entry in fit["params"].values())
    noise = analyse(out / "ladder")
    assert noise["points"] == 10 and noise["batches"] == 3 and noise["pairs"]


def test_a_ladder_without_an_n_term_is_named(capsys):
    """The warning: an exponent whose bootstrap interval reaches 0 (the old default ladder's alpha,
    95% [-0.057, 0.064]) or a non-positive one is named, with the term it fails to show."""
    from launch.scaling.study import _warn_flat

    fit = {"E": 0.46, "A": 1.9, "B": 15.7, "alpha": 0.0073, "beta": 0.16}
    _warn_flat({"fit": fit, "fit_ci95": {"alpha": [-0.057, 0.064], "beta": [0.1, 0.2]}})
    printed = capsys.readouterr().out
    assert "warning: alpha 0.0073 (95% [-0.057, 0.064]): the ladder does not show its loss falling with N," in printed
    _warn_flat({"fit": {**fit, "beta": -0.1}, "fit_ci95": {"alpha": [0.02, 11.3], "beta": None}})
    assert "warning: beta -0.1: the ladder does not show its loss falling with D," in capsys.readouterr().out
    _warn_flat({"fit": fit, "fit_ci95": {"alpha": [0.025, 11.3], "beta": [0.06, 0.49]}})
    assert capsys.readouterr().out == ""
