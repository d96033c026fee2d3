"""Communication floor of a data-parallel layout: one training step's collectives, replayed alone.

    # CPU, DP2: what plain DDP, ZeRO-2 and ZeRO-3 spend in gloo collectives per step:
    for level in none zero2 zero3; do
      python -m launch.comm_replay --recipe tiny-llama --nproc 2 --repeats 3 \
          data.demo=false data.mock=true runtime.spec=portable parallel.sharding=$level
    done

Trains one warm-up step and `--steps` timed steps (their median is the step time), then
records the collectives of one more step on rank 0 with torch's flight recorder (what the
backend ran, in order, with sizes, dtypes and process groups: `collectives.json` in the
profile directory). Fresh gloo ranks then replay them with no computation in between,
`--iters` steps per repeat. The replay's median is the time per step this layout spends in
collectives on this machine, whatever the compute; the difference between two layouts'
replays is the communication one of them adds.

Collectives on groups of one rank (e.g. tensor parallelism at TP 1) cost nothing and are
left out. Only purely data-parallel layouts (HSDP excluded) can be replayed: every other
collective must span all ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from data_pipeline.checks import WorkFailed, positive_int, run_cli
from launch.benchmark import _env, run_once
from launch.launchers.local import torchrun_module
from pretrain.cli import resolve_config
from pretrain.config import ConfigError, validate_for_world, validate_inputs
from pretrain.observe.profiler import COLLECTIVES

# The flight recorder's dtype names -> torch's.
DTYPES = {"Float": "float32", "Double": "float64", "BFloat16": "bfloat16", "Half": "float16", "Int": "int32",
          "Long": "int64", "Bool": "bool", "Byte": "uint8", "Char": "int8"}
# What the backend ran (a coalesced reduce-scatter on gloo is an all-reduce per tensor).
OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "barrier")


def collectives_of_window(path: Path, world: int) -> list[dict]:
    """The collectives of a profiled window (the profiler's collectives.json), in order, on
    groups of more than one rank: {"op", "shape", "dtype"}. A group of some other size than
    the world cannot be replayed on the world: WorkFailed."""
    if not path.exists():
        raise WorkFailed(f"{path} is missing: the flight recorder was off (watchdog.enabled=false or "
                         "watchdog.flight_recorder_entries=0)")
    recorded = json.loads(path.read_text())
    if recorded["may_be_truncated"]:
        raise WorkFailed(f"{path}: the window issued more collectives than the flight recorder keeps; "
                         "raise watchdog.flight_recorder_entries")
    sizes, out = recorded["group_sizes"], []
    for e in recorded["entries"]:
        size = sizes.get(e["process_group"][0])
        if size == 1:  # e.g. the tensor-parallel group at TP 1: no communication
            continue
        op = e["profiling_name"].split(":", 1)[-1]
        if size != world:
            raise WorkFailed(f"{op} on a group of {size} ranks (not all {world}): only layouts whose "
                             "collectives span every rank can be replayed")
        if op not in OPS:
            raise WorkFailed(f"{e['profiling_name']} cannot be replayed (known: {', '.join(OPS)})")
        dtype = DTYPES.get((e["input_dtypes"] or ["Float"])[0], "float32")
        for shape in e["input_sizes"] or [[]]:
            out.append({"op": op, "shape": shape, "dtype": dtype})
    return out


def _replay_fn(calls: list[dict], world: int):
    """A function that issues `calls` on buffers allocated once (the floor is the wire, not
    the allocator)."""
    import torch.distributed as dist

    steps = []
    for c in calls:
        t = torch.ones(c["shape"], dtype=getattr(torch, c["dtype"]))
        if c["op"] == "all_reduce":
            steps.append(lambda t=t: dist.all_reduce(t))
        elif c["op"] == "broadcast":
            steps.append(lambda t=t: dist.broadcast(t, src=0))
        elif c["op"] == "barrier":
            steps.append(dist.barrier)
        elif c["op"] == "all_gather":
            out = t.new_empty((world * t.numel(),))
            steps.append(lambda t=t, out=out: dist.all_gather_into_tensor(out, t.reshape(-1)))
        else:
            out = t.new_empty((t.numel() // world,))
            steps.append(lambda t=t, out=out: dist.reduce_scatter_tensor(out, t.reshape(-1)))
    return lambda: [s() for s in steps]


def worker(spec: Path, result: Path, iters: int, repeats: int) -> None:
    """One replay rank (started by torchrun); rank 0 writes the per-repeat ms per step."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    step = _replay_fn(json.loads(spec.read_text()), dist.get_world_size())
    for _ in range(3):  # connections and first-use allocations
        step()
    per_repeat = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            step()
        dist.barrier()
        per_repeat.append((time.perf_counter() - start) / iters)
    if dist.get_rank() == 0:
        result.write_text(json.dumps(per_repeat))
    dist.destroy_process_group()


def replay(calls: list[dict], nproc: int, iters: int, repeats: int, tmp: Path) -> list[float]:
    spec, result = tmp / "collectives.json", tmp / "replay.json"
    spec.write_text(json.dumps(calls))
    cmd = torchrun_module(nproc, "launch.comm_replay", ["--worker", str(spec), str(result), str(iters), str(repeats)])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if proc.returncode != 0:
        raise SystemExit(f"replay failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(result.read_text())


def _check_layout(config) -> None:
    p = config.parallel
    others = {k: v for k, v in (("tensor_parallel", p.tensor_parallel), ("pipeline_parallel", p.pipeline_parallel),
                                ("context_parallel", p.context_parallel), ("expert_parallel", p.expert_parallel),
                                ("hsdp_replicas", p.hsdp_replicas)) if v != 1}
    if others:
        raise ConfigError(f"comm_replay replays collectives on all ranks, so it needs a purely data-parallel "
                          f"layout; got {', '.join(f'parallel.{k}={v}' for k, v in others.items())} "
                          f"(set them to 1)")


def measure(args: argparse.Namespace) -> dict:
    # 1 warm-up step, the timed steps, the profiler's own warm-up step, the recorded step.
    last = 1 + args.steps + 2
    with tempfile.TemporaryDirectory(prefix="comm-replay-") as tmp:
        tmp = Path(tmp)
        record = [f"profile.start_step={last}", "profile.num_steps=1", "profile.ranks=[0]",
                  f"profile.dir={tmp / 'profile'}", "profile.record_shapes=false", "profile.profile_memory=false",
                  "watchdog.enabled=true", "watchdog.flight_recorder_entries=4096"]
        print(f"training {last} steps on {args.nproc} ranks, recording the collectives of step {last} ...",
              file=sys.stderr, flush=True)
        records = run_once(args.recipe, args.nproc, last, list(args.overrides) + record, tmp / "run")
        step = statistics.median(r["step_time_s"] for r in records[1:1 + args.steps])
        calls = collectives_of_window(tmp / "profile" / "rank_0" / COLLECTIVES, args.nproc)
        print(f"replaying its {len(calls)} collectives: {args.repeats} x {args.iters} steps ...",
              file=sys.stderr, flush=True)
        per_repeat = replay(calls, args.nproc, args.iters, args.repeats, tmp)
    elements: Counter = Counter()
    for c in calls:
        elements[c["op"]] += math.prod(c["shape"])
    comm = statistics.median(per_repeat)
    return {"recipe": args.recipe, "nproc": args.nproc, "overrides": args.overrides,
            "step_time_s": step, "comm_only_s": comm, "comm_share": comm / step,
            "collectives": dict(Counter(c["op"] for c in calls)), "input_elements": dict(elements),
            "input_bytes_per_step": sum(math.prod(c["shape"]) * getattr(torch, c["dtype"]).itemsize for c in calls),
            "comm_only_per_repeat_s": per_repeat}


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        spec, result, iters, repeats = sys.argv[2:6]
        worker(Path(spec), Path(result), int(iters), int(repeats))
        return 0
    parser = argparse.ArgumentParser(prog="python -m launch.comm_replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--nproc", type=positive_int, default=2)
    parser.add_argument("--steps", type=positive_int, default=10,
                        help="steps timed (after one warm-up step) for the step time; the collectives are "
                             "recorded two steps later")
    parser.add_argument("--iters", type=positive_int, default=20, help="replayed steps per repeat")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)

    def check() -> int:
        config = resolve_config(args.recipe, None, list(args.overrides) + ["checkpoint.dir=null"])
        validate_for_world(config, args.nproc)
        validate_inputs(config)
        _check_layout(config)
        return 0

    code = run_cli(check, bad_input=(ConfigError, ValueError))
    return code or run_cli(lambda: _report(measure(args), args))


def _report(result: dict, args: argparse.Namespace) -> int:
    table = Table(title=f"{args.recipe} x{args.nproc} ranks: {' '.join(args.overrides) or 'recipe defaults'}")
    for col in ("step (ms)", "collectives only (ms)", "share", "collectives", "input MB"):
        table.add_column(col, justify="right")
    table.add_row(f"{1000 * result['step_time_s']:.1f}", f"{1000 * result['comm_only_s']:.1f}",
                  f"{result['comm_share']:.0%}", ", ".join(f"{n} {op}" for op, n in result["collectives"].items()),
                  f"{result['input_bytes_per_step'] / 1e6:.1f}")
    Console().print(table)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
