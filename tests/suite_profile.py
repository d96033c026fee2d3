"""Where the suite's time goes: a pytest plugin that records each test phase's wall time and
the CPU time the whole machine spent meanwhile (/proc/stat: the ranks, Slurm jobs and daemons
a test starts included, which pytest's own timing and `time`'s user CPU miss).

    PYTEST_ADDOPTS="-p tests.suite_profile" SUITE_PROFILE=/tmp/profile.jsonl bash dev.sh test
    python -m tests.suite_profile /tmp/profile.jsonl        # per module: wall, busy CPU, idle

A module whose busy CPU is well under 2 x wall on a 2-core machine waits (one process at a
time, sleeps, Slurm scheduling); one near it is CPU-bound, and only less work shortens it.
Linux only; with SUITE_PROFILE unset the plugin records nothing.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import pytest

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu() -> tuple[float, float]:
    """(busy, total) CPU-seconds of the machine since boot."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / _TICK, sum(values) / _TICK


def _record(phase: str, item):
    path = os.environ.get("SUITE_PROFILE")
    if not path:
        yield
        return
    started, (busy, _) = time.time(), _cpu()
    yield
    record = {"id": item.nodeid, "phase": phase, "start": started, "wall": time.time() - started,
              "busy": _cpu()[0] - busy}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _record("setup", item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _record("call", item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _record("teardown", item)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tests.suite_profile PROFILE.jsonl", file=sys.stderr)
        return 2
    modules: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    with open(argv[0]) as f:
        for line in f:
            record = json.loads(line)
            totals = modules[record["id"].split("::")[0]]
            totals[0] += record["wall"]
            totals[1] += record["busy"]
    cores = os.cpu_count() or 1
    print(f"{'wall s':>8} {'busy CPU-s':>10} {'idle core-s':>11}  module ({cores} cores)")
    for module, (wall, busy) in sorted(modules.items(), key=lambda kv: -kv[1][0]):
        print(f"{wall:8.0f} {busy:10.0f} {cores * wall - busy:11.0f}  {module}")
    wall, busy = (sum(v[i] for v in modules.values()) for i in (0, 1))
    print(f"{wall:8.0f} {busy:10.0f} {cores * wall - busy:11.0f}  all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
