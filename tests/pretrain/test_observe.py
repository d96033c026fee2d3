"""Seeing inside a run: profiler traces, MLflow and W&B records, the straggler report, and
the start-up errors of their bad input.

One 2-rank training (DP2, 4 steps) with everything on, then a resume of it to step 6, is
shared by the tests below (`observed`); each test reads a different part of what it wrote.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.observe.stragglers import StragglerStats, slowest
from pretrain.recipes import get_recipe
from tests.distributed import REPO, run_ranks

BASE = [
    "schedule.micro_batch_size=1", "schedule.global_batch_size=4", "schedule.seq_length=32",
    "schedule.eval_interval=0", "data.demo=false", "data.mock=true", "runtime.spec=portable",
    "logging.tensorboard=false", "logging.log_interval=1",
]
# Rank 1's extra forward time per micro-batch: large against the CPU time the logging rank's
# tracker threads (MLflow's queue, W&B's service) take from rank 0 on a 2-core machine.
SLOW_MS = 400


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def observed(module_tmp_factory):
    root = module_tmp_factory.mktemp("observed")
    common = BASE + [
        f"tracking.mlflow_tracking_uri=sqlite:///{root}/mlflow.db", "tracking.mlflow=true",
        "tracking.wandb=true", "tracking.wandb_mode=offline", "tracking.project=observe-test",
        f"checkpoint.dir={root / 'ckpt'}", "checkpoint.save_interval=2",
        "logging.straggler_interval=2", "runtime.inject_slow_rank=1", f"runtime.inject_slow_ms={SLOW_MS}",
    ]
    first = run_ranks(2, "tests.pretrain.workers:train", recipe="tiny-llama", overrides=common + [
        "schedule.train_steps=4", f"logging.run_dir={root / 'first'}", "checkpoint.resume=none",
        "profile.start_step=2", "profile.num_steps=2", "profile.ranks=all"])
    resumed = run_ranks(2, "tests.pretrain.workers:train", recipe="tiny-llama", overrides=common + [
        "schedule.train_steps=6", f"logging.run_dir={root / 'resumed'}", "checkpoint.resume=auto"])
    return root, first, resumed


@pytest.mark.distributed
@pytest.mark.slow
def test_profiler_writes_each_ranks_trace_with_forward_backward_optimizer(observed):
    root, _, _ = observed
    for rank in (0, 1):
        folder = root / "first" / "profile" / f"rank_{rank}"
        with gzip.open(folder / "trace.json.gz", "rt") as f:
            events = json.load(f)["traceEvents"]
        ranges = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
        names = [e["name"] for e in ranges]
        # 2 profiled steps x 2 micro-batches per rank (global batch 4 / (micro 1 x DP 2))
        assert names.count("optimizer") == 2, sorted(set(names))
        assert names.count("forward") == names.count("backward") == 2 * 2, sorted(set(names))
        assert "all-grads-sync" in names  # Megatron-Core's own timer names show up too
        steps = sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
        assert len(steps) == 2, steps  # the warm-up step (1) is not in the trace
        table = (folder / "top_ops.txt").read_text()
        assert "Self CPU" in table and "aten::mm" in table
    assert not (root / "resumed" / "profile").exists()  # its window (steps 2-3) was before the resume


@pytest.mark.distributed
@pytest.mark.slow
def test_mlflow_records_equal_metrics_jsonl_and_resume_continues_the_run(observed):
    from mlflow import MlflowClient

    root, _, _ = observed
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    experiment = client.get_experiment_by_name("observe-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]  # the resume continued it
    run = runs[0]
    for name in ("first", "resumed"):
        meta = json.loads((root / "ckpt" / f"step_0000000{4 if name == 'first' else 6}" / "meta.json").read_text())
        assert meta["tracker_runs"]["mlflow"] == run.info.run_id
    expected: dict[str, dict[int, float]] = {}
    for record in _records(root / "first") + _records(root / "resumed"):
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and value is not None:
                expected.setdefault(key, {})[record["step"]] = float(value)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "peak_mem_gb",
            "skipped_steps", "straggler_ratio"} <= set(expected)
    for key, by_step in expected.items():
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert got == by_step, key
    assert set(run.data.metrics) == set(expected)  # nothing more, nothing less
    assert run.info.status == "FINISHED"
    lr = get_recipe("tiny-llama").optimizer.lr
    assert run.data.params["optimizer.lr"] == json.dumps(lr) and run.data.params["schedule.train_steps"] == "4"
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert run.data.tags["git_commit"].removesuffix("-dirty") == head


def test_mlflow_records_wait_in_a_buffer_then_go_in_one_batch(tmp_path):
    """Records reach MLflow in one log_batch per MLFLOW_FLUSH_S (a batch costs the same CPU
    whatever its size), and close() hands over what is still buffered."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from pretrain.cli import resolve_config
    from pretrain.observe import trackers as tr

    uri = f"sqlite:///{tmp_path}/m.db"
    config = resolve_config("tiny-llama", None, [f"logging.run_dir={tmp_path}", "tracking.mlflow=true",
                                                 f"tracking.mlflow_tracking_uri={uri}"])
    tracker = tr.MlflowTracker(config, None, "abc", lambda m: None)
    client = MlflowClient(tracking_uri=uri)
    for step in (1, 2, 3):
        tracker.log({"loss": float(step)}, step)
    assert client.get_metric_history(tracker.run_id, "loss") == []  # still buffered
    tracker._flushed_at -= tr.MLFLOW_FLUSH_S  # the interval has passed
    tracker.log({"loss": 4.0}, 4)
    assert not tracker._buffer and len(tracker._pending) == 1
    tracker._pending[0].wait()
    assert [m.step for m in client.get_metric_history(tracker.run_id, "loss")] == [1, 2, 3, 4]
    tracker.log({"loss": 5.0}, 5)
    tracker.close(failed=False)
    history = client.get_metric_history(tracker.run_id, "loss")
    assert {m.step: m.value for m in history} == {s: float(s) for s in range(1, 6)}
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


