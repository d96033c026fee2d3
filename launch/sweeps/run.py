"""Sweeps for scaling experiments: run a grid of recipe variants, collect every run's
metrics into one table, plot loss, throughput and the loss-vs-compute power law.

    python -m launch.sweep launch/examples/tiny_sweep.yaml          # run (or resume) and collect
    python -m launch.sweep SPEC.yaml --dry-run                      # list points and commands
    python -m launch.sweep SPEC.yaml --collect-only                 # tables + plots from what ran

Spec format: see launch/sweep_spec.py (axes of choices; their cartesian product is the
grid). `launcher: local` runs the points one after another through `python -m
launch.local`; `launcher: slurm` writes each point's job with `python -m launch.slurm`
and submits the points as Slurm job arrays (one array per allocation shape), then
collects what has finished (run again with --collect-only once the jobs end).
WSD token budgets run as stable runs and cooldown branches (launch/sweeps/branches.py): the
local launcher runs a branch after its stable run, Slurm arrays of branches depend on theirs.
Re-running skips finished points (their metrics.jsonl reached train_steps); a point whose
definition changed gets a fresh directory (the old one is kept, renamed).

Outputs in out_dir: points/<name>/ (each run's directory: metrics.jsonl, logs),
results.csv, results.md, fit.json, plots/{loss_vs_tokens,throughput_vs_gpus,loss_vs_compute}.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from data_pipeline.checks import BAD_INPUT, print_error
from launch.sweeps.results import collect, is_finished
from launch.sweeps.branches import compute_summary
from launch.sweeps.spec import Point, SweepSpec, SweepSpecError, expand_with_branches, load_spec

REPO = Path(__file__).resolve().parents[2]
MARKER = "sweep_point.json"  # what a point directory was created for


def _definition(point: Point) -> dict:
    return {"gpus": point.gpus, "overrides": list(point.overrides)}


def prepare_dir(point: Point) -> str:
    """'finished', 'running' (a Slurm task still queued or running) or 'todo'; a directory
    left by a different definition of this point is renamed aside, not reused."""
    marker = point.run_dir / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("definition") != _definition(point):
        n = 1
        while point.run_dir.with_name(f"{point.run_dir.name}.replaced-{n}").exists():
            n += 1
        aside = point.run_dir.with_name(f"{point.run_dir.name}.replaced-{n}")
        point.run_dir.rename(aside)
        print(f"[sweep] {point.name}: definition changed; previous run kept in {aside}")
    if is_finished(point):
        return "finished"
    if _slurm_task_alive(point):
        return "running"
    point.run_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"definition": _definition(point)}, indent=1) + "\n")
    return "todo"


def _env() -> dict:
    env = dict(os.environ)
    # The CLIs import our packages; make them importable from any working directory.
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def _local_command(spec: SweepSpec, point: Point, config_file: Optional[str]) -> list[str]:
    cmd = [sys.executable, "-m", "launch.local", "--recipe", spec.recipe, "--nproc", str(point.gpus)]
    if config_file:
        cmd += ["--config", config_file]
    return cmd + list(point.overrides)


def run_local(spec: SweepSpec, point: Point, config_file: Optional[str]) -> int:
    """One point through launch.local; its output goes to <run_dir>/launch.log."""
    cmd = _local_command(spec, point, config_file)
    with (point.run_dir / "launch.log").open("a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env()).returncode


def _slurm_command(spec: SweepSpec, point: Point, config_file: Optional[str]) -> list[str]:
    s = spec.slurm
    cmd = [sys.executable, "-m", "launch.slurm", "--recipe", spec.recipe, "--run-dir", str(point.run_dir),
           "--partition", s.partition, "--time", s.time, "--job-name", f"{spec.name}-{point.name}"]
    if s.account:
        cmd += ["--account", s.account]
    if s.cpu:
        cmd += ["--cpu", "--nodes", "1", "--ntasks-per-node", str(point.gpus)]
    else:
        per_node = min(point.gpus, s.gpus_per_node)
        cmd += ["--nodes", str(-(-point.gpus // per_node)), "--gpus-per-node", str(per_node)]
    if config_file:
        cmd += ["--config", config_file]
    # launch.slurm owns the run directory (--run-dir); it refuses logging.run_dir overrides.
    overrides = [o for o in point.overrides if not o.startswith("logging.run_dir=")]
    return cmd + list(s.args) + overrides


def write_slurm_job(spec: SweepSpec, point: Point, config_file: Optional[str]) -> Path:
    """<run_dir>/job.sh through launch.slurm (reused if an earlier sweep run wrote it)."""
    script = point.run_dir / "job.sh"
    if script.is_file():
        return script
    result = subprocess.run(_slurm_command(spec, point, config_file), capture_output=True, text=True, env=_env())
    if result.returncode != 0:
        raise RuntimeError(f"launch.slurm refused point {point.name}:\n{result.stderr.strip()}")
    return script


def _directives(script: Path) -> tuple[str, ...]:
    """A job's allocation: its #SBATCH lines except the ones naming the job or its log."""
    keep = []
    for line in script.read_text().splitlines():
        if line.startswith("#SBATCH") and not any(k in line for k in ("--job-name", "--output", "--error")):
            keep.append(line.split(" #")[0].rstrip())  # drop the trailing explanation
    return tuple(keep)


