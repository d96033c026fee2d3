"""launch.local: the printed command is the one that runs, and a stop signal sent to the
launcher reaches the ranks, which save and exit 0 (nothing is left running)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import psutil
import pytest

from launch.launchers.local import main
from tests.distributed import REPO, run_module

BASE = ["data.demo=false", "data.mock=true", "runtime.spec=portable", "logging.tensorboard=false",
        "checkpoint.resume=none", "schedule.micro_batch_size=2", "schedule.global_batch_size=4",
        "schedule.seq_length=64", "schedule.eval_interval=0", "logging.log_interval=1"]


def test_dry_run_prints_a_command_the_shell_reads_back_verbatim(tmp_path, capsys):
    hostile = f"name=x; touch {tmp_path}/pwned $(id) `id`"
    assert main(["--recipe", "tiny-llama", "--dry-run", *BASE, hostile]) == 0
    printed = capsys.readouterr().out.strip()
    argv = shlex.split(printed)
    assert argv[-1] == hostile and argv[0] == sys.executable
    subprocess.run(["bash", "-c", f"set -- {printed}; echo \"$#\""], check=True, capture_output=True)
    assert not (tmp_path / "pwned").exists()


def _metrics(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if '"loss"' in line]


@pytest.mark.distributed
def test_last_line_names_the_run_and_checkpoint_and_its_next_command_works(tmp_path):
    """The closing line (what `bash dev.sh demo` ends with): printed by rank 0, which at PP2 is
    not the rank that logs the loss, after every rank is done; the command it suggests runs."""
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    result = run_module("launch.local", [
        "--recipe", "tiny-llama", "--nproc", "2", "parallel.pipeline_parallel=2", "model.num_attention_heads=4",
        "schedule.train_steps=2", "schedule.eval_interval=0", "logging.tensorboard=false",
        f"logging.run_dir={run_dir}", f"checkpoint.dir={ckpt}", "checkpoint.resume=none"])
    assert result.returncode == 0, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    loss = _metrics(run_dir)[-1]["loss"]
    assert last == (f"[tiny-llama] done: 2 steps, final loss {loss:.4f}; run {run_dir} (metrics.jsonl), "
                    f"checkpoint {ckpt / 'step_00000002'}; next: python -m checkpoints_tools.export_hf "
                    f"{ckpt} {run_dir / 'hf'}"), result.stdout
    assert (ckpt / "step_00000002" / "COMPLETE").is_file()
    suggested = shlex.split(last.split("; next: ", 1)[1])
    assert suggested[:3] == ["python", "-m", "checkpoints_tools.export_hf"]
    from checkpoints_tools.export_hf import main as export_hf

    assert export_hf(suggested[3:]) == 0
    assert json.loads((run_dir / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def _launch(run_dir, ckpt, layout: list[str], steps: int, resume: str = "none") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    overrides = [o for o in BASE if not o.startswith("checkpoint.resume")]
    return subprocess.Popen(
        [sys.executable, "-m", "launch.local", "--recipe", "tiny-llama", "--nproc", "2", *layout, *overrides,
         f"schedule.train_steps={steps}", f"logging.run_dir={run_dir}", f"checkpoint.dir={ckpt}",
         f"checkpoint.resume={resume}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", [["parallel.pipeline_parallel=2"], ["parallel.sharding=zero3"]],
                         ids=["PP2", "DP2-ZeRO3"])
def test_sigterm_to_the_launcher_stops_every_rank_with_a_checkpoint(tmp_path, layout):
    """ZeRO-3 too: the preemption save goes through Megatron-FSDP's state (gathered weights,
    resharded optimizer state) and the run resumes from it."""
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    proc = _launch(run_dir, ckpt, layout, 100000)
    deadline = time.monotonic() + 300
    while len(_metrics(run_dir)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "timeout"
        time.sleep(0.1)
    ranks = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, out
    stopped = len(_metrics(run_dir))
    assert "stopping after step" in out and "Traceback" not in out
    latest = (ckpt / "latest").read_text().strip()
    assert latest == f"step_{stopped:08d}" and (ckpt / latest / "COMPLETE").is_file()
    gone, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, f"left running: {[p.pid for p in alive]}"
    if "parallel.sharding=zero3" in layout:
        resumed = _launch(tmp_path / "resumed", ckpt, layout, stopped + 1, resume="auto")
        out = resumed.communicate(timeout=300)[0]
        assert resumed.returncode == 0, out
        assert [m["step"] for m in _metrics(tmp_path / "resumed")] == [stopped + 1], out
