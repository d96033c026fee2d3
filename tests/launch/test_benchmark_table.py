"""launch.benchmark_table on CPU: the table machinery with tiny-llama (cells run, skipped cells
noted, window medians, results resumed from the JSON lines file)."""

from __future__ import annotations

import json
import statistics

import pytest

from launch.benchmark_table import expand_precisions, failure_note, precision_overrides, summarise_windows
from tests.distributed import run_module


def test_precisions_expand_to_the_recipes_the_gpu_runs():
    assert expand_precisions(["bf16", "fp8"], ["delayed", "tensorwise", "blockwise"]) == [
        "bf16", "fp8-delayed", "fp8-tensorwise", "fp8-blockwise"]
    assert expand_precisions(["fp8", "fp8-delayed"], ["delayed"]) == ["fp8-delayed"]
    assert expand_precisions(["bf16", "fp8"], []) == ["bf16"]  # CPU: no FP8 row to run
    assert precision_overrides("fp8-mxfp8") == ["runtime.dtype=bf16", "runtime.fp8=e4m3", "runtime.fp8_recipe=mxfp8"]
    assert precision_overrides("fp8-tensorwise")[1] == "runtime.fp8=hybrid"
    with pytest.raises(ValueError, match="unknown precision 'int8'"):
        precision_overrides("int8")


def test_window_medians():
    times = [9.0, 9.0] + [1.0, 2.0, 30.0] + [4.0, 5.0, 6.0] + [7.0, 8.0, 0.5]
    records = [dict(step_time_s=t, tokens_per_s=100 / t, tflops_per_device=10 / t, overhead_frac=0.01,
                    peak_mem_gb=float(i), loss=1.0 / (i + 1)) for i, t in enumerate(times)]
    out = summarise_windows(records, warmup=2, steps=3, windows=3)
    assert out["step_time_windows_s"] == [2.0, 5.0, 7.0]
    assert out["step_time_s"] == 5.0
    assert out["tokens_per_s"] == statistics.median([100 / 2.0, 100 / 5.0, 100 / 7.0])
    assert out["peak_mem_gb"] == 10.0 and out["final_loss"] == 1.0 / 11


def test_failed_cells_are_told_apart():
    oom = ("RuntimeError: ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
           "total capacity of 79.19 GiB")
    assert failure_note(oom) == ("oom", "out of memory")
    assert failure_note("exit 2:\nerror: TP=4 does not divide num_query_groups=2\n") == (
        "failed", "error: TP=4 does not divide num_query_groups=2")


@pytest.mark.slow
def test_table_runs_tiny_cells_and_resumes(tmp_path):
    out = tmp_path / "table.jsonl"
    cmd = ["--recipe", "tiny-llama", "--layers", "2",
           "--seq", "32", "--precision", "fp32", "fp8", "fp8-mxfp8", "--micro-batch", "1", "2",
           "--global-batch", "2", "--warmup", "1", "--steps", "1", "--windows", "3", "--out", str(out)]
    proc = run_module("launch.benchmark_table", cmd, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["cell"]["precision"], r["cell"]["micro_batch"], r["status"]) for r in results] == [
        ("fp32", 1, "ok"), ("fp32", 2, "ok"), ("fp8-mxfp8", 1, "skipped"), ("fp8-mxfp8", 2, "skipped")]
    for r in results[:2]:
        assert len(r["step_time_windows_s"]) == 3
        assert r["step_time_s"] == statistics.median(r["step_time_windows_s"]) > 0
        # tokens/s from the same formula as the training metrics: tokens per step / step time.
        assert r["tokens_per_s"] == pytest.approx(2 * 32 / r["step_time_s"], rel=0.5)
        assert r["mfu_bf16"] is None and r["peak_mem_gb"] > 0
    assert results[2]["note"].startswith("MXFP8 needs an NVIDIA GPU of compute capability 10.0")
    table = (tmp_path / "table.jsonl.md").read_text()
    assert "| 2 | 32 | fp32 | baseline | 1 |" in table and "SKIPPED: MXFP8 needs" in table
    # Again: every cell is already in the file, nothing runs, the table is the same.
    again = run_module("launch.benchmark_table", cmd, timeout=120)
    assert again.returncode == 0 and len(out.read_text().splitlines()) == 4
    assert (tmp_path / "table.jsonl.md").read_text() == table
    rendered = run_module("launch.benchmark_table", ["--render", str(out)], timeout=120)
    assert rendered.returncode == 0 and rendered.stdout.strip() == table.split("\n\n", 1)[1].strip()
