"""A scaling study end to end: an IsoFLOP ladder, the fit, a prediction for a larger held-out
model at a larger budget, that model trained, and the prediction checked.

    python -m launch.scaling study --out runs/scaling-study    # tiny-llama, demo text: ~17 min of CPU
    python -m launch.scaling study --out DIR --budgets 1.5e10 3e10 --sizes 5 --min-steps 8 --eval-batches 3  # ~4 min

Steps (each re-runnable: the sweeps skip finished points):
1. `design` writes DIR/ladder.yaml for --recipe at --budgets (WSD cooldown branches, held-out
   evaluation); `launch.sweep` trains it into DIR/ladder/.
2. Approach 3 (L = E + A/N^alpha + B/D^beta) is fitted to the ladder's val_loss, with
   --bootstrap refits for a 95% interval. N is --count: non-embedding params by default
   (Kaplan et al. 2020), not Chinchilla's total: at these widths the V x h embedding and
   output matrices are 50-90% of a model and barely grow with depth, so total N hardly moves
   across the ladder while the loss does. DIR/fit.csv is the table fitted.
3. The target: the family's next size above every trained one, at --target-factor x the
   largest budget (extrapolated in N and in C). Its loss is predicted (value and the bootstrap
   interval), then it is trained (DIR/target/, the same overrides) and its val_loss compared.
4. DIR/study.json: the fit, the prediction, the measured loss, the error, and the ladder's
   compute with cooldown branches against separate runs.
"""

from __future__ import annotations

import csv
import json
from argparse import Namespace
from pathlib import Path

import numpy as np
import yaml

from launch.scaling import chinchilla
from launch.scaling.cli import _check, _interval
from launch.scaling.data import ScalingInputError, read_runs
from launch.scaling.design import PARAM_COUNTS, Size, budget_label, ladder, steps_at
from models.flops import training_flops_per_step

# lr 3e-3: at 1e-2 the default ladder's wider models came out worse than the narrower ones at
# equal tokens (alpha -3.5, a fit with no meaning); at 3e-3 every point's held-out loss is
# 0.2-0.4 lower (docs/scaling.md).
# tiny-llama's num_query_groups=8 (MHA: one head of 16 per group): its GQA ratio of 4 heads per group
# makes its widths step by 64 from 64, and at the ~1M tokens a CPU affords no size from 64 up is
# limited by its size: the ladder's smallest model won at every budget and alpha came out ~0
# (95% interval [-0.06, 0.06]). With heads of one group the family starts at width 16, where the
# parameter count limits the loss, and the fit finds an N term (docs/scaling.md).
CPU = ["runtime.spec=portable", "schedule.seq_length=64", "schedule.micro_batch_size=8",
       "schedule.global_batch_size=8", "schedule.warmup_steps=1", "logging.tensorboard=false",
       "logging.log_interval=5", "optimizer.lr=0.003", "optimizer.min_lr=0.0003"]
FAMILY = {"tiny-llama": ["model.num_query_groups=8"]}  # per recipe, after CPU (other recipes: none)


def cpu_defaults(recipe: str) -> list[str]:
    return [*CPU, *FAMILY.get(recipe, [])]


def _design(args, out: Path) -> Path:
    from launch.scaling.cli import build_parser
    from launch.scaling.design import design_command

    spec = out / "ladder.yaml"
    argv = ["design", "--recipe", args.recipe, "--budgets", *map(str, args.budgets), "--sizes", str(args.sizes),
            "--eval-batches", str(args.eval_batches), "--cooldown-fraction", str(args.cooldown_fraction),
            "--count", args.count, "--name", "ladder", "--out", str(spec), "--out-dir", str(out / "ladder"),
            *(["--min-steps", str(args.min_steps)] if args.min_steps else []),
            *[a for kv in [*cpu_defaults(args.recipe), *args.set] for a in ("--set", kv)]]
    design_command(build_parser().parse_args(argv))
    return spec


def _sweep(spec: Path) -> None:
    from data_pipeline.checks import WorkFailed
    from launch.sweeps import run as sweep

    if sweep.main([str(spec)]) != 0:
        raise WorkFailed(f"the sweep {spec} did not finish: see its points' launch.log")