def write_arrays(spec: SweepSpec, scripts: dict[str, Path], out_dir: Path,
                 branches: frozenset[str] = frozenset()) -> list[tuple[Path, list[str]]]:
    """One job-array script per allocation shape (cooldown branches, the names in `branches`,
    in arrays of their own: they wait for their stable runs); task i runs point i's own job.sh
    (whose #SBATCH lines are then comments) inside the array task's allocation."""
    groups: dict[tuple, list[str]] = {}
    for name, script in scripts.items():
        groups.setdefault((name in branches, *_directives(script)), []).append(name)
    arrays = []
    for index, ((_, *directives), names) in enumerate(sorted(groups.items(), key=lambda g: g[0][0])):
        path = out_dir / f"array-{index}.sh"
        lines = [
            "#!/bin/bash",
            f"# launch.sweep: {len(names)} point(s) of sweep {spec.name} as one Slurm job array.",
            "# Task i runs the i-th point's job.sh, written by launch.slurm (preemption and requeue",
            "# handling included: requeue acts on this array task alone).",
            f"#SBATCH --job-name={spec.name}",
            *directives,
            f"#SBATCH --output={out_dir}/logs/array-{index}-%A_%a.out",
            f"#SBATCH --array=0-{len(names) - 1}",
            "POINTS=(" + " ".join(shlex.quote(str(scripts[n])) for n in names) + ")",
            'exec bash "${POINTS[$SLURM_ARRAY_TASK_ID]}"',
            "",
        ]
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines))
        arrays.append((path, names))
    return arrays


def _stable_jobs(branches: list[Point], points: dict[str, Point]) -> list[str]:
    """The Slurm jobs of these branches' stable runs still queued or running (submitted now or
    by an earlier sweep run); a finished stable run has nothing to wait for."""
    jobs = []
    for name in sorted({b.branch_of for b in branches}):
        record = points[name].run_dir / "slurm_task.json"
        if not is_finished(points[name]) and record.is_file():
            jobs.append(str(json.loads(record.read_text())["job"]))
    return sorted(set(jobs))


