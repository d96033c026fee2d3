"""Read the runs a scaling fit needs: parameters N, training tokens D, final loss L.

The table is a CSV with columns `params`, `tokens` and `loss`. `launch.sweep`'s results.csv
has `val_loss` (the held-out loss of schedule.final_eval_steps) and `final_loss` (the last
training batch's, one noisy batch) and marks unfinished points in `status`: the loss read is
the first of `loss`, `val_loss`, `final_loss` in the header (or the one named), and rows whose
`status` is not `finished` are left out (an incomplete run's last loss is not its final loss). Every problem is a ScalingInputError
whose message names the row or column and the fix; the CLI prints it in one line, exit 2.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

# Ours first, then launch.sweep's held-out loss, then its last training batch's.
LOSS_COLUMNS = ("loss", "val_loss", "final_loss")


class ScalingInputError(ValueError):
    """The table cannot be fitted as it is (message: what is wrong and how to fix it)."""


@dataclass(frozen=True)
class Runs:
    """One entry per run. compute is the budget the run belongs to: the table's compute
    column when one was named or present, else 6*N*D (the Chinchilla approximation)."""
    params: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray
    compute: np.ndarray
    compute_source: str
    skipped_unfinished: int = 0
    loss_column: str = "loss"

    def __len__(self) -> int:
        return len(self.loss)

    def subset(self, index: np.ndarray) -> "Runs":
        return Runs(self.params[index], self.tokens[index], self.loss[index], self.compute[index],
                    self.compute_source, loss_column=self.loss_column)


def _number(row: dict, column: str, line: int) -> float:
    text = (row.get(column) or "").strip()
    try:
        value = float(text)
    except ValueError:
        raise ScalingInputError(f"line {line}: {column}={text!r} is not a number "
                                "(every run needs a numeric value; remove the row or fill it in)") from None
    if not math.isfinite(value) or value <= 0:
        raise ScalingInputError(f"line {line}: {column}={text} must be a positive finite number "
                                "(log-space fits need N, D, L > 0; remove the row)")
    return value


def read_runs(path: Path, compute_column: Optional[str] = None, loss_column: Optional[str] = None) -> Runs:
    """The table's runs; compute from `compute_column`, else a `compute` column, else 6ND.
    (The sweep's `flops` column is not used by default: it counts attention and logits, so
    runs designed for one 6ND budget differ in it by model size and would split groups.)"""
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ScalingInputError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc} "
                                "(give a readable CSV file with params,tokens,loss columns)") from None
    if loss_column is None:
        loss_column = next((c for c in LOSS_COLUMNS if c in header), None)
    elif loss_column not in header:
        raise ScalingInputError(f"{path}: --loss-column {loss_column} is not a column (header: "
                                f"{','.join(header) or 'empty'})")
    missing = [c for c in ("params", "tokens") if c not in header] + ([] if loss_column else ["loss"])
    if compute_column is None and "compute" in header:
        compute_column = "compute"
    elif compute_column is not None and compute_column not in header:
        missing.append(compute_column)
    if missing:
        raise ScalingInputError(f"{path}: missing column(s) {', '.join(missing)} (header: "
                                f"{','.join(header) or 'empty'}); the table needs params,tokens,loss")
    skipped = 0
    values = []
    for line, row in enumerate(rows, start=2):
        if "status" in header and row.get("status") != "finished":
            skipped += 1
            continue
        n, d, l = (_number(row, c, line) for c in ("params", "tokens", loss_column))
        c = _number(row, compute_column, line) if compute_column else 6.0 * n * d
        values.append((n, d, l, c))
    if not values:
        raise ScalingInputError(f"{path}: no finished runs to fit ({skipped} rows not finished)")
    arr = np.array(values, dtype=float)
    return Runs(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3],
                compute_column or "6*params*tokens", skipped, loss_column)


def group_by_compute(compute: np.ndarray, tolerance: float) -> list[np.ndarray]:
    """Indices of the runs of each compute budget, smallest budget first: sorted by C, a
    run joins the current group while its C is within (1 + tolerance) x the group's first.
    A tolerance, not exact equality, because token counts are whole steps of a batch."""
    order = np.argsort(compute, kind="stable")
    groups, start = [], 0
    for i in range(1, len(order) + 1):
        if i == len(order) or compute[order[i]] > compute[order[start]] * (1 + tolerance):
            groups.append(np.sort(order[start:i]))
            start = i
    return groups