def _wandb_records(path: str):
    """The protobuf records of a W&B transaction log (.wandb: a 7-byte header, then a
    LevelDB-style log of 32 KiB blocks, each record chunk with a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):  # full / first
            pending = chunk
        elif kind in (3, 4):  # middle / last
            pending += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


@pytest.mark.distributed
@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics_config_and_resumes_the_same_id(observed):
    root, _, _ = observed
    meta = json.loads((root / "ckpt" / "step_00000004" / "meta.json").read_text())
    run_id = meta["tracker_runs"]["wandb"]
    first = glob.glob(str(root / "first" / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    resumed = glob.glob(str(root / "resumed" / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    assert len(first) == 1 and len(resumed) == 1, (first, resumed)
    history, config = {}, {}
    for record in _wandb_records(first[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or ".".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            history[items["_step"]] = items
        elif kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
    records = _records(root / "first")
    assert sorted(history) == [r["step"] for r in records]
    for r in records:
        for key, value in r.items():
            if key != "step" and isinstance(value, (int, float)) and value is not None:
                assert history[r["step"]][key] == pytest.approx(float(value), rel=1e-12, abs=0), key
    assert config["optimizer"]["lr"] == get_recipe("tiny-llama").optimizer.lr and len(config["git_commit"]) >= 40


@pytest.mark.distributed
@pytest.mark.slow
def test_straggler_report_names_the_slow_rank_every_interval(observed):
    root, _, _ = observed
    records = _records(root / "first") + _records(root / "resumed")
    reports = {r["step"]: r for r in records if r.get("straggler_ratio") is not None}
    assert sorted(reports) == [2, 4, 6]
    for step, r in reports.items():
        assert r["straggler_slowest_rank"] == 1, r
        # Rank 1 sleeps SLOW_MS in each of its 2 forwards per step; the median of 2 ranks is
        # their mean, so rank 1 is above it by half its extra time: SLOW_MS if compute were
        # equal (CPU contention on a shared machine blurs it; half of that is required).
        assert r["straggler_slowest_s"] - r["straggler_median_s"] >= 0.5 * SLOW_MS / 1000, r
        assert r["straggler_ratio"] > 1.2, r


def test_straggler_comparison_is_per_pipeline_stage():
    # Ranks 0, 1 are stage 0; 2, 3 stage 1 (slower by design). Rank 1 is the straggler.
    rank, t, median = slowest([1.0, 1.6, 3.0, 3.1], [0, 0, 1, 1])
    assert (rank, t, median) == (1, 1.6, 1.3)
    stats = StragglerStats(1, 100, rank, t, median, t / median, [1.0, 1.6, 3.0, 3.1])
    assert stats.warning(1.2).startswith("warning: straggler: rank 1 computes 1600.0 ms/step, x1.23")
    assert stats.warning(1.3) is None


def _pretrain_without(module: str, overrides: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """`python -m pretrain` in a process where `module` cannot be imported (as if not installed)."""
    code = (f"import sys; sys.modules[{module!r}] = None; from pretrain.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code, "--recipe", "tiny-llama", *BASE, *overrides,
                           f"logging.run_dir={tmp_path / 'run'}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("extra", ["mlflow", "wandb"])
def test_missing_tracker_extra_is_a_startup_error_naming_the_pip_extra(tmp_path, extra):
    result = _pretrain_without(extra, [f"tracking.{extra}=true"], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"pip install 'mcore-stack[{extra}]'" in result.stdout + result.stderr
    assert not (tmp_path / "run").exists()  # before any process group, run dir or step


def test_unwritable_profile_dir_is_an_error_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = _pretrain_without("nothing-missing", ["profile.start_step=1", f"profile.dir={blocker}/profile"], tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"profile directory {blocker}/profile/rank_0 is not writable" in result.stdout + result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, message", [
    ("profile.start_stpe=3", "did you mean 'start_step'"),
    ("tracking.mlfow=true", "did you mean 'mlflow'"),
    ("watchdog.timeout=5", "did you mean 'timeout_s'"),
    ("profile.ranks=some", "profile.ranks"),
    ("watchdog.step_time_factor=1", "greater than 1"),
])
def test_new_config_keys_are_strict(override, message):
    from pretrain.cli import resolve_config
    from pretrain.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        resolve_config("tiny-llama", None, [override])


def test_profile_ranks_outside_the_world_fail_before_any_process_group():
    from pretrain.cli import resolve_config
    from pretrain.config import ConfigError, validate_for_world

    config = resolve_config("tiny-llama", None, ["profile.start_step=2", "profile.ranks=[0, 3]"])
    validate_for_world(config, 4)
    with pytest.raises(ConfigError, match=r"profile.ranks=\[0, 3\] names ranks outside the world of 2"):
        validate_for_world(config, 2)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA: the memory snapshot and CUDA kernel events exist only there")
def test_cuda_profile_has_kernels_and_memory_snapshot(tmp_path):
    import pickle

    run_ranks(1, "tests.pretrain.workers:train", recipe="tiny-llama", overrides=[
        "schedule.micro_batch_size=1", "schedule.global_batch_size=2", "schedule.seq_length=64",
        "schedule.eval_interval=0", "data.demo=false", "data.mock=true", "logging.tensorboard=false",
        "schedule.train_steps=4", "profile.start_step=2", "profile.memory_snapshot_step=3",
        f"logging.run_dir={tmp_path}"])
    folder = tmp_path / "profile" / "rank_0"
    with gzip.open(folder / "trace.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)  # CUDA activity was recorded
    assert {"forward", "backward", "optimizer"} <= {e.get("name") for e in events}
    snapshot = pickle.loads((folder / "memory_snapshot.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"]
