"""Token-budget axes with WSD schedules: one stable run per group, cooldown branches for the rest.

The points of a sweep that differ only in their token budget (the grid axis whose choices set
`tokens`) and train with `schedule.decay_style=wsd` share their stable phase: the point with
the largest budget runs in full (the "stable run", which also saves a checkpoint at every
other point's cooldown start, `checkpoint.save_steps`), and each other point is a cooldown
branch from it (`checkpoint.branch_from`, pretrain/checkpointing/branch.py): bit for bit the
separate run of its budget, at the cost of its cooldown alone. A point that would not be such a
branch (its own warmup or LR, say: the same checks the training makes) runs on its own, and
`--dry-run` says why. `cooldown_branches: false` in the spec turns it off.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Optional

from models.flops import training_flops_per_step
from pretrain.checkpointing.branch import check_against
from pretrain.checkpointing.format import CheckpointError, step_dir_name


@dataclasses.dataclass
class Group:
    """Points that differ only in their budget: the stable run, its branches, the rest apart."""

    stable: object  # Point
    branches: list = dataclasses.field(default_factory=list)  # Points, branched from `stable`
    apart: dict = dataclasses.field(default_factory=dict)  # point name -> why it runs on its own


def _steps(point) -> int:
    return point.config.schedule.train_steps


def _flops_per_step(point) -> float:
    sched = point.config.schedule
    return training_flops_per_step(point.config.model, sched.seq_length, sched.global_batch_size)


def _cooldown_start(point) -> int:
    sched = point.config.schedule
    return sched.train_steps - sched.wsd_cooldown_steps


def _groups(points: list, budget_axis: str) -> list[list]:
    by_rest: dict[tuple, list] = {}
    for point in points:
        rest = tuple((axis, label) for axis, label in point.labels.items() if axis != budget_axis)
        by_rest.setdefault(rest, []).append(point)
    return list(by_rest.values())


def _plan_group(members: list, resolve: Callable) -> Optional[Group]:
    """The stable run (largest budget) and the members that branch from it; None when nothing
    branches (a group of one, or not wsd)."""
    wsd = [p for p in members if p.config.schedule.decay_style == "wsd"]
    if len(wsd) < 2:
        return None
    stable = max(wsd, key=_steps)
    group = Group(stable=stable)
    saved = json.loads(stable.config.model_dump_json())
    ckpt = stable.run_dir / "ckpt"
    for point in wsd:
        if point is stable:
            continue
        step = _cooldown_start(point)
        if step < 1:
            group.apart[point.name] = "its cooldown is the whole run: there is no stable phase to branch from"
            continue
        source = ckpt / step_dir_name(step)
        overrides = [*point.overrides, f"checkpoint.dir={point.run_dir / 'ckpt'}", f"checkpoint.branch_from={source}"]
        config = resolve(overrides)
        try:
            check_against(config, saved, step, source, lambda line: None)
        except CheckpointError as exc:
            group.apart[point.name] = str(exc).split(": ", 1)[1]
            continue
        group.branches.append(dataclasses.replace(point, overrides=tuple(overrides), config=config,
                                                  branch_of=stable.name))
    if not group.branches:
        return None
    steps = sorted({_cooldown_start(b) for b in group.branches})
    overrides = [*stable.overrides, f"checkpoint.dir={ckpt}", f"checkpoint.save_steps={json.dumps(steps)}"]
    group.stable = dataclasses.replace(stable, overrides=tuple(overrides), config=resolve(overrides))
    return group


def plan_branches(points: list, budget_axis: Optional[str], resolve: Callable) -> tuple[list, list[Group]]:
    """The points with stable runs and branches rewritten (stable runs first, in grid order,
    then branches), and the groups. `resolve(point, overrides)` gives a point's config."""
    if budget_axis is None:
        return points, []
    groups = []
    for members in _groups(points, budget_axis):
        group = _plan_group(members, lambda overrides, p=members[0]: resolve(p, overrides))
        if group is not None:
            groups.append(group)
    changed = {g.stable.name: g.stable for g in groups} | {b.name: b for g in groups for b in g.branches}
    planned = [changed.get(p.name, p) for p in points]
    return [p for p in planned if p.branch_of is None] + [p for p in planned if p.branch_of is not None], groups


def compute_summary(points: list, groups: list[Group]) -> list[str]:
    """Lines for --dry-run: the training FLOPs the sweep spends with its branches against
    running every point separately, per group and in total."""
    lines = []
    for group in groups:
        stable, branches = group.stable, group.branches
        separate = sum(_steps(p) * _flops_per_step(p) for p in [stable, *branches])
        spent = _steps(stable) * _flops_per_step(stable) + sum(
            (_steps(b) - _cooldown_start(b)) * _flops_per_step(b) for b in branches)
        lines.append(f"{stable.name}: stable run of {_steps(stable)} steps, "
                     + ", ".join(f"{b.name} branches at step {_cooldown_start(b)} ({_steps(b) - _cooldown_start(b)} steps)"
                                 for b in branches)
                     + f": {spent:.3g} FLOPs vs {separate:.3g} as separate runs")
        lines += [f"  {name} runs on its own: {why}" for name, why in group.apart.items()]
    total_separate = sum(_steps(p) * _flops_per_step(p) for p in points)
    total = total_separate - sum((_cooldown_start(b)) * _flops_per_step(b) for g in groups for b in g.branches)
    saved = 1 - total / total_separate if total_separate else 0.0
    lines.append(f"compute: {total:.3g} FLOPs with cooldown branches vs {total_separate:.3g} as separate runs "
                 f"({saved:.0%} less)")
    return lines
