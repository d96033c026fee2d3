"""Run a recipe on this machine through torchrun (CPU gloo or GPU NCCL).

    python -m launch.local --recipe tiny-llama --nproc 4 \
        parallel.tensor_parallel=2 parallel.pipeline_parallel=2

Validates the config against the world size first (no processes are started for a config
that cannot work), then runs torchrun with one process per rank. When a rank's hang
watchdog stopped the run, says so (which rank, step, phase, where the stacks are) and exits
75, the watchdog's code (torchrun itself reports any failed worker as 1).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from pretrain.cli import resolve_config
from pretrain.config import ConfigError, validate_for_world
from pretrain.observe.watchdog import EXIT_HANG, hang_reports


def torchrun_command(recipe: str, nproc: int, overrides: list[str], config_file: str | None = None) -> list[str]:
    """The torchrun command line that trains `recipe` with nproc ranks on this machine."""
    import socket

    with socket.socket() as s:  # a free port, so concurrent local runs do not collide
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "pretrain", "--recipe", recipe]
    if config_file:
        cmd += ["--config", config_file]
    return cmd + list(overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--nproc", type=int, default=1, help="processes (= devices) on this machine")
    parser.add_argument("--config", help="YAML overrides file")
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    try:
        config = resolve_config(args.recipe, args.config, args.overrides)
        validate_for_world(config, args.nproc)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cmd = torchrun_command(args.recipe, args.nproc, args.overrides, args.config)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    env = dict(os.environ)
    # One intra-op thread per rank: ranks already use every core; more threads thrash on CPU.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    started = time.time()
    code = subprocess.call(cmd, env=env)
    reports = hang_reports(config.logging.run_dir, newer_than=started) if code else []
    if reports:
        print(f"error: the hang watchdog stopped the run (exit {EXIT_HANG}; torchrun said {code}): "
              f"{reports[0].read_text().splitlines()[0]}", file=sys.stderr)
        for report in reports:
            print(f"  stacks: {report}", file=sys.stderr)
        return EXIT_HANG
    return code


if __name__ == "__main__":
    sys.exit(main())
