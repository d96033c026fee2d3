"""Upgrade parity: train the same short runs on two set-ups (an old and a new checkout, venv,
Megatron-Core, torch) and compare them step by step and by their final weights.

    # in the old checkout (or with its interpreter), then in the new one:
    python -m launch.upgrade_check run --out runs/upgrade/old --checkout ../old --python ../old/.venv/bin/python
    python -m launch.upgrade_check run --out runs/upgrade/new
    python -m launch.upgrade_check compare runs/upgrade/old runs/upgrade/new --rtol 1e-5

`run` trains every case (or `--cases NAME ...`) with `python -m launch.local` in `--checkout`
(default: this one) with `--python` (default: this interpreter), each into OUT/NAME: per-step
metrics (`logging.log_interval=1`) and a final checkpoint. Every case is fp32 on mock data
(tokens that do not depend on a tokenizer), the fp16 case aside, and sets its own seed, so the
two set-ups see the same weights and batches. `compare` runs `launch.compare_runs`' comparison
of loss and grad norm per case, then compares the final model weights tensor by tensor (read
offline from each checkpoint, whichever checkpoint format version wrote it), and prints one
table; exit 0 when every case agrees within the tolerance, 1 when one does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

# name -> (recipe, ranks, overrides). Small enough for a 2-core machine (20 steps each).
COMMON = ["schedule.train_steps=20", "schedule.warmup_steps=2", "schedule.eval_interval=0",
          "logging.log_interval=1", "logging.tensorboard=false", "data.demo=false", "data.mock=true",
          "runtime.spec=portable", "runtime.seed=1234", "optimizer.lr=3e-3", "checkpoint.save_interval=20",
          "checkpoint.async_save=false"]
CASES: dict[str, tuple[str, int, list[str]]] = {
    "one-rank": ("tiny-llama", 1, []),
    "tp2-pp2-vpp2-sp": ("tiny-llama", 4, [
        "model.num_layers=8", "parallel.tensor_parallel=2", "parallel.pipeline_parallel=2",
        "parallel.virtual_pipeline=2", "parallel.sequence_parallel=true"]),
    "zero3-dp2": ("tiny-llama", 2, ["parallel.sharding=zero3"]),
    "cp2-documents": ("tiny-llama", 2, [
        "parallel.context_parallel=2", "data.reset_attention_mask=true", "data.reset_position_ids=true"]),
    "moe-ep2-tp2": ("tiny-moe", 4, [
        "parallel.expert_parallel=2", "parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]),
    "fp16-loss-scaler": ("tiny-llama", 1, ["runtime.dtype=fp16"]),
}


def run_case(name: str, out: Path, checkout: Path, python: str) -> float:
    recipe, ranks, overrides = CASES[name]
    target = out.resolve() / name
    if (target / "metrics.jsonl").exists():
        raise SystemExit(f"error: {target} already holds a run; pick another --out or remove it")
    command = [python, "-m", "launch.local", "--recipe", recipe, "--nproc", str(ranks), *COMMON, *overrides,
               f"logging.run_dir={target}", f"checkpoint.dir={target / 'checkpoints'}"]
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    result = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"error: case {name} failed (exit {result.returncode}):\n{result.stdout[-3000:]}"
                         f"{result.stderr[-3000:]}")
    return time.perf_counter() - start


def final_weights(run: Path) -> dict:
    """Model tensors of the run's last checkpoint, read offline (chunk key -> tensor)."""
    from checkpoints_tools.dcp_io import CheckpointReader
    from pretrain.checkpointing.format import find_resumable

    reader = CheckpointReader(find_resumable(run / "checkpoints"))
    return {key: reader.read(key) for key in reader.tensor_keys() if not key.startswith("optimizer")}


def weight_difference(a: dict, b: dict) -> tuple[float, str]:
    """The largest |a - b| / max|a| over the tensors both hold, and its key."""
    if set(a) != set(b):
        raise SystemExit(f"error: the checkpoints hold different model tensors: only in A {sorted(set(a) - set(b))[:3]}, "
                         f"only in B {sorted(set(b) - set(a))[:3]}")
    worst, where = 0.0, ""
    for key in sorted(a):
        scale = float(a[key].double().abs().max()) or 1.0
        diff = float((a[key].double() - b[key].double()).abs().max()) / scale
        if not math.isfinite(diff) or diff > worst:
            worst, where = diff, key
    return worst, where


def _max_relative(comparison) -> float:
    diffs = [cell.rel_diff for row in comparison.rows for cell in row.cells if cell.rel_diff is not None]
    return max(diffs, default=0.0)


def compare(old: Path, new: Path, rtol: float, cases: list[str]) -> int:
    from launch.compare_runs import CompareError, compare_runs

    failed = False
    print(f"{'case':<18} {'steps':>5} {'loss, grad norm: max rel diff':>30} {'final weights: max rel diff':>28}  verdict")
    for name in cases:
        try:
            comparison = compare_runs(str(old / name), str(new / name), metrics=["loss", "grad_norm"],
                                      rtol=rtol, atol=0.0)
        except CompareError as exc:
            print(f"error: case {name}: {exc}", file=sys.stderr)
            return 2
        weights, key = weight_difference(final_weights(old / name), final_weights(new / name))
        same = comparison.ok and weights <= rtol
        failed |= not same
        note = "" if weights <= rtol else f" (weights: {key})"
        print(f"{name:<18} {len(comparison.rows):>5} {_max_relative(comparison):>30.1e} {weights:>28.1e}  "
              f"{'same' if same else 'DIFFERENT: ' + comparison.summary()}{note}")
    return 1 if failed else 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.upgrade_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train every case into OUT/<case>")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1])
    run.add_argument("--python", default=sys.executable)
    run.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    cmp = sub.add_parser("compare", help="compare two `run` outputs case by case")
    cmp.add_argument("old", type=Path)
    cmp.add_argument("new", type=Path)
    cmp.add_argument("--rtol", type=float, default=1e-5)
    cmp.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    args = parser.parse_args(argv)
    if args.command == "compare":
        return compare(args.old, args.new, args.rtol, args.cases)
    if not (args.checkout / "launch" / "local.py").is_file():
        parser.error(f"--checkout {args.checkout} is not a checkout of this project (no launch/local.py)")
    for name in args.cases:
        seconds = run_case(name, args.out, args.checkout, args.python)
        print(f"{name}: {seconds:.0f} s -> {args.out / name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
