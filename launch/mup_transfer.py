"""muP learning-rate transfer: the tiny-llama family (2 layers, head_dim 16, ffn 2 x width) on the
demo corpus (real text), widths x an LR grid, standard parametrization and muP (base = the
smallest width). Under muP the best LR should stay put across widths; under the standard one it
moves (Yang et al. 2022, figure 1).

    PYTHONPATH=. nice -n 19 python -m launch.mup_transfer --widths 64 128 256 512 \
        --lrs 0.002 0.008 0.032 0.128 --steps 15 --seeds 3 --out runs/mup_transfer

Each run is one single-process run through pretrain.loop (pretrain.mup_coord_check.train_width,
no hooks); its loss is the held-out validation loss after the last step
(schedule.final_eval_steps: the whole validation split of the demo corpus, never training
batches). Each point is trained with --seeds values of runtime.seed (it sets the init and the
training-batch order); a point's loss is the mean over seeds with the standard error over seeds.
A run that diverged (a non-finite loss, or it stopped early) makes its point inf. The best LR of
a width is the grid LR with the lowest mean, and it is "separated" when the runner-up's mean is
higher by more than the two SEs combined (sqrt(se1^2 + se2^2)). Writes OUT/results.json (per-seed
losses, means, SEs, best LRs) and OUT/lr_transfer.png (means with SE bars) and prints, per
width, the best LR of each parametrization. Results: docs/benchmarks.md (muP); a short run's
held-out loss can catch a transient spike of its last update, so read the per-seed values too.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Optional

from launch.sweeps.results import read_heldout
from pretrain.mup_coord_check import HEAD_DIM, train_width, width_overrides

WARMUP = 5  # steps of linear warmup before the constant LR
# Held-out batches of 4 x 64 tokens: the demo corpus's validation split (data.split 969,30,1)
# holds 405 samples of 64 tokens before its documents repeat, so 101 batches read all of it once
# (the config validation refuses more). Reading all of it keeps the held-out documents the same
# whatever runtime.seed, which also shuffles them.
EVAL_BATCHES = 101
FIRST_SEED = 1234  # the recipe's runtime.seed; seeds are FIRST_SEED, FIRST_SEED + 1, ...


def run_point(kind: str, width: int, lr: float, seed: int, *, base_width: int, steps: int, out: Path) -> float:
    """One run's held-out loss; inf when it diverged (non-finite, or stopped before `steps`)."""
    run_dir = out / "runs" / f"{kind}-{width}-{lr:g}-seed{seed}"
    # metrics.jsonl is appended to: a record left by an earlier benchmark in this folder must not
    # stand in for this run's held-out loss.
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    data = ["data.demo=true", "data.mock=false", f"data.cache_dir={out / 'data_cache'}"]
    overrides = width_overrides(width, mup=kind == "mup", base_width=base_width, steps=steps, lr=lr, layers=2,
                                run_dir=str(run_dir), data=data)
    overrides += [f"schedule.warmup_steps={WARMUP}", f"schedule.final_eval_steps={EVAL_BATCHES}",
                  f"runtime.seed={seed}"]
    try:
        losses = train_width(overrides, hooks=False)["losses"]
    except FloatingPointError:  # checkpoint.on_nan=stop: a non-finite loss or gradient ends the run
        return math.inf
    heldout = read_heldout(run_dir / "metrics.jsonl")
    if len(losses) != steps or heldout is None or heldout["step"] != steps:
        return math.inf
    return heldout["val_loss"] if math.isfinite(heldout["val_loss"]) else math.inf


def run_grid(widths: list[int], lrs: list[float], *, steps: int, seeds: int, out: Path) -> dict:
    """{"sp"|"mup": {width: {lr: [held-out loss per seed]}}}. Seeds are the outer loop, so an
    interrupted benchmark has printed whole grids for the seeds it finished."""
    results: dict = {"sp": {}, "mup": {}}
    for seed in range(FIRST_SEED, FIRST_SEED + seeds):
        for kind in results:
            for width in widths:
                for lr in lrs:
                    loss = run_point(kind, width, lr, seed, base_width=min(widths), steps=steps, out=out)
                    results[kind].setdefault(str(width), {}).setdefault(f"{lr:g}", []).append(loss)
                    print(f"{kind} width {width} lr {lr:g} seed {seed}: held-out loss {loss:.4f}", flush=True)
    return results


def mean_se(values: list[float]) -> tuple[float, Optional[float]]:
    """Mean and standard error over seeds (sample std / sqrt(n); None from one seed); a
    diverged seed (inf) makes both inf."""
    if not all(math.isfinite(v) for v in values):
        return math.inf, math.inf
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    return mean, statistics.stdev(values, mean) / math.sqrt(len(values))


