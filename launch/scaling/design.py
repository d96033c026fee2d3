"""IsoFLOP sweep design: from a recipe's model family and compute budgets, a sweep spec.

    python -m launch.scaling design --recipe tiny-llama --budgets 2e12 4e12 8e12 --dry-run
    python -m launch.scaling design --recipe llama3-8b --budgets 1e20 3e20 1e21 --sizes 5 --out isoflop.yaml
    python -m launch.sweep isoflop.yaml

Sizes come from the family's shape rules: the recipe's head size, query-group ratio and
FFN/hidden ratio are kept, the width grows by whole groups of heads and the depth follows the
recipe's hidden/layers ratio (and half and twice it, for a finer ladder). Parameters and
FLOPs are models/flops.py's (the training metrics' formula). Each budget gets --sizes sizes
spread in log N around its compute-optimal size (D = --tokens-per-param x N, Chinchilla's 20
by default), among the sizes that get at least --min-steps steps at it. The spec's grid is
sizes x budgets less the pairs no budget chose (`exclude`); each budget is a `flops` choice,
so launch.sweep gives every point train_steps = round(C / training FLOPs per step), and with
`decay_style: wsd` each size trains one stable run to its largest budget and branches a
cooldown for each smaller one. Every point also evaluates a fixed held-out set at its end
(schedule.final_eval_steps), the `val_loss` that `launch.scaling fit` fits.
Bad input (unknown recipe, budgets too small for any size, ...): one line, exit 2.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Optional

import yaml

from launch.scaling.data import ScalingInputError
from models.config import ModelConfig
from models.flops import non_embedding_params, total_params, training_flops_per_step

MAX_LAYERS = 256
MAX_HEAD_GROUPS = 48  # widths up to 48 x the query-group ratio of heads (llama3: 192 heads)
DEPTH_FACTORS = (0.5, 1.0, 2.0)  # of the recipe's hidden/layers ratio
# What N counts: "non-embedding" (Kaplan et al. 2020) or "total" (Chinchilla, Hoffmann et al.
# 2022). Chinchilla's models are >= 44M params, where embeddings are a small share; at tiny
# widths they are most of the model, so sizes spread in total N are not spread in capacity.
PARAM_COUNTS = ("non-embedding", "total")


@dataclasses.dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int
    groups: Optional[int]
    ffn: int
    params: int
    flops_per_step: float
    n: int  # the N that sizes are spaced and fitted by (PARAM_COUNTS)

    @property
    def label(self) -> str:
        return f"L{self.layers}-h{self.hidden}"

    def keys(self) -> dict:
        keys = {"model.num_layers": self.layers, "model.hidden_size": self.hidden,
                "model.num_attention_heads": self.heads, "model.ffn_hidden_size": self.ffn}
        if self.groups is not None:
            keys["model.num_query_groups"] = self.groups
        return keys


def ladder(model: ModelConfig, seq: int, gbs: int, tp: int = 1, layer_multiple: int = 1,
           count: str = "non-embedding") -> list[Size]:
    """The family's sizes, smallest first by N (`count`; one per N: the one nearest the
    recipe's aspect ratio); query groups a multiple of `tp`, layers of `layer_multiple` (the
    recipe's layout must still divide them)."""
    unit = model.hidden_size // model.num_attention_heads  # hidden per head (kv_channels kept as is)
    ratio = model.num_attention_heads // model.query_groups  # heads per query group, kept
    aspect = model.hidden_size / model.num_layers
    ffn_ratio = model.ffn_hidden_size / model.hidden_size
    by_params: dict[int, tuple[float, Size]] = {}
    for n_groups in range(tp, MAX_HEAD_GROUPS + 1, tp):
        heads = n_groups * ratio
        hidden = heads * unit
        ffn = max(unit, round(ffn_ratio * hidden / unit) * unit)  # llama3-8b: 14336 = 3.5 x 4096
        for factor in DEPTH_FACTORS:
            layers = layer_multiple * max(1, min(MAX_LAYERS, round(hidden / (aspect * factor) / layer_multiple)))
            groups = n_groups if model.num_query_groups is not None else None
            shaped = model.model_copy(update=dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                                  num_query_groups=groups, ffn_hidden_size=ffn))
            size = Size(layers, hidden, heads, groups, ffn, total_params(shaped),
                        training_flops_per_step(shaped, seq, gbs),
                        total_params(shaped) if count == "total" else non_embedding_params(shaped))
            skew = abs(math.log(hidden / layers / aspect))
            if size.n not in by_params or skew < by_params[size.n][0]:
                by_params[size.n] = (skew, size)
    return [size for _, size in sorted(by_params.values(), key=lambda item: item[1].n)]


