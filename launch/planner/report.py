"""Presenting a plan: rich tables (ranking, closest misses), the JSON document of
`--json`, and the recipe-override YAML that selects the best layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import yaml
from rich.console import Console
from rich.table import Table

from launch.planner.memory import GIB
from launch.planner.search import Evaluation, Plan
from models.flops import total_params
from pretrain.config import ExperimentConfig
from pretrain.recipes import get_recipe


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def _layout_cells(e: Evaluation) -> list[str]:
    c = e.candidate
    return [c.layout.describe(c.world_size), str(c.micro_batch), c.recompute, c.sharding_label()]


_LAYOUT_COLUMNS = ["layout", "mbs", "recompute", "sharding"]
_MEMORY_COLUMNS = ["params", "grads", "main", "optim", "activ", "overhead", "total GiB"]


def _add_columns(table: Table, names: list[str]) -> None:
    for name in names:
        # The layout string is the answer: never truncate it.
        table.add_column(name, justify="left" if name == "layout" else "right", no_wrap=name == "layout")


def _memory_cells(e: Evaluation) -> list[str]:
    b = e.memory
    # Transformer Engine's cached FP8 weight copies are weights too: shown under params.
    return [_gib(b.params + b.fp8_buffers), _gib(b.grads), _gib(b.main_params), _gib(b.optimizer_states),
            _gib(b.activations), _gib(b.overhead + b.sharding_buffers), _gib(b.total)]


def optimizer_label(config: ExperimentConfig) -> str:
    """'adamw', or 'muon (5 NS steps, tp_mode duplicated) + adamw' - what the estimate models."""
    opt = config.optimizer
    if opt.name != "muon":
        return opt.name
    return (f"muon ({opt.muon.num_ns_steps} Newton-Schulz steps, tp_mode {opt.muon.tp_mode}, "
            f"matmul {opt.muon.fp32_matmul_prec}) + adamw")


def ranking_table(plan: Plan, top: int) -> Table:
    table = Table(title=f"{plan.config.name} ({optimizer_label(plan.config)}) on {plan.world_size} x {plan.device.name} "
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


def summary(plan: Plan) -> str:
    """One sentence: the recommendation and its headline numbers."""
    best = plan.best
    s = best.estimate
    muon = f" (Newton-Schulz {s.optimizer_s:.3f} s)" if best.candidate.muon else ""
    return (
        f"recommended: {best.candidate.describe()}, optimizer {best.candidate.optimizer_name} - "
        f"{s.step_s:.2f} s/step{muon}, "
        f"{s.tokens_per_s / plan.world_size:,.0f} tokens/s/GPU, {100 * s.mfu:.1f}% MFU (estimated), "
        f"{best.memory.total / GIB:.1f} of {plan.device.memory_gib:.1f} GiB. "
        f"{len(plan.ranked)} layouts fit, {len(plan.dropped)} too large, {plan.invalid} invalid."
    )


def print_plan(plan: Plan, *, console: Console, top: Optional[int], show_dropped: Optional[int]) -> None:
    """The ranking, the closest misses and the one-line summary (None = every row)."""
    console.print(ranking_table(plan, top))
    if show_dropped != 0 and plan.dropped:
        console.print(dropped_table(plan, show_dropped))
    console.print(summary(plan))


def _layout_json(e: Evaluation) -> dict:
    c = e.candidate
    return {"tp": c.tp, "pp": c.pp, "vpp": c.vpp, "cp": c.cp, "ep": c.ep, "dp": c.dp, "zero": c.zero,
            "hsdp_replicas": c.hsdp_replicas, "offload": c.offload, "micro_batch": c.micro_batch,
            "recompute": c.recompute, "sequence_parallel": c.layout.sequence_parallel,
            # The pipeline split as the training builds it: uneven first / last stages or the
            # embedding and loss counted show here.
            "layers_per_stage": [c.layers_on_stage(s) for s in range(c.pp)]}


def _memory_json(e: Evaluation) -> dict:
    """GiB per GPU on the fullest pipeline stage; `overhead` includes Megatron-FSDP's
    temporary buckets and `params` the cached FP8 weight copies, so the terms add up to `total`."""
    b = e.memory
    terms = {"params": b.params + b.fp8_buffers, "grads": b.grads, "main_params": b.main_params,
             "optimizer": b.optimizer_states,
             "activations": b.activations, "overhead": b.overhead + b.sharding_buffers, "total": b.total}
    return {k: round(v / GIB, 3) for k, v in terms.items()}


def candidate_json(e: Evaluation, plan: Plan, rank: Optional[int]) -> dict:
    s = e.estimate
    return {
        "rank": rank,
        "layout": _layout_json(e),
        "memory_gib": _memory_json(e),
        "pipeline_stage": e.memory.stage,
        "host_memory_gib": round(e.memory.host / GIB, 3),
        "step_s": round(s.step_s, 4) if s else None,
        "tokens_per_s_per_gpu": round(s.tokens_per_s / plan.world_size, 1) if s else None,
        "mfu": round(s.mfu, 4) if s else None,
        "exposed_comm_s": {k: round(v, 4) for k, v in s.comm_s.items()} if s else None,
        "optimizer_s": round(s.optimizer_s, 4) if s else None,
        "fits": e.fits,
        "reason": e.reason(plan.device) or None,
        "n_params": total_params(e.candidate.model),
    }


def plan_json(plan: Plan, *, top: Optional[int], show_dropped: Optional[int]) -> dict:
    """{"candidates": [...]}: the fitting layouts fastest first (rank 1 is the
    recommendation), then the dropped ones closest to fitting first (rank null)."""
    ranked = [candidate_json(e, plan, i) for i, e in enumerate(plan.ranked[:top], 1)]
    dropped = [candidate_json(e, plan, None) for e in plan.dropped[:show_dropped]]
    return {"candidates": ranked + dropped, "recipe": plan.config.name, "optimizer": optimizer_label(plan.config),
            "gpus": plan.world_size,
            "gpu": plan.device.name, "fitting": len(plan.ranked), "dropped": len(plan.dropped),
            "invalid": plan.invalid}


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
