"""Run a recipe on this machine through torchrun (CPU gloo or GPU NCCL).

    python -m launch.local --recipe tiny-llama --nproc 4 \
        parallel.tensor_parallel=2 parallel.pipeline_parallel=2

Validates the config against the world size, its paths and its data first (no process is
started for a config that cannot work), then runs torchrun with one process per rank.
SIGTERM, SIGUSR1 or SIGHUP sent to this launcher go to every rank, which finish their
step, save a checkpoint (if checkpoint.dir is set) and exit 0, as under Slurm; Ctrl-C
reaches torchrun and the ranks from the terminal directly. When a rank's hang
watchdog stopped the run, says so (which rank, step, phase, where the stacks are) and exits
75, the watchdog's code (torchrun itself reports any failed worker as 1).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time

from data_pipeline.checks import positive_int, run_cli
from launch.ports import free_port
from pretrain.cli import resolve_config
from pretrain.config import ConfigError, validate_for_world, validate_inputs
from pretrain.observe.watchdog import EXIT_HANG, hang_reports

# What a scheduler or `kill` sends to stop a job; the ranks save on each (pretrain.signals).
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


def torchrun_module(nproc: int, module: str, args: list[str]) -> list[str]:
    """torchrun running `python -m module *args` as nproc ranks on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", module, *args]


def torchrun_command(recipe: str, nproc: int, overrides: list[str], config_file: str | None = None) -> list[str]:
    """The torchrun command line that trains `recipe` with nproc ranks on this machine."""
    cmd = torchrun_module(nproc, "pretrain", ["--recipe", recipe])
    if config_file:
        cmd += ["--config", config_file]
    return cmd + list(overrides)


def run_forwarding_signals(cmd: list[str], env: dict) -> int:
    """Run torchrun; a stop signal sent to this process goes to its ranks.

    To the ranks, not to torchrun: torchrun would pass it on too, but then reports the
    signal it received as its own failure (a traceback, exit 1) although the ranks saved
    and exited 0. Before the ranks exist, torchrun itself gets it (and stops).
    """
    import psutil

    proc = subprocess.Popen(cmd, env=env)

    def forward(signum, frame) -> None:
        try:
            targets = psutil.Process(proc.pid).children() or [psutil.Process(proc.pid)]
        except psutil.Error:
            return  # torchrun already ended
        for target in targets:
            try:
                target.send_signal(signum)
            except psutil.Error:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    # The terminal's Ctrl-C reaches torchrun and the ranks; the launcher waits for them.
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--nproc", type=positive_int, default=1, help="processes (= devices) on this machine")
    parser.add_argument("--config", help="YAML overrides file")
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)

    resolved = []

    def check() -> int:
        config = resolve_config(args.recipe, args.config, args.overrides)
        validate_for_world(config, args.nproc)
        validate_inputs(config)
        resolved.append(config)
        return 0

    code = run_cli(check, bad_input=(ConfigError, ValueError))
    if code:
        return code
    cmd = torchrun_command(args.recipe, args.nproc, args.overrides, args.config)
    if args.dry_run:
        print(shlex.join(cmd))  # quoted: pasting it runs what it says, whatever a value holds
        return 0
    env = dict(os.environ)
    # One intra-op thread per rank: ranks already use every core; more threads thrash on CPU.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    started = time.time()
    code = run_forwarding_signals(cmd, env)
    reports = hang_reports(resolved[0].logging.run_dir, newer_than=started) if code else []
    if reports:
        print(f"error: the hang watchdog stopped the run (exit {EXIT_HANG}; torchrun said {code}): "
              f"{reports[0].read_text().splitlines()[0]}", file=sys.stderr)
        for report in reports:
            print(f"  stacks: {report}", file=sys.stderr)
        return EXIT_HANG
    return code


if __name__ == "__main__":
    sys.exit(main())