def _compute(spec: Path) -> dict:
    """The ladder's training FLOPs with its cooldown branches and as separate runs."""
    from launch.sweeps.spec import expand_with_branches, load_spec

    points, _ = expand_with_branches(load_spec(str(spec)), spec_dir=spec.parent)
    def per_step(p):
        s = p.config.schedule
        return training_flops_per_step(p.config.model, s.seq_length, s.global_batch_size)
    separate = sum(p.config.schedule.train_steps * per_step(p) for p in points)
    skipped = sum((p.config.schedule.train_steps - p.config.schedule.wsd_cooldown_steps) * per_step(p)
                  for p in points if p.branch_of)
    return {"separate": separate, "with_branches": separate - skipped, "saved_fraction": skipped / separate,
            "points": len(points), "branches": sum(1 for p in points if p.branch_of)}


def _sizes(spec: Path, args) -> tuple[dict, list[Size], object]:
    """The ladder spec, the family's sizes (N counted as --count) and the runs' schedule."""
    from pretrain.config import apply_overrides
    from pretrain.recipes import get_recipe

    ladder_spec = yaml.safe_load(spec.read_text())
    config = apply_overrides(get_recipe(args.recipe), overrides=list(ladder_spec["overrides"]))
    sched = config.schedule
    return ladder_spec, ladder(config.model, sched.seq_length, sched.global_batch_size, count=args.count), sched


def _fit_table(results: Path, sizes: list[Size], out: Path) -> Path:
    """results.csv with `params` replaced by the N that --count names (the fit's N): the sweep
    writes total params; each row's `model` label names its size."""
    by_label = {s.label: s.n for s in sizes}
    with results.open(newline="") as f:
        reader = csv.DictReader(f)
        rows, header = list(reader), reader.fieldnames
    for row in rows:
        row["params"] = by_label[row["model"]]
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    return out


def _target(spec: Path, args) -> tuple[Path, dict]:
    """A one-point spec for the held-out model: the next size of the family's ladder above
    every ladder size (in N as --count counts it), at target-factor x the largest budget."""
    ladder_spec, sizes, sched = _sizes(spec, args)
    labels = {choice["label"] for choice in ladder_spec["grid"]["model"]}
    trained = max(s.n for s in sizes if s.label in labels)
    budget = args.target_factor * max(args.budgets)
    larger = [s for s in sizes if s.n > trained]
    if not larger:
        raise ScalingInputError(f"no size of {args.recipe} is larger than the ladder's largest (N {trained:,})")
    size = larger[0]
    target = {**ladder_spec, "name": "target", "out_dir": str(Path(args.out) / "target"),
              "grid": {"model": [{"label": size.label, **size.keys()}],
                       "budget": [{"label": budget_label(budget), "flops": budget}]}}
    target.pop("exclude", None)
    path = spec.parent / "target.yaml"
    path.write_text(yaml.safe_dump(target, sort_keys=False))
    steps = steps_at(size, budget)
    return path, {"label": size.label, "params": size.n, "total_params": size.params, "budget": budget, "steps": steps,
                  "tokens": steps * sched.seq_length * sched.global_batch_size}


