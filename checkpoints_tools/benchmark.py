"""Benchmark: export and reshard throughput next to a plain copy of the same bytes.

    # ~1.1B-parameter Llama-shaped checkpoint (hidden 2048, 16 layers, FFN 8192, GQA 16/4),
    # fp32, written once to a temporary directory and deleted at the end:
    python -m checkpoints_tools.benchmark
    python -m checkpoints_tools.benchmark --layers 4 --workdir /scratch --json   # smaller, elsewhere

Steps, each in a fresh process (peak RSS is the process's own high-water mark):
  1. build the model on one rank and save it as a model-only torch_dist checkpoint (S bytes);
  2. copy: the checkpoint's files copied and fsynced on the same disk: the bound;
  3. reshard to TP2 (same dtype), 4. export to HF safetensors (same dtype).
Steps 2-4 run --repeats times, interleaved; medians are reported. Reported: GB/s (decimal GB of tensor bytes written per second), the fraction of copy
speed, peak RSS and peak RSS over the process's baseline after imports, as a fraction of S.
Outputs are deleted after each step, so the disk holds at most two copies of S.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]

# Run in a child process: prints one JSON line with the result, seconds and RSS figures.
_CHILD = r"""
import json, os, resource, sys, time
args = json.loads(sys.argv[1])
step = args.pop("step")
from pathlib import Path
import torch
from models.runtime import DTYPES
from models.layout import ParallelLayout
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = time.perf_counter()
if step == "save":
    from checkpoints_tools.benchmark import save_checkpoint
    result = save_checkpoint(Path(args["dst"]), args["model"])
elif step == "reshard":
    from checkpoints_tools.reshard import reshard
    result = reshard(Path(args["src"]), Path(args["dst"]), layout=ParallelLayout(tensor_parallel=2))
elif step == "export":
    from checkpoints_tools.export_hf import export_hf
    result = export_hf(Path(args["src"]), Path(args["dst"]), with_tokenizer=False)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"result": result, "seconds": seconds, "peak_rss": peak, "baseline_rss": baseline}))
"""


def model_config(layers: int, hidden: int, ffn: int):
    from models.config import ModelConfig

    return ModelConfig(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=16,
                       num_query_groups=4, vocab_size=32000, max_seq_length=4096, rope_base=500000.0)


def save_checkpoint(dst: Path, model: dict) -> dict:
    """Build the model on one rank and save its weights as a model-only checkpoint."""
    from megatron.core import dist_checkpointing

    from checkpoints_tools.common import write_training_meta
    from models.build import build_model_chunks
    from models.runtime import RuntimeOptions
    from models.config import ModelConfig
    from models.layout import ParallelLayout
    from pretrain.config import ExperimentConfig
    from pretrain.runtime import init_distributed

    config, layout = ModelConfig(**model), ParallelLayout()
    init_distributed(layout, seed=0)
    chunk = build_model_chunks(config, layout, RuntimeOptions(seed=0, spec="portable"))[0]
    dst.mkdir(parents=True)
    dist_checkpointing.save({"model": chunk.sharded_state_dict()}, str(dst))
    write_training_meta(dst, model=config, layout=layout, world_size=1, step=0, consumed_samples=0,
                        has_optimizer=False, config=ExperimentConfig(model=config),
                        provenance={"tool": "checkpoints_tools.benchmark"})
    return {"params": sum(p.numel() for p in chunk.parameters())}


def _child(step: str, **kwargs) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps({"step": step, **kwargs})], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark step {step} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def copy_tree(src: Path, dst: Path) -> float:
    """Seconds to copy every file and fsync it: what any rewrite of the bytes must at least cost."""
    start = time.perf_counter()
    dst.mkdir()
    for file in src.rglob("*"):
        if file.is_file():
            target = dst / file.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, target)
            with open(target, "rb+") as f:
                os.fsync(f.fileno())
    return time.perf_counter() - start


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _median_row(runs: list[dict]) -> dict:
    """The run with the median time (so its bytes and RSS belong to it), plus every time."""
    ranked = sorted(runs, key=lambda r: r["seconds"])
    return {**ranked[(len(ranked) - 1) // 2], "runs": [r["seconds"] for r in runs]}


def run(layers: int, hidden: int, ffn: int, workdir: Optional[Path], repeats: int = 1) -> dict:
    model = model_config(layers, hidden, ffn).model_dump()
    tmp = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=workdir))
    try:
        ckpt = tmp / "ckpt"
        saved = _child("save", dst=str(ckpt), model=model)
        size = _dir_bytes(ckpt)
        runs: dict[str, list] = {"copy": [], "reshard": [], "export": []}
        for _ in range(repeats):  # interleaved, so slow spells of a shared machine hit all steps
            copy_seconds = copy_tree(ckpt, tmp / "copy")
            shutil.rmtree(tmp / "copy")
            runs["copy"].append({"seconds": copy_seconds, "bytes": size, "peak_rss": None, "baseline_rss": None})
            for step in ("reshard", "export"):
                out = _child(step, src=str(ckpt), dst=str(tmp / step))
                runs[step].append({"seconds": out["result"]["seconds"], "bytes": out["result"]["bytes"],
                                   "peak_rss": out["peak_rss"], "baseline_rss": out["baseline_rss"]})
                shutil.rmtree(tmp / step)
        return {"params": saved["result"]["params"], "checkpoint_bytes": size, "repeats": repeats,
                "steps": {step: _median_row(r) for step, r in runs.items()},
                "layers": layers, "hidden": hidden, "ffn": ffn}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def report(result: dict) -> Table:
    size = result["checkpoint_bytes"]
    copy_rate = result["steps"]["copy"]["bytes"] / result["steps"]["copy"]["seconds"]
    table = Table(title=f"{result['params'] / 1e9:.2f}B params, checkpoint S = {size / 1e9:.2f} GB (fp32), "
                        f"median of {result['repeats']}")
    for column in ("step", "seconds", "runs (s)", "GB/s", "of copy", "peak RSS", "RSS over baseline"):
        table.add_column(column, justify="right")
    for step, row in result["steps"].items():
        rate = row["bytes"] / row["seconds"]
        rss = "-" if row["peak_rss"] is None else f"{row['peak_rss'] / 1e9:.2f} GB ({row['peak_rss'] / size:.2f} S)"
        over = "-" if row["peak_rss"] is None else f"{(row['peak_rss'] - row['baseline_rss']) / size:.2f} S"
        runs = " ".join(f"{t:.1f}" for t in row["runs"])
        table.add_row(step, f"{row['seconds']:.1f}", runs, f"{rate / 1e9:.2f}", f"{rate / copy_rate:.0%}", rss, over)
    return table


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkpoints_tools.benchmark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--workdir", type=Path, help="where the temporary checkpoints go (default: system temp)")
    parser.add_argument("--repeats", type=int, default=3, help="copy/reshard/export runs each (medians)")
    parser.add_argument("--json", action="store_true", help="also print the raw numbers as one JSON line")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    result = run(args.layers, args.hidden, args.ffn, args.workdir, args.repeats)
    Console().print(report(result))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
