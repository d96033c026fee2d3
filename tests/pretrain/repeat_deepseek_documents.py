"""Run every layout of test_deepseek_documents N times against its one-rank reference.

    python -m tests.pretrain.repeat_deepseek_documents --times 20     # every layout
    python -m tests.pretrain.repeat_deepseek_documents --times 20 TP2-SP-docs TP2-SP-docs-mtp
    python -m tests.pretrain.repeat_deepseek_documents --times 5 PP2-docs-mtp

A multi-rank test is trusted after it passed 20 times in a row; the pytest module recomputes
its references every time, this computes them once. Each repetition trains tiny-deepseek 5 steps
with document masking (reset_attention_mask + reset_position_ids, KJV verses as documents; one MTP
layer where named "-mtp", two where "-mtp2") and checks what the test checks: per-step loss, MTP
loss (each depth's too with two) and grad norm within 1e-5 relative, every final weight within
1e-5; a crash counts as a failure. Prints one line per
run and a table of failure counts.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from tests.pretrain.test_deepseek_documents import LAYOUTS, REFERENCES, compare, run_layout
from tests.pretrain.workers import document_data
from tests.repeat import parse_layouts, repeat_layouts


def main(argv: list[str] | None = None) -> int:
    names, times = parse_layouts(__doc__, LAYOUTS, argv)
    with tempfile.TemporaryDirectory(prefix="repeat-deepseek-docs-") as tmp:
        root = Path(tmp)
        data = document_data(root)
        refs = {tag: run_layout(root, tag, 1, extra, data) for tag, extra in REFERENCES.items()
                if any(LAYOUTS[name][2] == tag for name in names)}

        def attempt(name: str, i: int) -> str | None:
            nproc, extra, ref = LAYOUTS[name]
            got = run_layout(root, f"{name}-{i}", nproc, extra, data)
            shutil.rmtree(root / f"{name}-{i}")
            try:
                compare(got, refs[ref], name)
            except AssertionError as exc:
                return str(exc).splitlines()[0]
            return None

        return repeat_layouts(names, times, attempt)


if __name__ == "__main__":
    sys.exit(main())