def submit_arrays(arrays: list[tuple[Path, list[str]]], points: dict[str, Point]) -> None:
    """sbatch each array; an array of cooldown branches after the stable runs' arrays, with
    --dependency=afterok on their jobs (a failed stable run leaves its branches pending)."""
    for path, names in arrays:
        branches = [points[n] for n in names if points[n].branch_of]
        depend = _stable_jobs(branches, points) if branches else []
        command = ["sbatch", "--parsable", *([f"--dependency=afterok:{':'.join(depend)}"] if depend else []), str(path)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {path} failed: {result.stderr.strip()}")
        job = result.stdout.strip().split(";")[0]
        for task, name in enumerate(names):
            (points[name].run_dir / "slurm_task.json").write_text(json.dumps({"job": job, "task": task}) + "\n")
        print(f"[sweep] submitted {path.name}: job array {job} ({len(names)} points)")


def _slurm_task_alive(point: Point) -> bool:
    record = point.run_dir / "slurm_task.json"
    if not record.is_file() or shutil.which("squeue") is None:
        return False
    task = json.loads(record.read_text())
    result = subprocess.run(["squeue", "-h", "-j", f"{task['job']}_{task['task']}"], capture_output=True, text=True)
    return result.returncode == 0 and bool(result.stdout.strip())


def run_sweep(spec: SweepSpec, points: list[Point], *, spec_dir: Path, submit: bool = True) -> list[str]:
    """Run (local) or submit (slurm) every point that is not finished; returns failures."""
    config_file = str(spec_dir / spec.config) if spec.config else None
    states = {p.name: prepare_dir(p) for p in points}
    todo = [p for p in points if states[p.name] == "todo"]
    skipped = sum(1 for s in states.values() if s == "finished")
    print(f"[sweep] {spec.name}: {len(points)} points, {skipped} finished (skipped), "
          f"{sum(1 for s in states.values() if s == 'running')} still queued/running, {len(todo)} to run")
    failures = []
    if spec.launcher == "local":
        failed = set()
        # Stable runs come before their cooldown branches (expand_with_branches' order).
        for i, point in enumerate(todo, 1):
            if point.branch_of in failed:
                failures.append(f"{point.name}: not run, its stable run {point.branch_of} failed")
                failed.add(point.name)
                continue
            print(f"[sweep] ({i}/{len(todo)}) {point.name} on {point.gpus} rank(s)"
                  + (f", cooldown branch of {point.branch_of}" if point.branch_of else ""), flush=True)
            rc = run_local(spec, point, config_file)
            if rc != 0:
                failures.append(f"{point.name}: exit {rc}, see {point.run_dir / 'launch.log'}")
                failed.add(point.name)
        return failures
    scripts = {p.name: write_slurm_job(spec, p, config_file) for p in todo}
    if scripts:
        branches = frozenset(p.name for p in todo if p.branch_of)
        arrays = write_arrays(spec, scripts, Path(points[0].run_dir).parents[1], branches)
        if submit:
            submit_arrays(arrays, {p.name: p for p in points})
        else:
            print("[sweep] written, not submitted: " + ", ".join(f"sbatch {a}" for a, _ in arrays))
    return failures


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", help="sweep spec YAML")
    p.add_argument("--dry-run", action="store_true", help="list the points and their commands; run nothing")
    p.add_argument("--collect-only", action="store_true", help="only build tables and plots from what ran")
    p.add_argument("--no-submit", action="store_true", help="slurm: write the job arrays, do not sbatch them")
    return p


def _print_points(spec: SweepSpec, points: list[Point], spec_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    config_file = str(spec_dir / spec.config) if spec.config else None
    table = Table(title=f"sweep {spec.name}: {len(points)} points ({spec.launcher})")
    for column in ["point", *spec.grid, "gpus", "steps", "branch of", "finished", "command"]:
        table.add_column(column, overflow="fold")
    for p in points:
        cmd = _local_command(spec, p, config_file) if spec.launcher == "local" else _slurm_command(spec, p, config_file)
        table.add_row(p.name, *p.labels.values(), str(p.gpus), str(p.config.schedule.train_steps),
                      p.branch_of or "", "yes" if is_finished(p) else "no", shlex.join(cmd[1:]))
    Console(width=200).print(table)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    spec_dir = Path(args.spec).resolve().parent
    try:
        spec = load_spec(args.spec)
        if spec.launcher == "slurm" and spec.slurm is None:
            raise SweepSpecError("launcher: slurm needs a `slurm:` section (partition, time, ...)")
        points, groups = expand_with_branches(spec, spec_dir=spec_dir)
    except SweepSpecError as exc:
        print_error(exc)
        return BAD_INPUT
    if args.dry_run:
        _print_points(spec, points, spec_dir)
        for line in compute_summary(points, groups) if groups else []:
            print(f"[sweep] {line}")
        return 0
    failures = []
    if not args.collect_only:
        try:
            failures = run_sweep(spec, points, spec_dir=spec_dir, submit=not args.no_submit)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    out_dir = points[0].run_dir.parents[1]
    result = collect(points, list(spec.grid), out_dir)
    finished = sum(1 for r in result["rows"] if r["status"] == "finished")
    print(f"[sweep] {finished}/{len(points)} points finished; table {result['markdown']}, {result['csv']}")
    print(f"[sweep] plots: {', '.join(str(p) for p in result['plots'])}")
    if result["fit"]:
        fit = result["fit"]
        print(f"[sweep] power law: {fit['loss_column']} = {fit['a']:.4g} x C^-{fit['b']:.4g} (R^2 {fit['r2']:.3f})")
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
