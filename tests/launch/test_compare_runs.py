"""launch.compare_runs: two real runs' metrics.jsonl step by step; the strict comparison;
bad input refused in one line (tests/bad_input.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from launch.compare_runs import CompareError, compare_records, values_match
from tests.bad_input import expect_refusal, run_cli
from tests.distributed import run_ranks

# Mock data, fp32, an LR where a layout bug would show within 3 steps (as tests/pretrain/test_parity).
BASE = [
    "schedule.train_steps=3", "schedule.micro_batch_size=2", "schedule.global_batch_size=4",
    "schedule.seq_length=32", "schedule.warmup_steps=1", "data.demo=false", "data.mock=true",
    "runtime.spec=portable", "logging.tensorboard=false", "logging.log_interval=1", "optimizer.lr=1e-2",
]


def _train(run_dir: Path, nproc: int = 1, extra: tuple[str, ...] = ()) -> Path:
    run_ranks(nproc, "tests.pretrain.workers:train", recipe="tiny-llama",
              overrides=BASE + list(extra) + [f"logging.run_dir={run_dir}"])
    return run_dir


@pytest.mark.distributed
def test_layout_change_passes_and_a_changed_run_fails(tmp_path):
    """TP2 reproduces TP1 (exit 0); the same run with a 10% higher LR does not (exit 1, the
    summary names the first step past the tolerance: step 2, the first the LR moved)."""
    tp1 = _train(tmp_path / "tp1")
    tp2 = _train(tmp_path / "tp2", 2, ("parallel.tensor_parallel=2",))
    other = _train(tmp_path / "lr", 1, ("optimizer.lr=1.1e-2",))
    same = run_cli("launch.compare_runs", [tp1, tp2, "--rtol", "1e-5"])
    assert same.code == 0, same.output
    assert "all 6 values within rtol 1e-05" in same.output and "past tol" not in same.output
    differ = run_cli("launch.compare_runs", [tp1, other / "metrics.jsonl", "--metrics", "loss,grad_norm,lr"])
    assert differ.code == 1, differ.output
    # Step 1 trains at LR 0 in both (warmup from 0), so step 1's loss and grad norm agree and
    # step 1's update is the same; step 2's LR differs first.
    assert "first at step 2: lr 0.01 vs 0.011" in differ.output, differ.output
    assert "past tol" in differ.output


def _records(steps, **series) -> list[dict]:
    return [{"step": s, **{k: v[i] for k, v in series.items()}} for i, s in enumerate(steps)]


def test_compare_records_tolerance_and_missing_values():
    a = _records([1, 2, 3], loss=[4.0, 3.0, 2.0], grad_norm=[1.0, None, 0.5])
    b = _records([1, 2, 3], loss=[4.0, 3.0 * (1 + 2e-5), 2.0], grad_norm=[1.0, None, 0.5])
    result = compare_records(a, b, rtol=1e-5)
    assert [(step, cell.metric) for step, cell in result.failures] == [(2, "loss")]
    assert compare_records(a, b, rtol=3e-5).ok
    assert compare_records(a, b, rtol=0, atol=1e-4).ok
    assert not values_match(1.0, None, rtol=1, atol=1) and not values_match(float("nan"), 1.0, rtol=1, atol=1)
    assert not values_match(math.inf, 1e308, rtol=1, atol=0) and values_match(None, None, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), math.inf])
def test_non_finite_in_both_runs_is_a_finding_not_agreement(bad, tmp_path):
    """Issue 48: two runs that both diverged (the same NaN or inf at step 2 in both) were
    reported `same: ... all 4 values within rtol`, exit 0. Non-finite values match nothing."""
    assert not values_match(bad, bad, rtol=1, atol=1)
    runs = [_metrics(tmp_path / name, _records([1, 2], loss=[4.0, bad], grad_norm=[1.0, bad])) for name in "ab"]
    result = run_cli("launch.compare_runs", runs)
    assert result.code == 1, result.output
    assert f"non-finite: 2 of 4 values are NaN or infinite (a run diverged); first at step 2: loss {bad:.6g} (A) " \
           f"vs {bad:.6g} (B)" in result.output, result.output
    assert "same" not in result.output.split()
    finite = _metrics(tmp_path / "c", _records([1, 2], loss=[4.0, 3.0], grad_norm=[1.0, 0.5]))  # one run diverged
    result = run_cli("launch.compare_runs", [finite, runs[1]])
    assert result.code == 1 and f"first at step 2: loss 3 (A) vs {bad:.6g} (B)" in result.output, result.output


@pytest.mark.parametrize("a, b, message", [
    ([], _records([1], loss=[1.0]), "run A has no training records"),
    (_records([1], loss=[1.0]), [], "run B has no training records"),
    (_records([1, 2], loss=[1.0, 1.0]), _records([1, 3], loss=[1.0, 1.0]), "different steps"),
    (_records([1], loss=[1.0]), _records([1], loss=[1.0]), "neither run logged gradnorm"),
])
def test_compare_records_is_strict(a, b, message):
    with pytest.raises(CompareError, match=message):
        compare_records(a, b, metrics=["loss", "gradnorm"] if "gradnorm" in message else ["loss"])


def _metrics(path: Path, records: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


CASES = {  # name -> (arguments given the tmp dir, fragments the error line must name)
    "missing run": (lambda t: [t / "nowhere", _metrics(t / "b", _records([1], loss=[1.0]))], ["nowhere"]),
    "empty metrics.jsonl": (lambda t: [_metrics(t / "a", []), _metrics(t / "b", _records([1], loss=[1.0]))],
                            ["metrics.jsonl", "no training records"]),
    "only eval records": (lambda t: [_metrics(t / "a", [{"step": 1, "eval_loss": 2.0}]),
                                     _metrics(t / "b", _records([1], loss=[1.0]))], ["no training records"]),
    "different steps": (lambda t: [_metrics(t / "a", _records([1, 2], loss=[1.0, 1.0])),
                                   _metrics(t / "b", _records([1, 2, 3], loss=[1.0, 1.0, 1.0]))],
                        ["different steps", "1..2", "1..3"]),
    "unknown metric": (lambda t: [_metrics(t / "a", _records([1], loss=[1.0])),
                                  _metrics(t / "b", _records([1], loss=[1.0])), "--metrics", "los"], ["los"]),
    "negative rtol": (lambda t: [t, t, "--rtol", "-1"], ["--rtol"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_in_one_line(case, tmp_path):
    args, names = CASES[case]
    expect_refusal("launch.compare_runs", args(tmp_path), names=names, watch=tmp_path)
