"""Run every layout of test_mtp_parity N times against one one-rank reference.

    python -m tests.pretrain.repeat_mtp --times 20          # EP2, TP2-SP, PP2, PP2-VPP2, DP2-ZeRO3
    python -m tests.pretrain.repeat_mtp --times 5 PP2       # one layout

A multi-rank test is trusted after it passed 20 times in a row; the pytest module recomputes
its reference every time, this computes it once. Each repetition trains 5 steps and checks
what the test checks: per-step loss, MTP loss and grad norm within 1e-5 relative, every final
weight (the MTP layer's included) within 1e-5; a crash counts as a failure. Prints one line
per run and a table of failure counts.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from tests.compare import relative_differences
from tests.pretrain.test_mtp_parity import LAYOUTS, _run
from tests.repeat import parse_layouts, repeat_layouts


def _compare(got: dict, want: dict) -> str | None:
    """None when `got` matches the reference, else what differs."""
    for key in ("loss", "mtp_loss", "grad_norm"):
        worst = max(relative_differences(got[key], want[key], what=key))
        if worst > 1e-5:
            return f"{key} off by {worst:.2e} relative"
    if sorted(got["weights"]) != sorted(want["weights"]):
        return "the checkpoints hold different model tensors"
    worst = max((got["weights"][k] - want["weights"][k]).abs().max().item() for k in want["weights"])
    return None if worst <= 1e-5 else f"weights off by {worst:.2e}"


def main(argv: list[str] | None = None) -> int:
    names, times = parse_layouts(__doc__, LAYOUTS, argv)
    with tempfile.TemporaryDirectory(prefix="repeat-mtp-") as tmp:
        root = Path(tmp)
        ref = _run(root, "ref", 1, [])

        def attempt(name: str, i: int) -> str | None:
            nproc, extra = LAYOUTS[name]
            problem = _compare(_run(root, f"{name}-{i}", nproc, extra), ref)
            shutil.rmtree(root / f"{name}-{i}")
            return problem

        return repeat_layouts(names, times, attempt)

if __name__ == "__main__":
    sys.exit(main())
