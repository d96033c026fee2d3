"""Collect a sweep's `metrics.jsonl` files into one table (CSV + markdown), fit a power law
of final loss against training compute, and draw the PNG plots.

`final_loss` is the last training batch's loss; `val_loss` (and its standard error over the
batches, `val_loss_se`) is the held-out loss of `schedule.final_eval_steps`, empty when the run
did not evaluate: scaling fits (`python -m launch.scaling fit`) use `val_loss` when present.

Compute per run = models.flops.training_flops_per_token x tokens trained: the FLOPs the
training metrics count (no recompute), so the x axis of the scaling plot and the TFLOP/s
column come from the same formula.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Optional

from launch.sweeps.spec import Point
from models.flops import total_params, training_flops_per_token

COLUMNS = ["point", "gpus", "params", "status", "steps", "tokens", "flops", "final_loss", "val_loss", "val_loss_se",
           "step_time_s",
           "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "peak_mem_gb"]


def read_metrics(path: Path) -> list[dict]:
    """Training records by step (the last record of a step wins: a resumed run re-logs it)."""
    if not path.is_file():
        return []
    by_step = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        if "loss" in record and "step" in record:
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def read_heldout(path: Path) -> Optional[dict]:
    """The final held-out evaluation's record (schedule.final_eval_steps), the last one logged."""
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "val_loss" in record:
            found = record
    return found


def is_finished(point: Point) -> bool:
    records = read_metrics(point.run_dir / "metrics.jsonl")
    return bool(records) and records[-1]["step"] >= point.config.schedule.train_steps


def _mean(values: list[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(point: Point) -> dict:
    """One row: the point's settings, its final loss and mean throughput (the first logged
    step is left out of the means when there are others: it pays for warm-up)."""
    records = read_metrics(point.run_dir / "metrics.jsonl")
    sched = point.config.schedule
    tokens_per_step = sched.global_batch_size * sched.seq_length
    row = {"point": point.name, **point.labels, "gpus": point.gpus, "params": total_params(point.config.model)}
    if point.budget_flops is not None:  # an IsoFLOP point: the budget it was designed for
        row["compute"] = point.budget_flops
    status = "finished" if is_finished(point) else ("incomplete" if records else "not run")
    row["status"] = status
    if not records:
        return row
    steady = records[1:] if len(records) > 1 else records
    tokens = records[-1]["step"] * tokens_per_step
    heldout = read_heldout(point.run_dir / "metrics.jsonl")
    if heldout is not None and heldout["step"] == records[-1]["step"]:
        row.update(val_loss=heldout["val_loss"], val_loss_se=heldout["val_loss_se"])
    row.update(
        steps=records[-1]["step"], tokens=tokens,
        flops=training_flops_per_token(point.config.model, sched.seq_length) * tokens,
        final_loss=records[-1]["loss"],
        step_time_s=_mean([r["step_time_s"] for r in steady]),
        tokens_per_s=_mean([r["tokens_per_s"] for r in steady]),
        tokens_per_s_per_device=_mean([r["tokens_per_s_per_device"] for r in steady]),
        tflops_per_device=_mean([r["tflops_per_device"] for r in steady]),
        mfu=_mean([r.get("mfu") for r in steady]),
        peak_mem_gb=max(r["peak_mem_gb"] for r in records),
    )
    return row


def loss_curve(point: Point) -> tuple[list[float], list[float]]:
    """(tokens seen, loss) for every logged step."""
    sched = point.config.schedule
    records = read_metrics(point.run_dir / "metrics.jsonl")
    return ([r["step"] * sched.global_batch_size * sched.seq_length for r in records],
            [r["loss"] for r in records])


def fit_power_law(compute: list[float], loss: list[float]) -> Optional[dict]:
    """Least-squares fit of L = a C^(-b) in log space (log L = log a - b log C);
    None with fewer than two distinct compute values. r2 is the fit's R^2 in log space."""
    pairs = [(math.log(c), math.log(l)) for c, l in zip(compute, loss) if c > 0 and l > 0]
    if len({x for x, _ in pairs}) < 2:
        return None
    n = len(pairs)
    mx, my = sum(x for x, _ in pairs) / n, sum(y for _, y in pairs) / n
    sxx = sum((x - mx) ** 2 for x, _ in pairs)
    sxy = sum((x - mx) * (y - my) for x, y in pairs)
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for _, y in pairs)
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in pairs)
    return {"a": math.exp(intercept), "b": -slope, "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0,
            "points": n}


