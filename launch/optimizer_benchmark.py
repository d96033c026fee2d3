"""Muon vs AdamW on CPU: step time (medians of repeats) and loss vs steps at each optimizer's
tuned LR from a small grid, on tiny-llama and the demo's real text (King James Bible).

    # step time: AdamW and Muon runs alternate (a shared machine's load drifts into both alike)
    python -m launch.optimizer_benchmark step-time --repeats 3 --steps 30 --warmup 5
    # loss vs steps: an LR grid per optimizer, 150 steps each, the plot beside docs/benchmarks.md's numbers
    python -m launch.optimizer_benchmark lr-grid --steps 150 \
        --adamw-lrs 1.5e-3 3e-3 6e-3 --muon-lrs 3.125e-4 6.25e-4 1.25e-3 2.5e-3 5e-3 1e-2 2e-2 4e-2 \
        --plot docs/images/muon_vs_adamw.png --json-out grid.json
    # (--resume reuses the runs already in grid.json: widening the grid runs only the new LRs)
    # below the recipe's min_lr (3e-4): lower Muon's floor, its AdamW parameters' floor kept
    python -m launch.optimizer_benchmark lr-grid --steps 150 --adamw-lrs 3e-3 \\
        --muon-lrs 7.8125e-5 1.5625e-4 3.125e-4 6.25e-4 --muon-min-lr 3e-5 --muon-adamw-min-lr 3e-4

Every run is `python -m pretrain --recipe tiny-llama` on one rank (torchrun, fp32) with the
same seed and data order; extra `key=value` overrides apply to all. Muon's `optimizer.lr` is
the LR of its hidden matrices (spectral scaling: update RMS about the LR); the parameters it
leaves to AdamW keep `--muon-adamw-lr` (default the recipe's AdamW LR, 3e-3), so the grid
varies one thing. The tuned LR is the one with the lowest mean training loss over the last
`--tail` steps: each batch is seen once (150 steps x 16 x 128 tokens is under one pass over
the corpus), so training loss there is loss on unseen text.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from data_pipeline.checks import nonnegative_int, positive_int, run_cli
from launch.benchmark import run_once, summarise
from pretrain.cli import resolve_config
from pretrain.config import ConfigError, validate_for_world, validate_inputs

RECIPE = "tiny-llama"


def optimizer_overrides(name: str, lr: float | None, muon_adamw_lr: float, muon_min_lr: float | None = None,
                        muon_adamw_min_lr: float | None = None) -> list[str]:
    """The overrides that select an optimizer (and its LR; None = the recipe's). Muon runs may
    lower their floor (`muon_min_lr`: optimizer.min_lr, which the recipe's 3e-4 would hold above
    a small LR) while their AdamW parameters keep theirs (`muon_adamw_min_lr`)."""
    out = [f"optimizer.name={name}"]
    if lr is not None:
        out.append(f"optimizer.lr={lr:g}")
    if name == "muon":
        out.append(f"optimizer.muon.adamw_lr={muon_adamw_lr:g}")
        out += [f"{key}={value:g}" for key, value in (("optimizer.min_lr", muon_min_lr),
                                                      ("optimizer.muon.adamw_min_lr", muon_adamw_min_lr))
                if value is not None]
    return out


def _optimizer_overrides(args: argparse.Namespace, name: str, lr: float | None) -> list[str]:
    return optimizer_overrides(name, lr, args.muon_adamw_lr, getattr(args, "muon_min_lr", None),
                               getattr(args, "muon_adamw_min_lr", None))


def step_time(args: argparse.Namespace) -> dict:
    """Median step time per optimizer over `repeats` runs, runs alternating."""
    per: dict[str, list[float]] = {"adamw": [], "muon": []}
    with tempfile.TemporaryDirectory(prefix="optbench-") as tmp:
        for i in range(args.repeats):
            for name in per:
                lr = args.muon_lr if name == "muon" else None
                records = run_once(RECIPE, 1, args.steps, args.overrides + _optimizer_overrides(args, name, lr),
                                   Path(tmp) / f"{name}{i}")
                per[name].append(summarise(records, args.warmup)["step_time_s"])
                print(f"repeat {i + 1}/{args.repeats} {name:>5}: median step {1000 * per[name][-1]:.1f} ms", flush=True)
    medians = {name: statistics.median(times) for name, times in per.items()}
    return {"mode": "step-time", "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
            "overrides": args.overrides, "median_step_s": medians, "muon_over_adamw": medians["muon"] / medians["adamw"],
            "per_repeat_step_s": per}


def tail_loss(losses: list[float], tail: int) -> float:
    """Mean of the last `tail` losses (all of them when fewer)."""
    return statistics.fmean(losses[-tail:])


def tuned(runs: list[dict], tail: int) -> dict:
    """The run with the lowest tail loss."""
    return min(runs, key=lambda r: tail_loss(r["losses"], tail))


def _earlier_runs(args: argparse.Namespace) -> list[dict]:
    """With --resume, the runs of an earlier --json-out of the same steps and overrides (a grid
    widened afterwards re-runs only its new LRs)."""
    path = Path(args.json_out) if args.resume and args.json_out else None
    if path is None or not path.exists():
        return []
    earlier = json.loads(path.read_text())
    same = (earlier.get("steps"), earlier.get("overrides"), earlier.get("muon_adamw_lr"),
            earlier.get("muon_min_lr"), earlier.get("muon_adamw_min_lr")) == (
        args.steps, args.overrides, args.muon_adamw_lr, getattr(args, "muon_min_lr", None),
        getattr(args, "muon_adamw_min_lr", None))
    return earlier["runs"] if same else []


def lr_grid(args: argparse.Namespace) -> dict:
    """Loss per step for every (optimizer, LR); the tuned LR of each optimizer."""
    earlier = {(r["optimizer"], r["lr"]): r for r in _earlier_runs(args)}
    runs = []
    with tempfile.TemporaryDirectory(prefix="optbench-") as tmp:
        for name, lrs in (("adamw", args.adamw_lrs), ("muon", args.muon_lrs)):
            for lr in lrs:
                if (name, lr) in earlier:
                    runs.append(earlier[(name, lr)])
                    continue
                records = run_once(RECIPE, 1, args.steps, args.overrides + _optimizer_overrides(args, name, lr),
                                   Path(tmp) / f"{name}-{lr:g}")
                losses = [r["loss"] for r in records]
                runs.append({"optimizer": name, "lr": lr, "losses": losses})
                print(f"{name:>5} lr {lr:g}: loss at step {len(losses)} {losses[-1]:.4f}, "
                      f"mean of last {args.tail} {tail_loss(losses, args.tail):.4f}", flush=True)
    best = {name: tuned([r for r in runs if r["optimizer"] == name], args.tail) for name in ("adamw", "muon")}
    summary = {name: {"lr": r["lr"], "tail_loss": tail_loss(r["losses"], args.tail),
                      "steps_to_adamw_tail": _steps_to(r["losses"], tail_loss(best["adamw"]["losses"], args.tail))}
               for name, r in best.items()}
    return {"mode": "lr-grid", "steps": args.steps, "tail": args.tail, "muon_adamw_lr": args.muon_adamw_lr,
            "muon_min_lr": args.muon_min_lr, "muon_adamw_min_lr": args.muon_adamw_min_lr,
            "overrides": args.overrides, "tuned": summary, "runs": runs}


def _steps_to(losses: list[float], target: float, window: int = 10) -> int | None:
    """First step whose trailing `window`-step mean loss is at or below `target` (None: never)."""
    for step in range(window, len(losses) + 1):
        if statistics.fmean(losses[step - window:step]) <= target:
            return step
    return None


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = {"adamw": "tab:blue", "muon": "tab:red"}
    for run in result["runs"]:
        best = result["tuned"][run["optimizer"]]["lr"] == run["lr"]
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], color=colors[run["optimizer"]],
                alpha=1.0 if best else 0.3, linewidth=1.6 if best else 0.8,
                label=f"{run['optimizer']} lr {run['lr']:g}" + (" (tuned)" if best else ""))
    ax.set_xlabel("step (16 x 128 tokens)")
    ax.set_ylabel("training loss")
    ax.set_ylim(top=min(8.5, ax.get_ylim()[1]))
    ax.set_title("tiny-llama on the demo text, CPU fp32: Muon vs AdamW, LR grid")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.optimizer_benchmark", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["step-time", "lr-grid"])
    p.add_argument("--steps", type=positive_int, default=30)
    p.add_argument("--warmup", type=nonnegative_int, default=5, help="step-time: steps excluded from the medians")
    p.add_argument("--repeats", type=positive_int, default=3, help="step-time: runs per optimizer")
    p.add_argument("--muon-lr", type=float, default=2e-2, help="step-time: Muon's LR")
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3])
    p.add_argument("--muon-lrs", type=float, nargs="+", default=[3.125e-4, 1.25e-3, 5e-3, 2e-2])
    p.add_argument("--muon-adamw-lr", type=float, default=3e-3, help="LR of the parameters Muon leaves to AdamW")
    p.add_argument("--muon-min-lr", type=float, help="Muon runs' optimizer.min_lr (default the recipe's)")
    p.add_argument("--muon-adamw-min-lr", type=float,
                   help="min LR of the parameters Muon leaves to AdamW (default optimizer.min_lr)")
    p.add_argument("--tail", type=positive_int, default=20, help="lr-grid: steps averaged to pick the tuned LR")
    p.add_argument("--plot", metavar="FILE.png", help="lr-grid: write the loss-vs-steps plot")
    p.add_argument("--json-out", metavar="FILE.json", help="also write the result here")
    p.add_argument("--resume", action="store_true",
                   help="lr-grid: reuse the runs already in --json-out (same steps and overrides)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides for every run")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)

    def check() -> int:  # every run's config, before the first starts
        if args.mode == "step-time" and args.steps <= args.warmup:
            raise ValueError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
        lrs = [args.muon_lr, args.muon_adamw_lr, *args.adamw_lrs, *args.muon_lrs]
        if any(not lr > 0 for lr in lrs) or any(v is not None and v < 0 for v in (args.muon_min_lr, args.muon_adamw_min_lr)):
            raise ValueError(f"learning rates must be positive (min LRs >= 0), got {lrs}, "
                             f"min {args.muon_min_lr}, {args.muon_adamw_min_lr}")
        for name, lr in (("adamw", args.adamw_lrs[0]), ("muon", args.muon_lrs[0])):
            config = resolve_config(RECIPE, None, args.overrides + _optimizer_overrides(args, name, lr)
                                    + [f"schedule.train_steps={args.steps}"])
            validate_for_world(config, 1)
            validate_inputs(config)
        return 0

    code = run_cli(check, bad_input=(ConfigError, ValueError))
    if code:
        return code
    result = step_time(args) if args.mode == "step-time" else lr_grid(args)
    if args.mode == "step-time":
        m = result["median_step_s"]
        print(f"median step time: adamw {1000 * m['adamw']:.1f} ms, muon {1000 * m['muon']:.1f} ms, "
              f"muon/adamw {result['muon_over_adamw']:.3f}")
    else:
        for name, t in result["tuned"].items():
            print(f"tuned {name}: lr {t['lr']:g}, mean loss of the last {args.tail} steps {t['tail_loss']:.4f}, "
                  f"reaches tuned AdamW's final loss at step {t['steps_to_adamw_tail']}")
        if args.plot:
            plot(result, Path(args.plot))
            print(f"wrote {args.plot}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
