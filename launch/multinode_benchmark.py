"""Time from `sbatch` to the first training step, on 1 node vs N, on a running test cluster.

    python -m launch.launchers.ci_cluster start --nodes 2
    SLURM_CONF=/tmp/pretrain-multinode/slurm.conf python -m launch.multinode_benchmark --repeats 3

Each repeat submits the same 4-rank TP2 x PP2 tiny-llama job (--cpu, srun) once with
--nodes 1 --ntasks-per-node 4 and once with --nodes 2 --ntasks-per-node 2, one job at a
time, and measures submit -> first line in metrics.jsonl (start-up: scheduling, imports,
rendezvous, model, data, step 1). Prints each time and the medians. The machine's load
shows in these numbers: run it on a quiet machine and say how quiet it was.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OVERRIDES = ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2", "schedule.train_steps=2",
             "schedule.seq_length=64", "schedule.global_batch_size=8", "schedule.micro_batch_size=2",
             "schedule.eval_interval=0", "logging.tensorboard=false", "logging.log_interval=1"]


def time_to_first_step(nodes: int, ranks: int, base: Path, cache: Path, timeout: float = 300) -> float:
    run_dir = base / f"{nodes}n-{time.monotonic_ns()}"
    argv = [sys.executable, "-m", "launch.slurm", "--recipe", "tiny-llama", "--cpu", "--nodes", str(nodes),
            "--ntasks-per-node", str(ranks // nodes), "--partition", "debug", "--time", "10",
            "--run-dir", str(run_dir), *OVERRIDES, f"data.cache_dir={cache}"]
    subprocess.run(argv, check=True, capture_output=True)  # written, not yet submitted
    started = time.monotonic()
    job = subprocess.run(["sbatch", "--parsable", str(run_dir / "job.sh")], check=True,
                         capture_output=True, text=True).stdout.strip()
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() - started < timeout:
        if metrics.exists() and "\"loss\"" in metrics.read_text():
            elapsed = time.monotonic() - started
            subprocess.run(["scancel", job])
            _wait_gone(job)
            return elapsed
        time.sleep(0.1)
    subprocess.run(["scancel", job])
    raise SystemExit(f"job {job} ({nodes} node(s)) had no step after {timeout:.0f} s: see {run_dir}/logs")


def _wait_gone(job: str) -> None:
    for _ in range(300):
        out = subprocess.run(["squeue", "--noheader", "--jobs", job], capture_output=True, text=True).stdout
        if not out.strip():
            return
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.multinode_benchmark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2, help="the multi-node case (default 2)")
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="mn-bench-"))
    cache = base / "cache"
    times: dict[int, list[float]] = {1: [], args.nodes: []}
    time_to_first_step(1, 4, base, cache)  # warm-up: tokenises the demo corpus, builds index caches
    for _ in range(args.repeats):
        for nodes in times:
            times[nodes].append(time_to_first_step(nodes, 4, base, cache))
            print(f"{nodes} node(s): sbatch -> step 1 in {times[nodes][-1]:.1f} s", flush=True)
    for nodes, values in times.items():
        print(f"median {nodes} node(s): {statistics.median(values):.1f} s over {len(values)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
