"""launch.slurm without a cluster: the reviewed golden script, validation before anything is
written, the run directory it writes. (Submitting is tested in test_slurm_jobs.py.)

Regenerate the golden after an intended change, then review the diff:
    UPDATE_GOLDEN=1 python -m pytest tests/launch/test_slurm_render.py -k golden
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from launch.launchers.slurm import main, slurm_time_seconds
from pretrain.cli import resolve_config

GOLDEN = Path(__file__).parent / "golden" / "llama3-70b_8x8_dry_run.sh"
LLAMA70B_8X8 = [
    "--recipe", "llama3-70b", "--nodes", "8", "--gpus-per-node", "8", "--partition", "batch",
    "--time", "04:00:00", "--account", "llm-pretrain",
    "--container-image", "nvcr.io#nvidia/pytorch:25.04-py3", "--container-mounts", "/lustre:/lustre",
    "--workdir", "/lustre/code/pretrain", "--run-dir", "/lustre/runs/llama3-70b/golden",
]


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_dry_run_llama3_70b_on_8x8_matches_golden(capsys):
    code, out, err = run(LLAMA70B_8X8 + ["--dry-run"], capsys)
    assert code == 0, err
    if os.environ.get("UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(out)
    assert out == GOLDEN.read_text(), (
        "the rendered script changed; if intended, regenerate with UPDATE_GOLDEN=1 and review the diff")
    again = run(LLAMA70B_8X8 + ["--dry-run"], capsys)[1]
    assert again == out  # nothing time- or machine-dependent in it
    assert not Path("/lustre/runs/llama3-70b/golden").exists()  # a dry run writes nothing


def _cpu(run_dir: Path, *extra: str) -> list[str]:
    return ["--recipe", "tiny-llama", "--cpu", "--ntasks-per-node", "4", "--partition", "debug",
            "--time", "10", "--run-dir", str(run_dir), "parallel.tensor_parallel=2",
            "parallel.pipeline_parallel=2", *extra]


BAD = {
    "layout vs nodes x GPUs": (
        ["--recipe", "llama3-70b", "--nodes", "3", "--gpus-per-node", "8", "--partition", "p", "--time", "60"],
        ["3 node(s) x 8 GPUs = 24 ranks", "not divisible by TP(8) x PP(4)", "--nodes"]),
    "warning signal after the time limit": (
        ["--recipe", "tiny-llama", "--cpu", "--ntasks-per-node", "1", "--partition", "p", "--time", "5"],
        ["--signal-seconds 300 is not shorter than --time 5 (300 s)", "Raise --time"]),
    "malformed time": (
        ["--recipe", "tiny-llama", "--cpu", "--ntasks-per-node", "1", "--partition", "p", "--time", "4h"],
        ["--time '4h' is not a Slurm time limit", "HH:MM:SS"]),
    "missing data": (
        ["--recipe", "tiny-llama", "--cpu", "--ntasks-per-node", "1", "--partition", "p", "--time", "60",
         "data.demo=false", "data.blend=[[1.0, /nonexistent/web]]", "data.tokenizer=/nonexistent/tok.model"],
        ["/nonexistent/web.bin does not exist", "/nonexistent/web.idx", "/nonexistent/tok.model",
         "--no-path-check"]),
    "run dir outside the container mounts": (
        ["--recipe", "tiny-llama", "--cpu", "--ntasks-per-node", "1", "--partition", "p", "--time", "60",
         "--container-image", "img", "--container-mounts", "/data:/data", "--workdir", "/code"],
        ["is not inside any --container-mounts source", "add --container-mounts"]),
    "cpu without a rank count": (
        ["--recipe", "tiny-llama", "--cpu", "--partition", "p", "--time", "60"],
        ["--cpu needs --ntasks-per-node N"]),
    "bad --env": (
        ["--recipe", "tiny-llama", "--cpu", "--ntasks-per-node", "1", "--partition", "p", "--time", "60",
         "--env", "1BAD=x"],
        ["--env '1BAD=x' is not KEY=VALUE"]),
    "run dir as an override": (
        ["--recipe", "tiny-llama", "--cpu", "--ntasks-per-node", "1", "--partition", "p", "--time", "60",
         "logging.run_dir=/x"],
        ["set the run directory with --run-dir"]),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_invalid_jobs_fail_with_the_value_and_fix_and_write_nothing(case, tmp_path, capsys):
    argv, expected = BAD[case]
    run_dir = tmp_path / "run"
    code, out, err = run(argv + ["--run-dir", str(run_dir)], capsys)
    assert code == 2
    for fragment in expected:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    assert "nothing was written or submitted" in err
    assert not run_dir.exists()


def test_every_problem_is_reported_at_once(tmp_path, capsys):
    argv = ["--recipe", "llama3-70b", "--nodes", "3", "--partition", "p", "--time", "5",
            "--run-dir", str(tmp_path / "run")]
    code, _, err = run(argv, capsys)
    assert code == 2
    assert "24 ranks" in err and "--signal-seconds 300" in err


def test_unwritable_or_reused_run_dir_is_refused(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code, _, err = run(_cpu(blocker / "run"), capsys)  # even root cannot mkdir under a file
    assert code == 2 and "is not writable" in err and "--run-dir" in err
    run_dir = tmp_path / "run"
    assert run(_cpu(run_dir), capsys)[0] == 0
    code, _, err = run(_cpu(run_dir), capsys)
    assert code == 2 and "already holds a job.sh" in err and "sbatch" in err


def test_tp_across_nodes_is_a_warning(capsys):
    argv = ["--recipe", "llama3-70b", "--nodes", "16", "--gpus-per-node", "4", "--partition", "p",
            "--time", "60", "--run-dir", "/nonexistent/run", "--dry-run"]
    code, out, err = run(argv, capsys)
    assert code == 0
    assert "warning: TP=8 exceeds the 4 GPUs of a node" in err
    assert "#SBATCH --nodes=16" in out


def test_existing_data_passes_and_written_config_is_what_the_training_reads(tmp_path, capsys):
    prefix = tmp_path / "data" / "web"
    prefix.parent.mkdir()
    for ext in (".bin", ".idx"):
        prefix.with_suffix(ext).write_bytes(b"")
    run_dir = tmp_path / "run"
    overrides = ["data.demo=false", f"data.blend=[[1.0, {prefix}]]", "data.tokenizer=byte"]
    code, out, err = run(_cpu(run_dir, *overrides), capsys)
    assert code == 0, err
    assert f"submit with: sbatch {run_dir}/job.sh" in out
    assert os.access(run_dir / "job.sh", os.X_OK) and (run_dir / "logs").is_dir()
    written = resolve_config("tiny-llama", str(run_dir / "config.yaml"), [])
    expected = resolve_config("tiny-llama", None, ["parallel.tensor_parallel=2",
                                                   "parallel.pipeline_parallel=2", *overrides])
    assert written.logging.run_dir == str(run_dir)
    assert written.checkpoint.dir == f"{run_dir}/checkpoints"  # a requeued job finds its checkpoints
    assert written.model_copy(update={"logging": expected.logging, "checkpoint": expected.checkpoint}) == expected


@pytest.mark.parametrize("extra", [[], ["--launcher", "torchrun"], ["--no-requeue", "--logs", "rank"]])
@pytest.mark.parametrize("base", ["gpu-container", "cpu"])
def test_rendered_scripts_are_valid_bash(base, extra, tmp_path, capsys):
    argv = LLAMA70B_8X8 if base == "gpu-container" else _cpu(tmp_path / "r")
    code, out, err = run(argv + ["--dry-run", *extra], capsys)
    assert code == 0, err
    script = tmp_path / "job.sh"
    script.write_text(out)
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("text, seconds", [
    ("10", 600), ("30:15", 1815), ("04:00:00", 14400), ("2-00", 172800), ("1-02:03", 93780),
    ("1-00:00:05", 86405), ("UNLIMITED", None)])
def test_slurm_time_formats(text, seconds):
    assert slurm_time_seconds(text) == seconds


def _rendezvous_block(script: str) -> str:
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("MASTER_ADDR="))
    end = next(i for i, line in enumerate(lines) if line == "export MASTER_PORT")
    return "\n".join(lines[start:end + 1])


@pytest.mark.parametrize("python_on_host", [True, False])
def test_rendezvous_port_is_free_on_the_batch_host(python_on_host, tmp_path, capsys):
    """Two jobs sharing a node must not get one port: the script picks a free port on the
    batch host (where rank 0 runs) below the kernel's ephemeral range (launch/ports.py);
    without python there, the job id's port."""
    import socket

    code, out, err = run(LLAMA70B_8X8 + ["--dry-run"], capsys)
    assert code == 0, err
    assert "20000 + SLURM_JOB_ID" not in _rendezvous_block(out).split("if ! MASTER_PORT")[0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node1\n")
    (bin_dir / "scontrol").chmod(0o755)
    if not python_on_host:  # the image has python; the host, in this case, has none
        (bin_dir / "python3").write_text("#!/bin/sh\necho 'python3: command not found' >&2\nexit 127\n")
        (bin_dir / "python3").chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}"
    probe = _rendezvous_block(out) + '\necho "$MASTER_ADDR $MASTER_PORT"'
    ports = set()
    for _ in range(2):
        result = subprocess.run(["/bin/bash", "-c", probe], capture_output=True, text=True,
                                env={"PATH": path, "SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "node1"})
        assert result.returncode == 0, result.stderr
        addr, port = result.stdout.split()[-2:]
        assert addr == "node1"
        ports.add(int(port))
    if python_on_host:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
        for port in ports:
            assert 10000 <= port < low  # below the range outgoing connections take theirs from
            with socket.socket() as s:
                s.bind(("", port))  # it was free (and still is)
    else:
        assert ports == {20000 + 1234} and "could not pick a free port" in result.stdout
