"""The sweep spec (YAML) and its expansion into points: one resolved, validated training
config per combination of the grid's axes.

    name: tiny-scaling                   # required
    recipe: tiny-llama                   # required (pretrain.recipes)
    config: null                         # optional YAML overrides file, as for pretrain --config
    out_dir: runs/sweeps/tiny-scaling    # default runs/sweeps/<name>
    launcher: local                      # local (launch.local) or slurm (launch.slurm, job arrays)
    overrides: [data.mock=true, schedule.train_steps=10]   # every point (list or mapping)
    grid:                                # the cartesian product of the axes
      model:                             # an axis: a list of choices, each a mapping of
        - {label: small, model.num_layers: 2, model.hidden_size: 64}   # config keys plus
        - {label: base}                                                # label/gpus/tokens
      layout:
        - {gpus: 1}
        - {gpus: 2, parallel.tensor_parallel: 2}
      lr: {optimizer.lr: [1.0e-3, 3.0e-3]}   # shorthand: one key, a list of values
      budget: {tokens: [1.0e6, 4.0e6]}       # token budget -> schedule.train_steps
      # or a compute budget: {flops: [1.0e15, 4.0e15]} -> steps of models/flops.py's FLOPs
    slurm: {partition: debug, time: "30", cpu: true}   # launcher: slurm only
    cooldown_branches: true              # wsd budgets: one stable run + branches (sweeps/branches.py)
    exclude: [{model: base, lr: lr0.003}]   # grid points left out, by their axes' labels

Special choice keys: `label` (the choice's name in the point's name), `gpus` (world size,
default 1), `tokens` (train_steps = ceil(tokens / (global batch x seq))), `flops` (a compute
budget: train_steps = round(flops / training FLOPs per step of the point's model, the
formula of models/flops.py), so a grid of sizes x budgets is an IsoFLOP sweep; see
`python -m launch.scaling design`). Every other key
is a config key, checked like a `key=value` override; every point is validated against
its world size before anything runs. Errors name the key.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from models.flops import training_flops_per_step
from models.suggest import did_you_mean
from pretrain.config import ConfigError, ExperimentConfig, apply_overrides, validate_for_world
from pretrain.recipes import get_recipe

SPECIAL_KEYS = ("label", "gpus", "tokens", "flops")
BUDGET_KEYS = ("tokens", "flops")  # the axis holding either is the sweep's budget axis


class SweepSpecError(ValueError):
    """A malformed sweep spec; the message names the key."""


class SlurmOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    partition: str
    time: str
    account: Optional[str] = None
    cpu: bool = False  # CPU ranks over gloo (e.g. the CI cluster): --cpu --ntasks-per-node gpus
    gpus_per_node: int = Field(default=8, gt=0)
    args: list[str] = []  # more launch.slurm arguments, e.g. ["--container-image", "..."]


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1)
    recipe: str
    config: Optional[str] = None
    out_dir: Optional[str] = None
    launcher: Literal["local", "slurm"] = "local"
    overrides: Union[list[str], dict[str, Any]] = []
    grid: dict[str, Union[list[dict[str, Any]], dict[str, list[Any]]]] = Field(min_length=1)
    slurm: Optional[SlurmOptions] = None
    # WSD points that differ only in their token budget: one stable run, cooldown branches for
    # the smaller budgets (launch/sweeps/branches.py); false: every point a separate run.
    cooldown_branches: bool = True
    # Grid points left out: each entry maps axes to choice labels, and a point whose labels
    # match every entry's is not run (an IsoFLOP design trains each size at some budgets only).
    exclude: list[dict[str, str]] = []


@dataclasses.dataclass(frozen=True)
class Point:
    name: str  # unique, filesystem-safe: the labels of its choices joined by "_"
    labels: dict[str, str]  # axis -> choice label
    gpus: int
    overrides: tuple[str, ...]  # key=value, everything on top of recipe (+ config file)
    config: ExperimentConfig  # resolved and validated
    run_dir: Path
    branch_of: Optional[str] = None  # a cooldown branch of this point's stable run (its name)
    budget_flops: Optional[float] = None  # the compute budget its `flops` choice asked for


def format_value(value: Any) -> str:
    """A value as `python -m pretrain key=value` parses it back (int, float, else YAML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _as_pairs(items: Union[list[str], dict[str, Any]], where: str) -> list[str]:
    if isinstance(items, dict):
        return [f"{k}={format_value(v)}" for k, v in items.items()]
    for item in items:
        if "=" not in item:
            raise SweepSpecError(f"{where}: {item!r} is not key=value (e.g. schedule.train_steps=50)")
    return list(items)


def _label(choice: dict[str, Any]) -> str:
    if "label" in choice:
        return str(choice["label"])
    parts = [f"{k.split('.')[-1]}{format_value(v)}" for k, v in choice.items()]
    return "-".join(parts) or "base"


def expand_axis(axis: str, raw: Union[list[dict], dict[str, list]]) -> list[dict[str, Any]]:
    """An axis as a list of choices; the one-key shorthand {key: [v1, v2]} becomes
    [{key: v1}, {key: v2}]."""
    if isinstance(raw, dict):
        if len(raw) != 1:
            raise SweepSpecError(
                f"grid.{axis}: the shorthand form takes exactly one key with a list of values "
                f"(got keys {sorted(raw)}); use a list of mappings for choices that set several keys")
        (key, values), = raw.items()
        if not values:
            raise SweepSpecError(f"grid.{axis}.{key}: empty list of values")
        return [{key: value} for value in values]
    if not raw:
        raise SweepSpecError(f"grid.{axis}: empty list of choices")
    return [dict(choice) for choice in raw]


def _check_choice(axis: str, index: int, choice: dict[str, Any]) -> None:
    where = f"grid.{axis}[{index}]"
    if "gpus" in choice and (not isinstance(choice["gpus"], int) or choice["gpus"] < 1):
        raise SweepSpecError(f"{where}.gpus: must be a positive integer, got {choice['gpus']!r}")
    for key in BUDGET_KEYS:
        if key in choice and (isinstance(choice[key], bool) or not isinstance(choice[key], (int, float))
                              or choice[key] <= 0):
            raise SweepSpecError(f"{where}.{key}: must be a positive number of {key}, got {choice[key]!r}")
    if all(key in choice for key in BUDGET_KEYS):
        raise SweepSpecError(f"{where}: give tokens or flops, not both (each sets schedule.train_steps)")
    for key in choice:
        if key not in SPECIAL_KEYS and "." not in key:
            hint = did_you_mean(key, SPECIAL_KEYS)
            raise SweepSpecError(
                f"{where}: unknown key {key!r}: a choice holds config keys (section.key, e.g. "
                f"optimizer.lr) or one of {', '.join(SPECIAL_KEYS)}{hint}")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]", "-", name)


