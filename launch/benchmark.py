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

    # --overhead: step time with the hang watchdog (+ flight recorder), the straggler
    # report (every 10 steps), MLflow (SQLite store) and W&B (offline) on, against all of
    # them off; off/on runs alternate so a shared machine's load drifts into both alike:
    python -m launch.benchmark --recipe tiny-llama --nproc 2 --steps 40 --warmup 5 --repeats 6 \
        --overhead data.demo=false data.mock=true runtime.spec=portable
"""

from __future__ import annotations

import argparse
import json
import os
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


def run_records(recipe: str, nproc: int, steps: int, overrides: list[str], run_dir: Path) -> tuple[list[dict], str]:
    """Train `steps` steps through torchrun; (per-step metrics records, output). The records
    are empty if the run failed; the output (stdout + stderr) says why."""
    cmd = torchrun_command(recipe, nproc, run_overrides(overrides, steps, run_dir))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return [], f"exit {proc.returncode}:\n{output}"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"loss"' in line], output


def run_once(recipe: str, nproc: int, steps: int, overrides: list[str], run_dir: Path) -> list[dict]:
    records, output = run_records(recipe, nproc, steps, overrides, run_dir)
    if not records:
        raise SystemExit(f"benchmark run failed ({output[:8]}):\n{output[-6000:]}")
    return records


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


OBSERVE_OFF = ["watchdog.enabled=false", "logging.straggler_interval=0", "tracking.mlflow=false",
               "tracking.wandb=false", "profile.start_step=null"]


def observe_on(tmp: Path) -> list[str]:
    return ["watchdog.enabled=true", "logging.straggler_interval=10", "tracking.mlflow=true",
            f"tracking.mlflow_tracking_uri=sqlite:///{tmp}/mlflow.db", "tracking.wandb=true",
            "tracking.wandb_mode=offline", "profile.start_step=null"]


def hook_costs(repeats: int = 5, calls: int = 200) -> dict:
    """What the per-step hooks cost in this process, min over repeats (load on a shared
    machine only lengthens a trial): the watchdog's marks, the Megatron timers of one
    micro-batch (forward + backward), and one record logged to MLflow (SQLite) and W&B
    (offline) including the time to write it out (the trackers are closed inside the trial)."""
    import time as clock

    from pretrain.cli import resolve_config
    from pretrain.config import WatchdogConfig
    from pretrain.observe.timers import StepTimers
    from pretrain.observe.trackers import open_trackers
    from pretrain.observe.watchdog import Watchdog

    def best(trial) -> float:
        return min(trial() for _ in range(repeats)) / calls

    def watchdog_trial() -> float:
        dog = Watchdog(WatchdogConfig(), tempfile.gettempdir(), 0)
        start = clock.perf_counter()
        for step in range(calls):
            dog.begin_step(step)
            dog.end_step(0.1)
        return clock.perf_counter() - start

    def timers_trial() -> float:
        timers = StepTimers(measure_compute=True)
        start = clock.perf_counter()
        for _ in range(calls):
            for name in ("forward-compute", "backward-compute"):
                timers(name, log_level=2).start()
                timers(name).stop()
            timers.take_compute_s()
        return clock.perf_counter() - start

    record = {"step": 0, "loss": 2.5, "lr": 3e-4, "grad_norm": 1.0, "step_time_s": 0.25, "tokens_per_s": 1e4,
              "tokens_per_s_per_device": 5e3, "tflops_per_device": 1.0, "peak_mem_gb": 1.0,
              "overhead_frac": 0.05, "skipped": False, "skipped_steps": 0}

    def trackers_trial() -> tuple[float, float]:
        """(seconds in `log` on the training thread, seconds to close: MLflow's queue drained,
        W&B's run finished) for `calls` records."""
        with tempfile.TemporaryDirectory(prefix="bench-trackers-") as tmp:
            config = resolve_config("tiny-llama", None, [
                f"logging.run_dir={tmp}", "tracking.mlflow=true", f"tracking.mlflow_tracking_uri=sqlite:///{tmp}/m.db",
                "tracking.wandb=true", "tracking.wandb_mode=offline"])
            trackers = open_trackers(config, True, None, lambda m: None)
            start = clock.perf_counter()
            for step in range(1, calls + 1):
                trackers.log(dict(record, step=step))
            logged = clock.perf_counter()
            trackers.close()
            return logged - start, clock.perf_counter() - logged

    tracker_trials = [trackers_trial() for _ in range(2)]
    return {"watchdog_marks_s": best(watchdog_trial), "megatron_timers_per_microbatch_s": best(timers_trial),
            "tracker_log_call_s": min(t[0] for t in tracker_trials) / calls,
            "trackers_close_once_s": min(t[1] for t in tracker_trials)}


def overhead(args: argparse.Namespace) -> dict:
    """Median step time with everything but the profiler on vs off, alternating off/on runs."""
    per_mode: dict[str, list[float]] = {"off": [], "on": []}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        for i in range(args.repeats):
            for mode in ("off", "on"):
                extra = OBSERVE_OFF if mode == "off" else observe_on(Path(tmp))
                records = run_once(args.recipe, args.nproc, args.steps, list(args.overrides) + extra,
                                   Path(tmp) / f"{mode}{i}")
                per_mode[mode].append(summarise(records, args.warmup)["step_time_s"])
                print(f"repeat {i + 1}/{args.repeats} {mode:>3}: median step {1000 * per_mode[mode][-1]:.2f} ms",
                      flush=True)
    off, on = statistics.median(per_mode["off"]), statistics.median(per_mode["on"])
    paired = [b / a for a, b in zip(per_mode["off"], per_mode["on"])]
    return dict(recipe=args.recipe, nproc=args.nproc, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                overrides=args.overrides, off_step_s=off, on_step_s=on, on_over_off=on / off,
                median_paired_ratio=statistics.median(paired), per_repeat_off=per_mode["off"],
                per_repeat_on=per_mode["on"], loadavg_before=load_before, loadavg_after=os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.benchmark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--nproc", type=positive_int, default=1)
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--warmup", type=nonnegative_int, default=5, help="steps excluded from the medians")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--overhead", action="store_true",
                        help="compare watchdog + straggler report + MLflow + W&B on vs all off")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
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
    if args.overhead:
        result = overhead(args)
        result["hook_costs"] = hook_costs()
        print("per-step hook costs in-process (min of trials): " + ", ".join(
            f"{k} {1e6 * v:.1f} us" if v < 0.1 else f"{k} {v:.2f} s" for k, v in result["hook_costs"].items()))
        print(f"median step time: off {1000 * result['off_step_s']:.2f} ms, on {1000 * result['on_step_s']:.2f} ms, "
              f"on/off {result['on_over_off']:.4f} (median of paired ratios {result['median_paired_ratio']:.4f}); "
              f"load average {result['loadavg_before'][0]:.1f} before, {result['loadavg_after'][0]:.1f} after")
        print(json.dumps(result))
        return 0
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
