"""Run every sharded layout of test_sharded_dp N times against its one-rank reference.

    python -m tests.pretrain.repeat_sharded --times 20            # all layouts (REPEAT_ONLY too)
    python -m tests.pretrain.repeat_sharded --times 5 DP2-ZeRO3   # one layout

A multi-rank test is trusted after it passed 20 times in a row: Megatron-FSDP's coalesced
asynchronous all-gather has corrupted the heap on gloo now and then (we gather
synchronously, pretrain/megatron_fixes/fsdp.py), which one run would not show. Each
repetition trains 5 steps and compares per-step loss and grad norm (1e-5 relative) and
every final weight (1e-5) with the reference, as the test does; a crash counts as a
failure. Prints one line per run and a table of failure counts.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from tests.compare import relative_differences
from tests.repeat import parse_layouts, repeat_layouts
from tests.pretrain.test_sharded_dp import (LAYOUTS, OPTIMIZER_KEY, REFERENCE, REPEAT_ONLY, STEPS, _reference_of,
                                           _run, _tensors)

ALL = {**LAYOUTS, **REPEAT_ONLY}  # the suite's layouts and those only run here


ONE_SAVE = [f"checkpoint.save_interval={STEPS}", "checkpoint.async_save=false"]


def _compare(got: dict, want: dict) -> str | None:
    """None when `got` matches the reference, else what differs."""
    for key in ("loss", "grad_norm"):
        if not want[key] or len(got[key]) != len(want[key]):
            return f"{key}: {len(got[key])} steps, want {len(want[key])} (and at least one)"
        worst = max(relative_differences(got[key], want[key], what=key))
        if worst > 1e-5:
            return f"{key} off by {worst:.2e} relative"
    final = f"step_{STEPS:08d}"
    mine, theirs = _tensors(got["ckpt"] / final), _tensors(want["ckpt"] / final)
    keys = [k for k in theirs if not OPTIMIZER_KEY.match(k)]
    worst = max((mine[k] - theirs[k]).abs().max().item() for k in keys)
    return None if worst <= 1e-5 else f"weights off by {worst:.2e}"


def main(argv: list[str] | None = None) -> int:
    names, times = parse_layouts(__doc__, ALL, argv)
    with tempfile.TemporaryDirectory(prefix="repeat-sharded-") as tmp:
        root = Path(tmp)
        refs = {key: _run(root, f"ref-{key}", recipe, 1, extra) for key, (recipe, extra) in REFERENCE.items()
                if any(_reference_of(name) == key for name in names)}

        def attempt(name: str, i: int) -> str | None:
            recipe, nproc, extra = ALL[name]
            # One (synchronous) save, at the end, for the weights: the saves' own round trips
            # are the test's resume cases.
            got = _run(root, f"{name}-{i}", recipe, nproc, extra + ONE_SAVE)
            problem = _compare(got, refs[_reference_of(name)])
            shutil.rmtree(root / f"{name}-{i}")
            return problem

        return repeat_layouts(names, times, attempt)

if __name__ == "__main__":
    sys.exit(main())
