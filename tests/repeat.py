"""The loop of the repeat tools (tests/pretrain/repeat_*.py): every named layout N times, one
line per run, then a table of failure counts with each failure quoted."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from tests.distributed import RankFailure


def parse_layouts(doc: str, layouts, argv: list[str] | None) -> tuple[list[str], int]:
    """A repeat tool's command line: (the layouts named, all by default; --times, default 20).
    An unknown name is refused naming the choices."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--times", type=int, default=20)
    parser.add_argument("layouts", nargs="*", metavar="LAYOUT", help=f"default: all of {', '.join(layouts)}")
    args = parser.parse_args(argv)
    names = args.layouts or list(layouts)
    unknown = [name for name in names if name not in layouts]
    if unknown:
        parser.error(f"unknown layout {unknown[0]}; choose from {', '.join(layouts)}")
    return names, args.times


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
