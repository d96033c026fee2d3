"""launch.step_profile on CPU: the profiled window, busy time and idle share."""

from __future__ import annotations

import json

import pytest

from launch.step_profile import union_us
from tests.distributed import run_module


def test_union_of_intervals():
    assert union_us([]) == 0.0
    assert union_us([(0, 10), (2, 5), (8, 12), (20, 21)]) == 13.0  # nested, overlapping, apart
    assert union_us([(5, 6), (0, 1)]) == 2.0


@pytest.mark.slow
def test_profile_tiny_llama_on_cpu(tmp_path):
    trace = tmp_path / "trace.json"
    proc = run_module(
        "launch.step_profile", ["--recipe", "tiny-llama", "--warmup", "1", "--steps", "3",
         "--trace", str(trace), "data.demo=false", "data.mock=true", "schedule.seq_length=32",
         "schedule.micro_batch_size=2", "schedule.global_batch_size=4", "runtime.spec=portable",
         f"logging.run_dir={tmp_path}"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["steps"] == 3 and len(result["step_time_s"]) == 3
    assert 0 < result["busy_s"] < result["wall_s"]
    assert result["idle_frac"] == pytest.approx(1 - result["busy_s"] / result["wall_s"])
    # The window holds the three steps and little else.
    assert sum(result["step_time_s"]) <= result["wall_s"]
    assert any(name == "aten::mm" for name, _ in result["top_ops_ms"])
    assert json.loads(trace.read_text())["traceEvents"]
