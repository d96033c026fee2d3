"""Presenting a plan: rich tables (ranking, closest misses, ZeRO what-if) and the
recipe-override YAML that selects the best layout."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from launch.planner.memory import GIB, MemoryOptions, memory_on_stage
from launch.planner.search import Evaluation, Plan
from pretrain.config import ExperimentConfig
from pretrain.recipes import get_recipe


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def _layout_cells(e: Evaluation) -> list[str]:
    c = e.candidate
    return [c.layout.describe(c.world_size), str(c.micro_batch), c.recompute,
            "yes" if c.distributed_optimizer else "no"]


_LAYOUT_COLUMNS = ["layout", "mbs", "recompute", "dist-opt"]
_MEMORY_COLUMNS = ["params", "grads", "main", "optim", "activ", "overhead", "total GiB"]


def _add_columns(table: Table, names: list[str]) -> None:
    for name in names:
        # The layout string is the answer: never truncate it.
        table.add_column(name, justify="left" if name == "layout" else "right", no_wrap=name == "layout")


def _memory_cells(e: Evaluation) -> list[str]:
    b = e.memory
    return [_gib(b.params), _gib(b.grads), _gib(b.main_params), _gib(b.optimizer_states),
            _gib(b.activations), _gib(b.overhead), _gib(b.total)]


def ranking_table(plan: Plan, top: int) -> Table:
    table = Table(title=f"{plan.config.name} on {plan.world_size} x {plan.device.name} "
                        f"({plan.device.memory_gib:.1f} GiB): fastest layouts that fit")
    _add_columns(table, ["#", *_LAYOUT_COLUMNS, *_MEMORY_COLUMNS])
    for name in ["s/step", "tok/s/GPU", "MFU", "bubble", "comm"]:
        table.add_column(name, justify="right")
    for index, e in enumerate(plan.ranked[:top], 1):
        s = e.estimate
        table.add_row(
            str(index), *_layout_cells(e), *_memory_cells(e),
            f"{s.step_s:.2f}", f"{s.tokens_per_s / plan.world_size:,.0f}",
            f"{100 * s.mfu:.1f}%", f"{100 * s.bubble_s / s.step_s:.1f}%",
            f"{100 * s.exposed_comm_s / s.step_s:.1f}%",
        )
    return table


def dropped_table(plan: Plan, count: int) -> Table:
    table = Table(title=f"closest layouts that do not fit ({len(plan.dropped)} dropped for memory)")
    _add_columns(table, [*_LAYOUT_COLUMNS, *_MEMORY_COLUMNS, "over by"])
    for e in plan.dropped[:count]:
        over = e.memory.total - plan.device.memory_bytes
        table.add_row(*_layout_cells(e), *_memory_cells(e), f"{over / GIB:.1f} GiB")
    return table


def zero_table(plan: Plan, options: MemoryOptions) -> Table:
    """Static memory of the best layout's largest stage under ZeRO stages 0-3 (what-if)."""
    best = plan.best
    table = Table(title=f"what-if for the best layout (stage {best.memory.stage}): ZeRO stages, GiB per GPU")
    for name in ["ZeRO", "meaning", "params", "grads", "main", "optim", "static", "total"]:
        table.add_column(name, justify="right")
    meaning = ["nothing sharded", "optimizer state sharded (= distributed optimizer)",
               "+ gradients sharded", "+ parameters sharded"]
    for stage in range(4):
        b = memory_on_stage(best.candidate, best.memory.stage, dataclasses.replace(options, zero_stage=stage))
        table.add_row(str(stage), meaning[stage], _gib(b.params), _gib(b.grads), _gib(b.main_params),
                      _gib(b.optimizer_states), _gib(b.static), _gib(b.total))
    return table


def summary(plan: Plan) -> str:
    """One sentence: the recommendation and its headline numbers."""
    best = plan.best
    s = best.estimate
    return (
        f"recommended: {best.candidate.describe()} - {s.step_s:.2f} s/step, "
        f"{s.tokens_per_s / plan.world_size:,.0f} tokens/s/GPU, {100 * s.mfu:.1f}% MFU (estimated), "
        f"{best.memory.total / GIB:.1f} of {plan.device.memory_gib:.1f} GiB. "
        f"{len(plan.ranked)} layouts fit, {len(plan.dropped)} too large, {plan.invalid} invalid."
    )


def print_plan(plan: Plan, *, console: Console, top: int, show_dropped: int, options: MemoryOptions) -> None:
    console.print(ranking_table(plan, top))
    if show_dropped and plan.dropped:
        console.print(dropped_table(plan, show_dropped))
    console.print(zero_table(plan, options))
    console.print(summary(plan))


def _diff(planned: dict, base: dict) -> dict:
    """The nested keys whose values differ (what an override file must set)."""
    out = {}
    for key, value in planned.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            sub = _diff(value, base[key])
            if sub:
                out[key] = sub
        elif base.get(key) != value:
            out[key] = value
    return out


def override_yaml(plan: Plan, recipe: str) -> str:
    """YAML overrides that turn recipe `recipe` into the planned best run (for
    `python -m pretrain --config FILE` / `python -m launch.slurm ... --config FILE`)."""
    planned: ExperimentConfig = plan.best.candidate.apply_to(plan.config)
    as_dict = lambda cfg: json.loads(cfg.model_dump_json())  # noqa: E731 - tuples -> lists, as YAML reads them
    changes = _diff(as_dict(planned), as_dict(get_recipe(recipe)))
    header = (
        f"# launch.plan: best layout for recipe {recipe} on {plan.world_size} x {plan.device.name}\n"
        f"# {summary(plan)}\n"
        f"# use: python -m pretrain --recipe {recipe} --config THIS_FILE (or launch.slurm with --config)\n"
    )
    return header + yaml.safe_dump(changes, sort_keys=False)


def write_override(plan: Plan, recipe: str, path: str) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(override_yaml(plan, recipe))
    return target
