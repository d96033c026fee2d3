"""Bad input to the launchers, the planner and sweeps (tests/bad_input.py): exit 2, one
`error:` line naming the problem, nothing started, written or overwritten."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bad_input import expect_refusal

SLURM = ["--recipe", "tiny-llama", "--cpu", "--ntasks-per-node", "1", "--partition", "debug", "--time", "60"]
PLAN = ["--recipe", "llama3-8b", "--gpus", "8"]


def _used_run_dir(tmp_path: Path) -> Path:
    """A run folder a local run already used: its config.yaml must survive."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("name: the-run-that-was\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


CASES = {  # name -> (module, arguments given the case's tmp dir, fragments the error must name)
    "local: --nproc 0": ("launch.local", lambda t: ["--recipe", "tiny-llama", "--nproc", "0"], ["--nproc"]),
    "local: --nproc -2": ("launch.local", lambda t: ["--recipe", "tiny-llama", "--nproc", "-2"], ["--nproc"]),
    "local: optimizer.lr=inf": ("launch.local", lambda t: ["--recipe", "tiny-llama", "optimizer.lr=inf"],
                                ["optimizer.lr"]),
    "local: malformed YAML": ("launch.local", lambda t: ["--recipe", "tiny-llama", "--config",
                                                        _write(t / "b.yaml", "a: [1\n")], ["b.yaml", "YAML"]),
    "local: blend prefix missing": ("launch.local", lambda t: [
        "--recipe", "tiny-llama", "data.demo=false", f"data.blend=[[1.0, {t}/none]]", "data.tokenizer=byte"],
        ["data.blend", "none"]),
    "local: checkpoint.dir not creatable": ("launch.local", lambda t: [
        "--recipe", "tiny-llama", "checkpoint.dir=/sys/ckpt", "--dry-run"], ["checkpoint.dir"]),
    "local: layout does not fit --nproc": ("launch.local", lambda t: [
        "--recipe", "tiny-llama", "--nproc", "3", "parallel.tensor_parallel=2"], ["world size 3"]),
    "slurm: --nodes 0": ("launch.slurm", lambda t: [*SLURM, "--nodes", "0", "--run-dir", t / "r"], ["--nodes"]),
    "slurm: --ntasks-per-node 0": ("launch.slurm", lambda t: [
        "--recipe", "tiny-llama", "--cpu", "--ntasks-per-node", "0", "--partition", "p", "--time", "60",
        "--run-dir", t / "r"], ["--ntasks-per-node"]),
    "slurm: --run-dir used by a run": ("launch.slurm", lambda t: [*SLURM, "--run-dir", _used_run_dir(t)],
                                       ["run", "config.yaml"]),
    "slurm: --run-dir under a file": ("launch.slurm", lambda t: [*SLURM, "--run-dir", _write(t / "f", "x") / "r"],
                                      ["run directory"]),
    "slurm: malformed time": ("launch.slurm", lambda t: [
        "--recipe", "tiny-llama", "--cpu", "--ntasks-per-node", "1", "--partition", "p", "--time", "4h",
        "--run-dir", t / "r"], ["--time"]),
    "slurm: optimizer.lr=nan": ("launch.slurm", lambda t: [*SLURM, "--run-dir", t / "r", "optimizer.lr=nan"],
                                ["optimizer.lr"]),
    "slurm: --gpus-per-node 0": ("launch.slurm", lambda t: [
        "--recipe", "tiny-llama", "--gpus-per-node", "0", "--partition", "p", "--time", "60", "--run-dir", t / "r"],
        ["--gpus-per-node"]),
    "plan: --gpus 0": ("launch.plan", lambda t: ["--recipe", "llama3-8b", "--gpus", "0"], ["--gpus"]),
    "plan: --seq 0": ("launch.plan", lambda t: [*PLAN, "--seq", "0"], ["seq"]),
    "plan: --global-batch 0": ("launch.plan", lambda t: [*PLAN, "--global-batch", "0"], ["global-batch"]),
    "plan: --efficiency 0": ("launch.plan", lambda t: [*PLAN, "--efficiency", "0"], ["--efficiency"]),
    "plan: --efficiency 5": ("launch.plan", lambda t: [*PLAN, "--efficiency", "5"], ["--efficiency"]),
    "plan: --overlap tp=2": ("launch.plan", lambda t: [*PLAN, "--overlap", "tp=2"], ["--overlap"]),
    "plan: --overlap tp=x": ("launch.plan", lambda t: [*PLAN, "--overlap", "tp=x"], ["--overlap"]),
    "plan: --micro-batch 0": ("launch.plan", lambda t: [*PLAN, "--micro-batch", "0"], ["--micro-batch"]),
    "plan: --tp 0": ("launch.plan", lambda t: [*PLAN, "--tp", "0"], ["--tp"]),
    "plan: --framework-gib -1": ("launch.plan", lambda t: [*PLAN, "--framework-gib", "-1"], ["--framework-gib"]),
    "plan: unknown GPU": ("launch.plan", lambda t: [*PLAN, "--gpu", "h900"], ["h900"]),
    "plan: --write-override under a file": ("launch.plan", lambda t: [
        *PLAN, "--write-override", _write(t / "f", "x") / "best.yaml"], ["--write-override"]),
    "plan: malformed YAML": ("launch.plan", lambda t: [*PLAN, "--config", _write(t / "b.yaml", "a: [1\n")],
                             ["b.yaml", "YAML"]),
    "sweep: spec missing": ("launch.sweep", lambda t: [t / "none.yaml"], ["none.yaml"]),
    "sweep: spec not YAML": ("launch.sweep", lambda t: [_write(t / "s.yaml", "grid: [1\n")], ["s.yaml", "YAML"]),
    "sweep: unknown key": ("launch.sweep", lambda t: [_write(t / "s.yaml", "name: x\nrecipe: tiny-llama\ngrdi: {}\n")],
                           ["grdi", "grid"]),
    "benchmark: --nproc 0": ("launch.benchmark", lambda t: ["--recipe", "tiny-llama", "--nproc", "0"], ["--nproc"]),
    "benchmark: --repeats 0": ("launch.benchmark", lambda t: ["--recipe", "tiny-llama", "--repeats", "0"],
                               ["--repeats"]),
    "comm_replay: TP2": ("launch.comm_replay", lambda t: ["--recipe", "tiny-llama", "--nproc", "2",
                                                          "parallel.tensor_parallel=2"],
                         ["parallel.tensor_parallel=2", "data-parallel"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused(case, tmp_path):
    module, build, names = CASES[case]
    expect_refusal(module, build(tmp_path), names=names, cwd=tmp_path)