def load_spec(path: str) -> SweepSpec:
    """Parse and type-check the YAML; errors name the offending key."""
    file = Path(path)
    if not file.is_file():
        raise SweepSpecError(f"sweep spec {path!r} does not exist")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise SweepSpecError(f"sweep spec {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise SweepSpecError(f"sweep spec {path}: must be a mapping with keys name, recipe, grid, ...")
    try:
        return SweepSpec.model_validate(data)
    except ValidationError as exc:
        raise SweepSpecError(_format_errors(path, exc)) from None


def _format_errors(path: str, exc: ValidationError) -> str:
    """One problem per line, the first on the line that names the spec."""
    lines = []
    # A misspelt key also makes the real one missing: name the misspelling first.
    for err in sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden"):
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("list[", "dict[")))
        if err["type"] == "extra_forbidden":
            section = SlurmOptions if err["loc"][0] == "slurm" else SweepSpec
            hint = did_you_mean(str(err["loc"][-1]), section.model_fields, fallback="keys")
            lines.append(f"unknown key {loc!r}{hint}")
        elif err["type"] == "missing":
            lines.append(f"missing required key {loc!r}")
        else:
            lines.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
    lines = list(dict.fromkeys(lines))  # union types repeat an error per branch
    return "\n".join([f"sweep spec {path}: {lines[0]}", *(f"  {line}" for line in lines[1:])])


def expand_points(spec: SweepSpec, *, spec_dir: Path = Path(".")) -> list[Point]:
    """Every combination of the axes' choices, resolved and validated for its world size
    (stable runs and cooldown branches as launch.sweeps.branches plans them)."""
    return expand_with_branches(spec, spec_dir=spec_dir)[0]