def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_tables(rows: list[dict], axes: list[str], out_dir: Path, fit: Optional[dict]) -> tuple[Path, Path]:
    """results.csv (every column) and results.md (a markdown table + the fit)."""
    columns = [COLUMNS[0], *axes, *COLUMNS[1:]]
    if any("compute" in row for row in rows):  # launch.scaling fit groups budgets by it
        columns.insert(columns.index("flops") + 1, "compute")
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "results.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |" for row in rows]
    if fit:
        lines += ["", f"Power-law fit of {fit['loss_column']} vs training compute over {fit['points']} finished runs: "
                      f"L = {fit['a']:.4g} x C^-{fit['b']:.4g} (R^2 in log space {fit['r2']:.3f})."]
    md_path = out_dir / "results.md"
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def draw_plots(points: list[Point], rows: list[dict], fit: Optional[dict], out_dir: Path) -> list[Path]:
    """loss_vs_tokens.png, throughput_vs_gpus.png, loss_vs_compute.png."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on cluster or CI machines
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [_plot_loss_curves(plt, points, out_dir / "loss_vs_tokens.png"),
             _plot_throughput(plt, rows, out_dir / "throughput_vs_gpus.png"),
             _plot_scaling(plt, rows, fit, out_dir / "loss_vs_compute.png")]
    return paths


def matplotlib_ticker():
    import matplotlib.ticker

    return matplotlib.ticker


def _legend(ax, **kwargs) -> None:
    """A legend only when something was drawn (a sweep collected before any point ran)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def _plot_loss_curves(plt, points: list[Point], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=90)
    for point in points:
        tokens, losses = loss_curve(point)
        if tokens:
            ax.plot(tokens, losses, label=point.name, linewidth=1.2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("training loss")
    ax.set_title("loss vs tokens")
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot_throughput(plt, rows: list[dict], path: Path) -> Path:
    """Per model size (parameter count): mean tokens/s per device and MFU (or TFLOP/s per
    device on CPU, where there is no peak to divide by) at each GPU count."""
    done = [r for r in rows if r.get("tokens_per_s") is not None]
    use_mfu = any(r.get("mfu") is not None for r in done)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8), dpi=90)
    for params in sorted({r["params"] for r in done}):
        mine = [r for r in done if r["params"] == params]
        gpus = sorted({r["gpus"] for r in mine})
        label = f"{params / 1e6:.2f}M params"
        for ax, key in ((left, "tokens_per_s_per_device"), (right, "mfu" if use_mfu else "tflops_per_device")):
            ys = [_mean([r[key] for r in mine if r["gpus"] == g]) for g in gpus]
            ax.plot(gpus, [100 * y if key == "mfu" else y for y in ys], marker="o", label=label)
    left.set_ylabel("tokens/s per device")
    right.set_ylabel("MFU (%)" if use_mfu else "model TFLOP/s per device")
    for ax in (left, right):
        ax.set_xticks(sorted({r["gpus"] for r in done}))
        ax.set_xlabel("GPUs (ranks)")
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=7)
    fig.suptitle("throughput vs GPU count")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _plot_scaling(plt, rows: list[dict], fit: Optional[dict], path: Path) -> Path:
    done = [r for r in rows if r["status"] == "finished"]
    key = fit["loss_column"] if fit else "final_loss"
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=90)
    for params in sorted({r["params"] for r in done}):
        mine = [r for r in done if r["params"] == params]
        ax.scatter([r["flops"] for r in mine], [r[key] for r in mine], label=f"{params / 1e6:.2f}M params")
    if fit:
        lo, hi = min(r["flops"] for r in done), max(r["flops"] for r in done)
        xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
        ax.plot(xs, [fit["a"] * x ** -fit["b"] for x in xs], "k--", linewidth=1,
                label=f"fit L = {fit['a']:.3g} C^-{fit['b']:.3g} (R²={fit['r2']:.2f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    # Loss spans well under a decade: plain numbers on the y ticks, no crowded minor x labels.
    plain = matplotlib_ticker().FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.xaxis.set_minor_formatter(matplotlib_ticker().FuncFormatter(
        lambda v, _: f"{v:.0e}" if f"{v:.0e}"[0] in "25" else ""))
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("held-out loss L" if key == "val_loss" else "final training loss L")
    ax.set_title(f"{key} vs compute")
    ax.grid(alpha=0.3, which="both")
    _legend(ax, fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def collect(points: list[Point], axes: list[str], out_dir: Path) -> dict:
    """Tables, fit and plots for whatever has run so far; returns their paths and the fit."""
    rows = [summarize(p) for p in points]
    done = [r for r in rows if r["status"] == "finished"]
    # The held-out loss when every finished run has one; the last training batch's otherwise.
    key = "val_loss" if done and all(r.get("val_loss") is not None for r in done) else "final_loss"
    fit = fit_power_law([r["flops"] for r in done], [r[key] for r in done])
    if fit:
        fit["loss_column"] = key
    (out_dir / "fit.json").parent.mkdir(parents=True, exist_ok=True)
    (out_dir / "fit.json").write_text(json.dumps(fit, indent=2) + "\n")
    csv_path, md_path = write_tables(rows, axes, out_dir, fit)
    plots = draw_plots(points, rows, fit, out_dir / "plots")
    return {"rows": rows, "fit": fit, "csv": csv_path, "markdown": md_path, "plots": plots}
