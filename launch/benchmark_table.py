"""The throughput table: layers x sequence x precision x micro-batch, one training run per cell.

    # One H100 (issue 18's table): llama3-8b shape cut to 4 and 8 layers, seq 4096 and 8192,
    # BF16 and every FP8 recipe this GPU runs, micro-batch 1/2/4, global batch 8 sequences;
    # per cell: 5 warm-up steps, then 3 windows of 20 steps (median per window, median of the 3).
    python -m launch.benchmark_table --recipe llama3-8b --layers 4 8 --seq 4096 8192 \
        --precision bf16 fp8 --micro-batch 1 2 4 --global-batch 8 --out runs/h100-table.jsonl
    # The same, split over several sessions: a finished cell is not run again (--fresh re-runs).
    python -m launch.benchmark_table ... --layers 4 --seq 4096 --out runs/h100-table.jsonl
    python -m launch.benchmark_table --render runs/h100-table.jsonl     # print the table so far
    # A speed variant of pretrain.recipes.SPEED_VARIANTS (to be measured) against the baseline:
    python -m launch.benchmark_table ... --variant baseline fused overlap
    # CPU, tiny (what the tests run):
    python -m launch.benchmark_table --recipe tiny-llama --layers 2 --seq 64 --precision fp32 \
        --micro-batch 1 2 --global-batch 4 --warmup 1 --steps 2 --windows 3 --out /tmp/t.jsonl

Each cell is a fresh `torchrun -m pretrain` process (TP1, recompute off, mock data), so an
out-of-memory cell cannot poison the next: it is recorded as `OOM` with the micro-batch and
sequence in the note, and the table goes on. `fp8` expands to every recipe the GPU runs
(`models.precision.supported_recipes`); an FP8 recipe named explicitly that this GPU cannot
run is recorded as skipped with the reason. Results go to `--out` as JSON lines (one per cell,
appended as each finishes) and the table to `<out>.md`.

Columns: step time; tokens/s; model TFLOP/s per GPU (models.flops, the formula of the metrics
and the planner); MFU against the GPU's dense BF16 peak (for FP8 rows too, so rows compare);
peak memory allocated by torch; and the timer's share of the step outside forward/backward and
the optimizer (data fetch; the profile-based figure is launch.step_profile's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional

from launch.benchmark import run_records

FIELDS = ("step_time_s", "tokens_per_s", "tflops_per_device", "overhead_frac")
OOM_MARKS = ("CUDA out of memory", "OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED")
DTYPES = ("fp32", "bf16", "fp16")


def expand_precisions(tokens: list[str], supported_fp8: list[str]) -> list[str]:
    """`fp8` -> fp8-<recipe> for each recipe this machine runs; other tokens as given."""
    out: list[str] = []
    for token in tokens:
        names = [f"fp8-{r}" for r in supported_fp8] if token == "fp8" else [token]
        out += [n for n in names if n not in out]
    return out


def precision_overrides(precision: str) -> list[str]:
    """Config overrides for a precision token: a dtype, or fp8-<recipe> (in BF16)."""
    if precision in DTYPES:
        return [f"runtime.dtype={precision}"]
    if precision.startswith("fp8-"):
        recipe = precision[4:]
        # MXFP8 is E4M3 throughout (Megatron-Bridge's MXFP8 recipe); the others E4M3 forward, E5M2 backward.
        fmt = "e4m3" if recipe == "mxfp8" else "hybrid"
        return ["runtime.dtype=bf16", f"runtime.fp8={fmt}", f"runtime.fp8_recipe={recipe}"]
    raise ValueError(f"unknown precision {precision!r}: use {', '.join(DTYPES)}, fp8 or fp8-<recipe>")


def cell_key(cell: dict) -> str:
    return json.dumps(cell, sort_keys=True)


def summarise_windows(records: list[dict], warmup: int, steps: int, windows: int) -> dict:
    """Medians per window of `steps` steps after `warmup`, then the median over windows."""
    per_window = []
    for w in range(windows):
        chunk = records[warmup + w * steps: warmup + (w + 1) * steps]
        per_window.append({f: statistics.median(r[f] for r in chunk) for f in FIELDS})
    out = {f: statistics.median(w[f] for w in per_window) for f in FIELDS}
    out["step_time_windows_s"] = [w["step_time_s"] for w in per_window]
    out["peak_mem_gb"] = max(r["peak_mem_gb"] for r in records)
    out["final_loss"] = records[-1]["loss"]
    return out


def failure_note(output: str) -> tuple[str, str]:
    """(status, note) of a failed cell: out of memory, or the last error line."""
    if any(mark in output for mark in OOM_MARKS):
        return "oom", "out of memory"
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or "Error" in line]
    return "failed", (errors or lines or ["no output"])[-1][-300:]


def run_cell(args, cell: dict, bf16_peak: Optional[float], tmp: Path) -> dict:
    from pretrain.recipes import SPEED_VARIANTS

    overrides = [
        f"model.num_layers={cell['layers']}", f"schedule.seq_length={cell['seq']}",
        f"schedule.micro_batch_size={cell['micro_batch']}", f"schedule.global_batch_size={args.global_batch}",
        "parallel.tensor_parallel=1", "parallel.sequence_parallel=false", "runtime.recompute=none",
        "data.demo=false", "data.blend=null", "data.mock=true", "schedule.warmup_steps=1",
        *precision_overrides(cell["precision"]), *SPEED_VARIANTS[cell["variant"]], *args.overrides,
    ]
    total = args.warmup + args.steps * args.windows
    run_dir = tmp / f"cell{abs(hash(cell_key(cell)))}"
    records, output = run_records(args.recipe, args.nproc, total, overrides, run_dir)
    if len(records) < total:
        status, note = failure_note(output) if not records else ("failed", f"{len(records)} of {total} steps")
        return {"cell": cell, "status": status, "note": note}
    result = {"cell": cell, "status": "ok", "note": "", **summarise_windows(records, args.warmup, args.steps,
                                                                             args.windows)}
    result["mfu_bf16"] = result["tflops_per_device"] / bf16_peak if bf16_peak else None
    return result


def _device() -> tuple[str, Optional[float], list[str]]:
    """This machine's GPU name, its dense BF16 peak TFLOP/s (None if unknown/CPU), FP8 recipes."""
    from models.precision import probe_machine, supported_recipes
    from pretrain.metrics import detect_device_peak

    facts = probe_machine()
    peak = detect_device_peak("auto", "bf16", False)
    return facts.gpu_name or "cpu", peak, supported_recipes(facts)