def expand_with_branches(spec: SweepSpec, *, spec_dir: Path = Path(".")) -> tuple[list[Point], list]:
    """The points and launch.sweeps.branches' groups (stable run, branches) among them."""
    from launch.sweeps.branches import plan_branches

    points, axes = _expand_grid(spec, spec_dir)
    budget = [axis for axis, choices in axes.items() if any(k in c for c in choices for k in BUDGET_KEYS)]
    if not spec.cooldown_branches or len(budget) != 1:
        return points, []
    config_file = str(spec_dir / spec.config) if spec.config else None
    return plan_branches(points, budget[0], lambda point, overrides: _resolve(
        spec.recipe, config_file, list(overrides), f"grid point {point.name}"))


def _expand_grid(spec: SweepSpec, spec_dir: Path) -> tuple[list[Point], dict[str, list[dict]]]:
    """Every combination of the axes' choices, resolved and validated for its world size."""
    try:
        get_recipe(spec.recipe)
    except ValueError as exc:
        raise SweepSpecError(f"recipe: {exc}") from None
    config_file = str(spec_dir / spec.config) if spec.config else None
    out_dir = Path(spec.out_dir or f"runs/sweeps/{spec.name}").resolve()
    base = _as_pairs(spec.overrides, "overrides")
    axes = {axis: expand_axis(axis, raw) for axis, raw in spec.grid.items()}
    for axis, choices in axes.items():
        for index, choice in enumerate(choices):
            _check_choice(axis, index, choice)
    _check_exclude(spec.exclude, axes)
    points, seen = [], {}
    for combo in itertools.product(*[list(enumerate(c)) for c in axes.values()]):
        if any(all(_label(combo[list(axes).index(a)][1]) == l for a, l in entry.items()) for entry in spec.exclude):
            continue
        labels, pairs, gpus, tokens, flops = {}, list(base), 1, None, None
        for axis, (index, choice) in zip(axes, combo):
            labels[axis] = _label(choice)
            gpus = choice.get("gpus", gpus)
            tokens = choice.get("tokens", tokens)
            flops = choice.get("flops", flops)
            pairs += [f"{k}={format_value(v)}" for k, v in choice.items() if k not in SPECIAL_KEYS]
        name = _safe("_".join(labels.values()))
        if name in seen:
            raise SweepSpecError(f"two grid points are both named {name!r} ({seen[name]} and {labels}); "
                                 "give the choices distinct `label`s")
        seen[name] = labels
        run_dir = out_dir / "points" / name
        pairs.append(f"logging.run_dir={run_dir}")
        where = f"grid point {name} ({', '.join(f'{a}={l}' for a, l in labels.items())})"
        config = _resolve(spec.recipe, config_file, pairs, where)
        if tokens is not None or flops is not None:
            sched = config.schedule
            if flops is not None:  # the nearest whole step: within half a step of the budget
                per_step = training_flops_per_step(config.model, sched.seq_length, sched.global_batch_size)
                steps = max(1, round(flops / per_step))
            else:
                steps = max(1, math.ceil(tokens / (sched.global_batch_size * sched.seq_length)))
            pairs.append(f"schedule.train_steps={steps}")
            config = _resolve(spec.recipe, config_file, pairs, where)
        try:
            validate_for_world(config, gpus)
        except ConfigError as exc:
            raise SweepSpecError(f"{where} on {gpus} GPU(s): {exc}") from None
        points.append(Point(name=name, labels=labels, gpus=gpus, overrides=tuple(pairs), config=config,
                            run_dir=run_dir, budget_flops=flops))
    return points, axes


def _check_exclude(exclude: list[dict[str, str]], axes: dict[str, list[dict]]) -> None:
    for index, entry in enumerate(exclude):
        if not entry:
            raise SweepSpecError(f"exclude[{index}]: empty; name an axis and a choice label, e.g. {{model: small}}")
        for axis, label in entry.items():
            if axis not in axes:
                raise SweepSpecError(f"exclude[{index}]: no grid axis {axis!r}{did_you_mean(axis, list(axes))}")
            labels = [_label(c) for c in axes[axis]]
            if label not in labels:
                raise SweepSpecError(f"exclude[{index}].{axis}: no choice labelled {label!r} (labels: "
                                     f"{', '.join(labels)})")


def _resolve(recipe: str, config_file: Optional[str], pairs: list[str], where: str) -> ExperimentConfig:
    try:
        return apply_overrides(get_recipe(recipe), yaml_file=config_file, overrides=pairs)
    except ConfigError as exc:
        raise SweepSpecError(f"{where}: {exc}") from None