def steps_at(size: Size, budget: float) -> int:
    """launch.sweep's rule for a `flops` choice (launch/sweeps/spec.py): the nearest whole step."""
    return max(1, round(budget / size.flops_per_step))


def optimal_size(sizes: list[Size], budget: float, tokens_per_param: float, tokens_per_step: int) -> float:
    """The parameter count N whose D = tokens_per_param x N spends the budget (interpolated in
    log N along the ladder)."""
    def spent(s: Size) -> float:
        return s.flops_per_step / tokens_per_step * tokens_per_param * s.n

    logs = [(math.log(spent(s)), math.log(s.n)) for s in sizes]
    target = math.log(budget)
    if target <= logs[0][0]:
        return math.exp(logs[0][1] + (target - logs[0][0]) / 2)  # C ~ N^2 below the ladder
    for (c0, n0), (c1, n1) in zip(logs, logs[1:]):
        if target <= c1:
            return math.exp(n0 + (n1 - n0) * (target - c0) / (c1 - c0))
    return math.exp(logs[-1][1] + (target - logs[-1][0]) / 2)


def choose_sizes(sizes: list[Size], budget: float, count: int, *, min_steps: int, spread: float,
                 tokens_per_param: float, tokens_per_step: int, family: str) -> list[Size]:
    """A budget's `count` sizes: log-spaced from N_opt / spread to N_opt x spread (N_opt: the
    size whose D = tokens_per_param x N spends the budget), each the nearest size not yet
    taken among those with at least min_steps steps at this budget."""
    feasible = [s for s in sizes if steps_at(s, budget) >= min_steps]
    if not feasible:
        need = sizes[0].flops_per_step * min_steps
        raise ScalingInputError(f"budget {budget:.3g} FLOPs is too small for any size of {family}: the smallest "
                                f"({sizes[0].label}, {sizes[0].params:,} params) gets {steps_at(sizes[0], budget)} "
                                f"step(s), fewer than --min-steps {min_steps}; give budgets >= {need:.3g} FLOPs")
    if len(feasible) < 2:
        raise ScalingInputError(f"budget {budget:.3g} FLOPs leaves only 1 size of {family} with >= {min_steps} "
                                "steps, and an IsoFLOP curve needs 2; raise it or lower --min-steps")
    centre = math.log(optimal_size(sizes, budget, tokens_per_param, tokens_per_step))
    chosen: list[Size] = []
    for i in range(min(count, len(feasible))):
        target = centre + math.log(spread) * (2 * i / (count - 1) - 1)
        left = [s for s in feasible if s not in chosen]
        chosen.append(min(left, key=lambda s: abs(math.log(s.n) - target)))
    return sorted(chosen, key=lambda s: s.n)


def budget_label(budget: float) -> str:
    return "C" + f"{budget:.3g}".replace("+", "")


def build_spec(args, base_overrides: list[str], per_budget: dict[float, list[Size]]) -> dict:
    """Grid sizes x budgets, less the (size, budget) pairs no budget chose (`exclude`)."""
    name = args.name or f"isoflop-{args.recipe}"
    sizes = sorted({s for chosen in per_budget.values() for s in chosen}, key=lambda s: s.n)
    budgets = sorted(per_budget)
    exclude = [{"model": s.label, "budget": budget_label(c)} for c in budgets for s in sizes
               if s not in per_budget[c]]
    return {
        "name": name,
        "recipe": args.recipe,
        "launcher": "local",
        "out_dir": args.out_dir or f"runs/sweeps/{name}",
        "overrides": base_overrides,
        "grid": {
            "model": [{"label": s.label, "gpus": args.gpus, **s.keys()} for s in sizes],
            "budget": [{"label": budget_label(c), "flops": float(c)} for c in budgets],
        },
        **({"exclude": exclude} if exclude else {}),
    }


