"""Run multi-node test modules N times in a row and count the failures (not part of the suite).

    python -m tests.launch.repeat_multinode --times 5                       # the elastic module
    python -m tests.launch.repeat_multinode --times 20 tests/launch/test_multinode.py

A test on the namespace cluster is trusted after it passed this many times in a row: its
timings (heartbeats, SlurmdTimeout, rendezvous) vary with the machine's load, which one run
would not show. Each run is a fresh pytest process with its own --basetemp (kept when the run
failed, for the post-mortem) and its whole output in OUT/run-<i>.log. Prints one line per
run (the result and what the tests printed) and the failures, quoted, at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT = ["tests/launch/test_multinode_elastic.py"]


def _failure_lines(output: str) -> list[str]:
    """pytest's short summary (FAILED/ERROR lines) and the first assertion line ('E ...')."""
    summary = [ln for ln in output.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    first_e = next((ln.strip() for ln in output.splitlines() if ln.startswith("E ")), None)
    return summary + ([first_e[:400]] if first_e else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--times", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("/tmp/repeat-multinode"),
                        help="where each run's log and (failed runs') test folders go")
    parser.add_argument("modules", nargs="*", default=DEFAULT, help=f"test files (default: {' '.join(DEFAULT)})")
    args = parser.parse_args(argv)
    missing = [m for m in args.modules if not (REPO / m).is_file()]
    if missing:
        parser.error(f"no test file {missing[0]} (paths are relative to {REPO})")
    if args.times < 1:
        parser.error(f"--times {args.times} must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for i in range(1, args.times + 1):
        basetemp = args.out / f"run-{i}"
        shutil.rmtree(basetemp, ignore_errors=True)
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "pytest", *args.modules, "-q", "-s", "-p", "no:cacheprovider",
                                 f"--basetemp={basetemp}"], cwd=REPO, env=env, capture_output=True, text=True)
        output = result.stdout + result.stderr
        (args.out / f"run-{i}.log").write_text(output)
        # pytest's result line ("3 passed in 127.78s"); stderr (the ranks' noise) comes after it.
        tail = next((ln for ln in reversed(result.stdout.splitlines()) if " in " in ln and
                     ("passed" in ln or "failed" in ln or "error" in ln)), "(no pytest result line)")
        print(f"run {i}/{args.times}: exit {result.returncode}, {tail} ({time.monotonic() - start:.0f} s)", flush=True)
        if result.returncode != 0:
            failures += [f"run {i}: {ln}" for ln in _failure_lines(output) or [tail]]
        else:
            shutil.rmtree(basetemp, ignore_errors=True)
    failed_runs = len({f.split(':')[0] for f in failures})
    print(f"\n{failed_runs}/{args.times} run(s) failed; logs in {args.out}")
    for line in failures:
        print(f"    {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