def summarize(results: dict) -> dict:
    """{"sp"|"mup": {width: {lr: {"mean": m, "se": s}}}} from the per-seed losses."""
    return {kind: {width: {lr: dict(zip(("mean", "se"), mean_se(values), strict=True))
                           for lr, values in per_lr.items()}
                   for width, per_lr in per_width.items()}
            for kind, per_width in results.items()}


def best_lrs(stats: dict) -> dict:
    """Per parametrization and width, the grid LR with the lowest finite mean (None when every
    point diverged), its mean and SE, the runner-up LR and whether the gap exceeds the combined
    SE (True when the runner-up diverged; None when an SE is unknown, i.e. one seed)."""
    best: dict = {}
    for kind, per_width in stats.items():
        best[kind] = {}
        for width, per_lr in per_width.items():
            ranked = sorted((lr for lr in per_lr if math.isfinite(per_lr[lr]["mean"])),
                            key=lambda lr: per_lr[lr]["mean"])
            if not ranked:
                best[kind][width] = None
                continue
            top = per_lr[ranked[0]]
            entry = {"lr": ranked[0], "mean": top["mean"], "se": top["se"], "runner_up": None, "separated": True}
            if len(ranked) > 1:
                second = per_lr[ranked[1]]
                entry["runner_up"] = ranked[1]
                if top["se"] is None or second["se"] is None:
                    entry["separated"] = None
                else:
                    entry["separated"] = second["mean"] - top["mean"] > math.hypot(top["se"], second["se"])
            best[kind][width] = entry
    return best


def plot(stats: dict, path: Path, seeds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Own y axes: the standard runs' losses at large LR (up to ~20) would flatten muP's curves.
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    base = min(int(w) for w in stats["mup"])
    for ax, (kind, title) in zip(axes, (("sp", "standard parametrization"), ("mup", f"muP (base width {base})")),
                                 strict=True):
        for width, per_lr in stats[kind].items():
            lrs = sorted(per_lr, key=float)
            # A diverged point (inf) is left off the line; errorbar cannot draw it.
            shown = [lr for lr in lrs if math.isfinite(per_lr[lr]["mean"])]
            ax.errorbar([float(lr) for lr in shown], [per_lr[lr]["mean"] for lr in shown],
                        yerr=[per_lr[lr]["se"] or 0.0 for lr in shown], marker="o", capsize=3, label=f"width {width}")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes:
        ax.set_ylabel(f"held-out loss (mean ± SE over {seeds} seeds)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def format_best(best: dict) -> str:
    """One line per parametrization and width: best LR, mean ± SE, runner-up, separation."""
    lines = []
    for kind in ("sp", "mup"):
        for width, entry in best[kind].items():
            if entry is None:
                lines.append(f"best lr {kind:>3} width {width:>5}: none (every LR diverged)")
                continue
            se = f" ± {entry['se']:.4f}" if entry["se"] is not None else ""
            sep = {True: "yes", False: "no", None: "n/a (one seed)"}[entry["separated"]]
            lines.append(f"best lr {kind:>3} width {width:>5}: {entry['lr']} ({entry['mean']:.4f}{se}); runner-up "
                         f"{entry['runner_up']}; separated by more than the combined SE: {sep}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.mup_transfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.002, 0.008, 0.032, 0.128])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--seeds", type=int, default=3, help="runs per point (runtime.seed 1234, 1235, ...)")
    parser.add_argument("--out", type=Path, default=Path("runs/mup_transfer"))
    args = parser.parse_args(argv)
    bad = [w for w in args.widths if w <= 0 or w % HEAD_DIM]
    if (bad or len(args.widths) < 2 or len(args.lrs) < 2 or args.steps <= WARMUP or min(args.lrs) <= 0
            or args.seeds < 1):
        print(f"error: need >= 2 widths, each a positive multiple of {HEAD_DIM} (got {args.widths}), >= 2 positive "
              f"--lrs (got {args.lrs}), --steps > {WARMUP} (got {args.steps}) and --seeds >= 1 (got {args.seeds})",
              file=sys.stderr)
        return 2
    widths, lrs = sorted(set(args.widths)), sorted(set(args.lrs))
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_grid(widths, lrs, steps=args.steps, seeds=args.seeds, out=args.out)
    stats = summarize(results)
    best = best_lrs(stats)
    (args.out / "results.json").write_text(json.dumps(
        {"loss": "held-out val_loss after the last step", "eval_batches": EVAL_BATCHES, "seeds": args.seeds,
         "per_seed": results, "stats": stats, "best_lr": best}, indent=1))
    plot(stats, args.out / "lr_transfer.png", args.seeds)
    print(format_best(best))
    return 0


if __name__ == "__main__":
    sys.exit(main())