def _overrides(args, out_dir: str) -> list[str]:
    """The sweep's overrides: WSD (unless --set chose another schedule), the held-out
    evaluation, a shared data cache, then --set's, which win."""
    given = {item.split("=", 1)[0] for item in args.set}
    pairs = [f"data.cache_dir={out_dir}/data_cache", "schedule.eval_interval=0",
             f"schedule.final_eval_steps={args.eval_batches}"]
    if not given & {"schedule.decay_style", "schedule.wsd_decay_steps", "schedule.wsd_decay_fraction"}:
        pairs += ["schedule.decay_style=wsd", f"schedule.wsd_decay_fraction={args.cooldown_fraction}"]
    return pairs + list(args.set)


def _check_args(args) -> list[float]:
    for item in args.set:
        if "=" not in item:
            raise ScalingInputError(f"--set {item!r}: not key=value (e.g. --set schedule.seq_length=64)")
    if args.sizes < 2:
        raise ScalingInputError(f"--sizes {args.sizes}: an IsoFLOP curve needs at least 2 sizes per budget (e.g. 5)")
    if args.eval_batches < 1:
        raise ScalingInputError(f"--eval-batches {args.eval_batches}: must be >= 1 (the held-out loss is fitted)")
    if not 0 < args.cooldown_fraction <= 1:
        raise ScalingInputError(f"--cooldown-fraction {args.cooldown_fraction}: must be in (0, 1] (e.g. 0.2)")
    if args.spread <= 1 or args.tokens_per_param <= 0:
        raise ScalingInputError("--spread must be > 1 and --tokens-per-param > 0 (e.g. 4 and 20)")
    budgets = sorted(set(args.budgets))
    bad = [c for c in budgets if not math.isfinite(c) or c <= 0]
    if bad:
        raise ScalingInputError(f"--budgets: {bad[0]:g} is not a positive number of FLOPs (e.g. --budgets 1e12 4e12)")
    return budgets


def design_command(args) -> int:
    """Write (or with --dry-run print) the IsoFLOP sweep spec; every point is validated by
    launch.sweep's own loader before anything is written."""
    from launch.sweeps.branches import compute_summary
    from launch.sweeps.spec import SweepSpecError, expand_with_branches, load_spec
    from pretrain.config import ConfigError, apply_overrides
    from pretrain.recipes import get_recipe

    budgets = _check_args(args)
    name = args.name or f"isoflop-{args.recipe}"
    out_dir = args.out_dir or f"runs/sweeps/{name}"
    overrides = _overrides(args, out_dir)
    try:
        config = apply_overrides(get_recipe(args.recipe), overrides=overrides)
    except (ConfigError, ValueError) as exc:
        raise ScalingInputError(f"--recipe {args.recipe}: {str(exc).splitlines()[0]}") from None
    sched, layout = config.schedule, config.parallel
    args.gpus = args.gpus or layout.tensor_parallel * layout.pipeline_parallel * layout.context_parallel
    min_steps = args.min_steps or max(10, 2 * sched.warmup_steps)
    sizes = ladder(config.model, sched.seq_length, sched.global_batch_size, tp=layout.tensor_parallel,
                   layer_multiple=layout.pipeline_parallel * (layout.virtual_pipeline or 1), count=args.count)
    per_budget = {c: choose_sizes(sizes, c, args.sizes, min_steps=min_steps, spread=args.spread,
                                  tokens_per_param=args.tokens_per_param,
                                  tokens_per_step=sched.seq_length * sched.global_batch_size, family=args.recipe)
                  for c in budgets}
    spec = build_spec(args, overrides, per_budget) | {"name": name, "out_dir": out_dir}
    out = Path(args.out or f"{name}.yaml")
    text = (f"# python -m launch.scaling design --recipe {args.recipe} --budgets "
            f"{' '.join(f'{c:g}' for c in budgets)} --sizes {args.sizes}\n"
            + yaml.safe_dump(spec, sort_keys=False))
    with tempfile.TemporaryDirectory() as tmp:  # launch.sweep's loader is the judge
        check = Path(tmp) / out.name
        check.write_text(text)
        try:
            points, groups = expand_with_branches(load_spec(str(check)), spec_dir=out.resolve().parent)
        except SweepSpecError as exc:
            raise ScalingInputError(f"the designed spec does not validate: {str(exc).splitlines()[0]} "
                                    "(adjust --set, --min-steps or the budgets)") from None
    print_table(points, sched.seq_length * sched.global_batch_size)
    for line in compute_summary(points, groups) if groups else []:
        print(f"[design] {line}")
    if args.dry_run:
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"[design] wrote {out}: {len(points)} points ({len(spec['grid']['model'])} sizes, {len(budgets)} budgets); "
          "run it with "
          f"python -m launch.sweep {out}")
    return 0


