"""The loop of the repeat tools (tests/pretrain/repeat_*.py): every named layout N times, one
line per run, then a table of failure counts with each failure quoted."""

from __future__ import annotations

import time
from collections.abc import Callable

from tests.distributed import RankFailure


def repeat_layouts(names: list[str], times: int, attempt: Callable[[str, int], str | None]) -> int:
    """attempt(name, i) returns None when run i of layout `name` matches its reference, else
    what differs; a rank that crashes counts as a failure. Exit status: 1 if any failed."""
    failures: dict[str, list[str]] = {name: [] for name in names}
    width = max(len("layout"), *(len(name) for name in names)) + 2
    for i in range(times):
        for name in names:
            start = time.monotonic()
            try:
                problem = attempt(name, i)
            except RankFailure as exc:
                problem = f"crashed: {str(exc).splitlines()[0]}"
            if problem:
                failures[name].append(f"run {i + 1}: {problem}")
            print(f"{name} run {i + 1}/{times}: {problem or 'ok'} ({time.monotonic() - start:.0f} s)", flush=True)
    print(f"\n{'layout':<{width}} failures")
    for name in names:
        print(f"{name:<{width}} {len(failures[name])}/{times}")
        for line in failures[name]:
            print(f"    {line}")
    return 1 if any(failures.values()) else 0
