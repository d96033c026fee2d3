"""muP learning-rate transfer: the tiny-llama family (2 layers, head_dim 16, ffn 2 x width) on the
demo corpus (real text), widths x an LR grid, standard parametrization and muP (base = the
smallest width). Under muP the best LR should stay put across widths; under the standard one it
moves (Yang et al. 2022, figure 1).

    PYTHONPATH=. nice -n 19 python -m launch.mup_transfer --widths 64 128 256 512 \
        --lrs 0.001 0.004 0.016 0.064 --steps 30 --out launch/examples/mup_transfer

Each point is one single-process run through pretrain.loop (pretrain.mup_coord_check.train_width,
no hooks); its loss is the mean training loss of the last 5 steps (one seed; every run reads the
same batches in the same order). Writes OUT/results.json and OUT/lr_transfer.png and prints, per
width, the best LR of each parametrization.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

from pretrain.mup_coord_check import HEAD_DIM, train_width, width_overrides

TAIL = 5  # steps averaged into a run's loss


def run_grid(widths: list[int], lrs: list[float], *, steps: int, out: Path) -> dict:
    """{"sp"|"mup": {width: {lr: loss}}}; a diverged run's loss is NaN/inf as logged."""
    data = ["data.demo=true", "data.mock=false", f"data.cache_dir={out / 'data_cache'}"]
    results: dict = {"sp": {}, "mup": {}}
    for kind in results:
        for width in widths:
            for lr in lrs:
                overrides = width_overrides(width, mup=kind == "mup", base_width=min(widths), steps=steps, lr=lr,
                                            layers=2, run_dir=str(out / "runs" / f"{kind}-{width}-{lr:g}"),
                                            data=data) + ["schedule.warmup_steps=5"]
                losses = train_width(overrides, hooks=False)["losses"]
                # A run that stopped early (a NaN loss stops it: checkpoint.on_nan=stop) diverged.
                loss = sum(losses[-TAIL:]) / TAIL if len(losses) == steps else math.inf
                results[kind].setdefault(str(width), {})[f"{lr:g}"] = loss
                print(f"{kind} width {width} lr {lr:g}: loss {results[kind][str(width)][f'{lr:g}']:.4f}", flush=True)
    return results


def best_lrs(results: dict) -> dict:
    """Per parametrization and width, the grid LR with the lowest finite loss."""
    best = {}
    for kind, per_width in results.items():
        best[kind] = {}
        for width, per_lr in per_width.items():
            finite = {lr: loss for lr, loss in per_lr.items() if math.isfinite(loss)}
            best[kind][width] = min(finite, key=finite.get) if finite else None
    return best


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, (kind, title) in zip(axes, (("sp", "standard parametrization"), ("mup", "muP (base width 64)")),
                                 strict=True):
        for width, per_lr in results[kind].items():
            lrs = sorted(per_lr, key=float)
            ax.plot([float(lr) for lr in lrs], [per_lr[lr] for lr in lrs], marker="o", label=f"width {width}")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"training loss (mean of last {TAIL} steps)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.mup_transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.001, 0.004, 0.016, 0.064])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("runs/mup_transfer"))
    args = parser.parse_args(argv)
    bad = [w for w in args.widths if w <= 0 or w % HEAD_DIM]
    if bad or len(args.widths) < 2 or len(args.lrs) < 2 or args.steps <= TAIL or min(args.lrs) <= 0:
        print(f"error: need >= 2 widths, each a positive multiple of {HEAD_DIM} (got {args.widths}), >= 2 positive "
              f"--lrs (got {args.lrs}) and --steps > {TAIL} (got {args.steps})", file=sys.stderr)
        return 2
    widths, lrs = sorted(set(args.widths)), sorted(set(args.lrs))
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_grid(widths, lrs, steps=args.steps, out=args.out)
    best = best_lrs(results)
    (args.out / "results.json").write_text(json.dumps({"losses": results, "best_lr": best}, indent=1))
    plot(results, args.out / "lr_transfer.png")
    for kind in ("sp", "mup"):
        print(f"best lr {kind:>3}: " + ", ".join(f"width {w}: {lr}" for w, lr in best[kind].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