def print_table(points: list, tokens_per_step: int) -> None:
    """One line per point: budget, size, params, tokens, steps, the compute it spends."""
    print(f"{'budget':>10} {'size':>12} {'params':>12} {'non-emb':>11} {'tokens':>12} {'steps':>7} {'compute':>10} "
          f"{'vs budget':>9}  {'run'}")
    for p in sorted(points, key=lambda p: (p.budget_flops, total_params(p.config.model))):
        sched = p.config.schedule
        spent = sched.train_steps * training_flops_per_step(p.config.model, sched.seq_length, sched.global_batch_size)
        how = f"branch of {p.branch_of}" if p.branch_of else "full run"
        print(f"{p.budget_flops:>10.3g} {p.labels['model']:>12} {total_params(p.config.model):>12,} "
              f"{non_embedding_params(p.config.model):>11,} "
              f"{sched.train_steps * tokens_per_step:>12,} {sched.train_steps:>7} {spent:>10.3g} "
              f"{spent / p.budget_flops - 1:>+8.1%}  {how}")


def add_parser(sub) -> None:
    p = sub.add_parser("design", help="an IsoFLOP sweep spec for launch.sweep from a recipe and budgets")
    p.add_argument("--recipe", required=True, help="the model family (a pretrain recipe, e.g. tiny-llama)")
    p.add_argument("--budgets", type=float, nargs="+", required=True, metavar="FLOPS",
                   help="training compute budgets (models/flops.py FLOPs), e.g. 1e12 4e12")
    p.add_argument("--sizes", type=int, default=5, help="model sizes per budget (default 5)")
    p.add_argument("--out", help="spec YAML to write (default <name>.yaml)")
    p.add_argument("--name", help="sweep name (default isoflop-<recipe>)")
    p.add_argument("--out-dir", help="the sweep's output folder (default runs/sweeps/<name>)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every point (repeatable), e.g. schedule.seq_length=64")
    p.add_argument("--gpus", type=int, default=None,
                   help="world size of every point (default the recipe's TP x PP x CP, DP 1)")
    p.add_argument("--min-steps", type=int, default=None,
                   help="fewest steps a size may get at the smallest budget (default max(10, 2 x warmup))")
    p.add_argument("--spread", type=float, default=4.0,
                   help="each budget's sizes span N_opt/spread .. N_opt x spread (default 4)")
    p.add_argument("--count", choices=PARAM_COUNTS, default="non-embedding",
                   help="what N counts when spacing sizes (default non-embedding, Kaplan's: at tiny widths the "
                        "embeddings dominate total params; total is Chinchilla's)")
    p.add_argument("--tokens-per-param", type=float, default=20.0,
                   help="the D/N ratio that centres the sizes (Chinchilla: 20)")
    p.add_argument("--cooldown-fraction", type=float, default=0.2, help="WSD cooldown share of each run (default 0.2)")
    p.add_argument("--eval-batches", type=int, default=16,
                   help="held-out batches each point evaluates at its end (schedule.final_eval_steps, default 16)")
    p.add_argument("--dry-run", action="store_true", help="print the table; write nothing")
    p.set_defaults(func=design_command)