def render(results: list[dict]) -> str:
    """A markdown table of every cell, in the order run."""
    head = ("| layers | seq | precision | variant | micro-batch | step (s) | tokens/s | TFLOP/s/GPU | MFU (BF16 peak) "
            "| peak mem (GiB) | timer overhead | note |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [head]
    for r in results:
        c = r["cell"]
        if r["status"] == "ok":
            mfu = f"{100 * r['mfu_bf16']:.1f}%" if r.get("mfu_bf16") is not None else "n/a"
            spread = f"windows {min(r['step_time_windows_s']):.3f}-{max(r['step_time_windows_s']):.3f} s"
            nums = (f"{r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['tflops_per_device']:.4g} | {mfu} | "
                    f"{r['peak_mem_gb']:.1f} | {100 * r['overhead_frac']:.2f}% | {spread}")
        else:
            nums = " | ".join(["-"] * 6) + f" | {r['status'].upper()}: {r['note']}"
        rows.append(f"| {c['layers']} | {c['seq']} | {c['precision']} | {c['variant']} | {c['micro_batch']} | {nums} |")
    return "\n".join(rows)


def _load(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.benchmark_table", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="llama3-8b")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--precision", nargs="+", default=["bf16", "fp8"],
                   help="fp32, bf16, fp16, fp8 (every recipe this GPU runs) or fp8-<recipe>")
    p.add_argument("--micro-batch", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step (all cells)")
    p.add_argument("--variant", nargs="+", default=["baseline"], help="names in pretrain.recipes.SPEED_VARIANTS")
    p.add_argument("--warmup", type=int, default=5, help="steps before the first timed window")
    p.add_argument("--steps", type=int, default=20, help="steps per timed window")
    p.add_argument("--windows", type=int, default=3, help="timed windows (the median of their medians is reported)")
    p.add_argument("--out", type=Path, help="JSON lines, one per cell; finished cells are not run again")
    p.add_argument("--fresh", action="store_true", help="re-run cells already in --out")
    p.add_argument("--render", type=Path, metavar="JSONL", help="only print the table of this results file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every cell")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    if args.render:
        if not args.render.is_file():
            parser.error(f"--render: {args.render} does not exist")
        print(render(_load(args.render)))
        return 0
    if args.out is None:
        parser.error("--out is required (results are appended there as each cell finishes)")
    from pretrain.recipes import RECIPES, SPEED_VARIANTS

    if args.recipe not in RECIPES:
        parser.error(f"unknown recipe {args.recipe!r}; valid: {', '.join(RECIPES)}")
    bad = [v for v in args.variant if v not in SPEED_VARIANTS]
    if bad:
        parser.error(f"unknown variant(s) {', '.join(bad)}; valid: {', '.join(SPEED_VARIANTS)}")
    if min(args.warmup, args.steps, args.windows) < 0 or args.steps == 0 or args.windows == 0:
        parser.error("--steps and --windows must be positive, --warmup non-negative")
    device, bf16_peak, fp8_recipes = _device()
    try:
        precisions = expand_precisions(args.precision, fp8_recipes)
        for p in precisions:
            precision_overrides(p)
    except ValueError as exc:
        parser.error(str(exc))
    done = {} if args.fresh else {cell_key(r["cell"]): r for r in _load(args.out) if r["status"] != "failed"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-table-") as tmp:
        for layers in args.layers:
            for seq in args.seq:
                for precision in precisions:
                    for variant in args.variant:
                        for mb in args.micro_batch:
                            cell = dict(layers=layers, seq=seq, precision=precision, variant=variant,
                                        micro_batch=mb, global_batch=args.global_batch, recipe=args.recipe)
                            results.append(_cell_result(args, cell, done, device, bf16_peak, fp8_recipes, Path(tmp)))
    table = render(results)
    Path(f"{args.out}.md").write_text(f"Device: {device}\n\n{table}\n")
    print(table)
    return 1 if any(r["status"] == "failed" for r in results) else 0


def _cell_result(args, cell, done, device, bf16_peak, fp8_recipes, tmp: Path) -> dict:
    if cell_key(cell) in done:
        return done[cell_key(cell)]
    precision = cell["precision"]
    if precision.startswith("fp8-") and precision[4:] not in fp8_recipes:
        from models.precision import FP8_RECIPES, probe_machine, recipe_problem

        why = recipe_problem(precision[4:], probe_machine()) if precision[4:] in FP8_RECIPES else "unknown recipe"
        result = {"cell": cell, "status": "skipped", "note": why}
    elif cell["global_batch"] % (cell["micro_batch"] * args.nproc):
        result = {"cell": cell, "status": "skipped",
                  "note": f"global batch {cell['global_batch']} is not a multiple of micro-batch x GPUs"}
    else:
        result = run_cell(args, cell, bf16_peak, tmp)
    result["device"] = device
    print(f"{cell} -> {result['status']} {result.get('step_time_s', '')} {result['note']}", flush=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(main())
