"""How much held-out data a sweep's val_loss needs: its noise against the effects being fitted.

    python -m launch.scaling heldout runs/sweeps/isoflop-tiny-llama [--json]

Reads the sweep's results.csv and every point's metrics.jsonl (the per-batch losses of its
final held-out evaluation, schedule.final_eval_steps) and prints:
- the standard error of each point's val_loss over its batches (s / sqrt(batches));
- for the sizes of one budget, neighbours in N, the val_loss difference and the standard error
  of that difference from the paired per-batch differences: every point evaluates the same
  documents, so the batch-to-batch spread (a hard document is hard for every model) cancels
  in a difference and in the fit's shape, and the paired error is the one that matters;
- the batches that would bring each error to a third of the median difference (the error
  shrinks as 1/sqrt(batches)).
Bad input: one line, exit 2.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

from launch.scaling.data import ScalingInputError
from launch.sweeps.results import read_heldout


def _points(out_dir: Path) -> list[dict]:
    table = out_dir / "results.csv"
    if not table.is_file():
        raise ScalingInputError(f"{table} does not exist: give a launch.sweep output folder (its out_dir)")
    with table.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("status") == "finished"]
    points = []
    for row in rows:
        record = read_heldout(out_dir / "points" / row["point"] / "metrics.jsonl")
        if record is None or len(record.get("val_batch_losses", [])) < 2:
            continue
        budget = row.get("compute") or row.get("flops")
        points.append({"point": row["point"], "params": float(row["params"]), "budget": float(budget),
                       "losses": np.array(record["val_batch_losses"], dtype=float)})
    if len(points) < 2:
        raise ScalingInputError(f"{out_dir}: {len(points)} finished point(s) with a held-out evaluation of >= 2 "
                                "batches; run the sweep with schedule.final_eval_steps >= 2")
    return points


def analyse(out_dir: Path) -> dict:
    points = _points(out_dir)
    batches = min(len(p["losses"]) for p in points)
    se = [float(np.std(p["losses"][:batches], ddof=1) / math.sqrt(batches)) for p in points]
    pairs = []
    for budget in sorted({p["budget"] for p in points}):
        mine = sorted((p for p in points if math.isclose(p["budget"], budget, rel_tol=0.05)), key=lambda p: p["params"])
        for a, b in zip(mine, mine[1:]):
            diff = a["losses"][:batches] - b["losses"][:batches]
            pairs.append({"budget": budget, "points": [a["point"], b["point"]], "difference": float(diff.mean()),
                          "paired_se": float(np.std(diff, ddof=1) / math.sqrt(batches))})
    doc = {"points": len(points), "batches": batches, "se_median": float(np.median(se)),
           "se_range": [min(se), max(se)], "pairs": pairs}
    if pairs:
        target = float(np.median([abs(p["difference"]) for p in pairs])) / 3
        paired = float(np.median([p["paired_se"] for p in pairs]))
        doc.update(difference_median=3 * target, paired_se_median=paired,
                   batches_for_paired_se=math.ceil(batches * (paired / target) ** 2),
                   batches_for_unpaired_se=math.ceil(batches * (doc["se_median"] / target) ** 2))
    return doc


def heldout_command(args) -> int:
    doc = analyse(Path(args.sweep))
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"held-out loss of {doc['points']} points, {doc['batches']} batches each:")
    print(f"  standard error of a point's val_loss: median {doc['se_median']:.4f} "
          f"(range {doc['se_range'][0]:.4f}-{doc['se_range'][1]:.4f})")
    if doc["pairs"]:
        print(f"  neighbouring sizes at one budget ({len(doc['pairs'])} pairs): |difference| median "
              f"{doc['difference_median']:.4f}, paired standard error median {doc['paired_se_median']:.4f}")
        print(f"  batches for an error of a third of that difference: {doc['batches_for_paired_se']} paired "
              f"(what the fit sees), {doc['batches_for_unpaired_se']} for each point alone")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("heldout", help="the held-out loss's noise against the differences between sweep points")
    p.add_argument("sweep", help="a launch.sweep output folder (results.csv, points/*/metrics.jsonl)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=heldout_command)