def study_command(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = _design(args, out)
    _sweep(spec)
    table = _fit_table(out / "ladder" / "results.csv", _sizes(spec, args)[1], out / "fit.csv")
    runs = read_runs(table)
    if runs.loss_column != "val_loss":
        raise ScalingInputError("the ladder's results.csv has no val_loss (schedule.final_eval_steps)")
    _check(runs, Namespace(approach=3, results=table))  # `fit`'s own minimum, before the target trains
    best = chinchilla.fit(runs, args.grid)
    boots = chinchilla.bootstrap(runs, best, args.bootstrap, args.seed, lambda: None)
    target_spec, target = _target(spec, args)
    n, d = np.array([target["params"]], float), np.array([target["tokens"]], float)
    predicted = float(best.predict(n, d)[0])
    samples = [float(f.predict(n, d)[0]) for f in boots]
    lo, hi = (np.percentile(samples, [2.5, 97.5]).tolist() if samples else (None, None))
    _sweep(target_spec)
    with (out / "target" / "results.csv").open() as f:
        row = next(csv.DictReader(f))
    measured = float(row["val_loss"])
    doc = {"recipe": args.recipe, "params_count": args.count, "ladder_budgets": list(args.budgets), "n_points": len(runs),
           "fit": {k: v for k, v in best.values.items()}, "n_bootstrap": len(boots),
           "fit_ci95": {k: _interval(v, [b.values[k] for b in boots])["ci95"] for k, v in best.values.items()},
           "target": {**target, "predicted": predicted, "ci95": [lo, hi], "val_loss": measured,
                      "val_loss_se": float(row["val_loss_se"]) if row.get("val_loss_se") else None,
                      "error": measured - predicted, "relative_error": (measured - predicted) / measured,
                      "inside_ci95": lo is not None and lo <= measured <= hi},
           "compute": _compute(spec)}
    (out / "study.json").write_text(json.dumps(doc, indent=2) + "\n")
    t, c = doc["target"], doc["compute"]
    ci = doc["fit_ci95"]
    print(f"[study] fit on {len(runs)} ladder points (val_loss, N = {args.count} params): " +
          ", ".join(f"{k} {v:.4g}" for k, v in doc["fit"].items()) +
          "".join(f"; {k} 95% [{ci[k][0]:.3g}, {ci[k][1]:.3g}]" for k in ("alpha", "beta") if ci[k]))
    print(f"[study] target {t['label']} (N {t['params']:,} {args.count} params, {t['tokens']:,} tokens, {t['budget']:.3g} FLOPs): "
          f"predicted {predicted:.4f}" + (f" [95% {lo:.4f}, {hi:.4f}]" if lo is not None else "")
          + f", measured {measured:.4f}: error {t['error']:+.4f} ({t['relative_error']:+.1%}), "
          f"{'inside' if t['inside_ci95'] else 'outside'} the interval")
    print(f"[study] ladder compute: {c['with_branches']:.3g} FLOPs with {c['branches']} cooldown branches vs "
          f"{c['separate']:.3g} as separate runs ({c['saved_fraction']:.0%} saved); {out / 'study.json'}")
    _warn_flat(doc)
    return 0


def _warn_flat(doc: dict) -> None:
    """The law assumes loss falls with N and with D. A non-positive exponent means the ladder
    contradicts it (e.g. wider models worse at equal tokens: an LR tuned for none of them); an
    exponent whose bootstrap interval reaches 0 means the ladder cannot tell that term from a
    constant (the old default ladder: alpha 95% [-0.06, 0.06]), so the prediction rests on the
    other term alone. Either way the interval says little about a larger model."""
    flat = [k for k in ("alpha", "beta")
            if doc["fit"][k] <= 0 or (doc["fit_ci95"][k] is not None and doc["fit_ci95"][k][0] <= 0)]
    if flat:
        shown = ", ".join(f"{k} {doc['fit'][k]:.3g}" + (f" (95% [{doc['fit_ci95'][k][0]:.3g}, {doc['fit_ci95'][k][1]:.3g}])"
                                                          if doc["fit_ci95"][k] else "") for k in flat)
        print(f"[study] warning: {shown}: the ladder does not show its loss falling with "
              f"{' and '.join('N' if k == 'alpha' else 'D' for k in flat)}, so approach 3 does not describe it; fix "
              "the ladder (sizes small enough to be limited by N, the learning rate per width, more tokens) "
              "before trusting the prediction")


def add_parser(sub) -> None:
    p = sub.add_parser("study", help="ladder -> fit -> predict a larger held-out model -> train it -> compare")
    p.add_argument("--out", default="runs/scaling-study", help="output folder (default runs/scaling-study)")
    p.add_argument("--recipe", default="tiny-llama")
    p.add_argument("--budgets", type=float, nargs="+", default=[1e11, 3e11, 1e12],
                   help="the ladder's compute budgets (default 1e11 3e11 1e12: ~17 min of CPU time)")
    p.add_argument("--sizes", type=int, default=4)
    p.add_argument("--count", choices=PARAM_COUNTS, default="non-embedding",
                   help="the fit's N (default non-embedding: tiny models are mostly embedding; see design)")
    # 2, not 4: at 4 x 1e12 the target would train 1.4M tokens, 1.3 passes over the demo's
    # 1.07M-token training split; repeated tokens are worth less than new ones, which the ladder
    # (at most ~1.06 passes) cannot have measured.
    p.add_argument("--target-factor", type=float, default=2.0,
                   help="the held-out model's budget: this x the largest ladder budget (default 2)")
    p.add_argument("--eval-batches", type=int, default=32, help="held-out batches per point (default 32)")
    p.add_argument("--cooldown-fraction", type=float, default=0.2)
    p.add_argument("--min-steps", type=int, default=None)
    p.add_argument("--bootstrap", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grid", choices=sorted(chinchilla.GRIDS), default="coarse")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"more overrides for every run (after the CPU defaults: {' '.join(CPU)}; "
                        f"and per recipe: {FAMILY})")
    p.set_defaults(func=study_command)
