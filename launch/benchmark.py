"""Training throughput benchmark: N steps of a recipe/layout, repeated, medians reported.

    # CPU, tiny-llama at TP2 x PP2 (4 gloo ranks), 3 repeats of 30 steps:
    python -m launch.benchmark --recipe tiny-llama --nproc 4 --steps 30 --repeats 3 \
        parallel.tensor_parallel=2 parallel.pipeline_parallel=2
    # CPU, context parallelism: tiny-llama at seq 2048 (attention-dominated), CP2 vs CP1:
    python -m launch.benchmark --recipe tiny-llama --nproc 2 --steps 6 --warmup 2 --repeats 2 \
        parallel.context_parallel=2 model.max_seq_length=2048 schedule.seq_length=2048 \
        schedule.micro_batch_size=1 schedule.global_batch_size=2 data.demo=false data.mock=true
    # GPU: a llama3-8b-shaped model cut to the layers that fit one H100, BF16, seq 4096
    # (one H100 SXM, TE 2.11: 458 TFLOP/s = 46.3% MFU; micro-batch 1: 43.9%; add
    # runtime.fp8=hybrid for FP8: 503 TFLOP/s at micro-batch 1):
    python -m launch.benchmark --recipe llama3-8b --nproc 1 --steps 15 --repeats 2 \
        model.num_layers=4 parallel.tensor_parallel=1 parallel.sequence_parallel=false \
        schedule.seq_length=4096 schedule.global_batch_size=8 schedule.micro_batch_size=2 \
        runtime.recompute=none data.mock=true

Prints a table and one JSON line: step time, tokens/s (global and per device), model
TFLOP/s per device, MFU (GPU only) and the fraction of step time spent outside
forward/backward + optimizer (data fetch, logging, loss broadcast).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from data_pipeline.checks import nonnegative_int, positive_int, run_cli
from launch.launchers.local import torchrun_command
from pretrain.cli import resolve_config
from pretrain.config import ConfigError, validate_for_world, validate_inputs

FIELDS = ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "overhead_frac")


def run_overrides(overrides: list[str], steps: int, run_dir: Path) -> list[str]:
    return overrides + [
        f"schedule.train_steps={steps}", "schedule.eval_interval=0", "logging.log_interval=1",
        "logging.tensorboard=false", f"logging.run_dir={run_dir}", "checkpoint.dir=null",
    ]


def run_once(recipe: str, nproc: int, steps: int, overrides: list[str], run_dir: Path) -> list[dict]:
    cmd = torchrun_command(recipe, nproc, run_overrides(overrides, steps, run_dir))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if proc.returncode != 0:
        raise SystemExit(f"benchmark run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"loss"' in line]


def _env() -> dict:
    import os

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def summarise(records: list[dict], warmup: int) -> dict:
    """Medians over the steps after warm-up (first steps include allocation and caching)."""
    timed = records[warmup:]
    out = {}
    for field in FIELDS:
        values = [r[field] for r in timed if r.get(field) is not None]
        out[field] = statistics.median(values) if values else None
    out["peak_mem_gb"] = max(r["peak_mem_gb"] for r in records)
    out["final_loss"] = records[-1]["loss"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.benchmark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--nproc", type=positive_int, default=1)
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--warmup", type=nonnegative_int, default=5, help="steps excluded from the medians")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")

    def check() -> int:  # the runs' config, before the first of them starts
        config = resolve_config(args.recipe, None, run_overrides(list(args.overrides), args.steps,
                                                                Path(tempfile.gettempdir()) / "bench-check"))
        validate_for_world(config, args.nproc)
        validate_inputs(config)
        return 0

    code = run_cli(check, bad_input=(ConfigError, ValueError))
    if code:
        return code
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for i in range(args.repeats):
            records = run_once(args.recipe, args.nproc, args.steps, list(args.overrides), Path(tmp) / f"r{i}")
            runs.append(summarise(records, args.warmup))
    result = {k: statistics.median([r[k] for r in runs]) if runs[0][k] is not None else None for k in runs[0]}
    result.update(recipe=args.recipe, nproc=args.nproc, steps=args.steps, repeats=args.repeats,
                  overrides=args.overrides, per_repeat=runs)
    _print_table(result, runs)
    print(json.dumps(result))
    return 0


def _print_table(result: dict, runs: list[dict]) -> None:
    table = Table(title=f"{result['recipe']} x{result['nproc']} ranks, median of {len(runs)} repeats")
    table.add_column("metric")
    table.add_column("median", justify="right")
    table.add_column("per repeat", justify="right")
    for field in FIELDS + ("peak_mem_gb",):
        if result[field] is None:
            continue
        fmt = "{:.1%}" if field in ("mfu", "overhead_frac") else "{:.4g}"
        table.add_row(field, fmt.format(result[field]), ", ".join(fmt.format(r[field]) for r in runs))
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
