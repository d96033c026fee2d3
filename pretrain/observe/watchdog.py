"""The hang watchdog: a per-rank thread that turns a stuck step into a requeue.

The loop marks progress (`begin_step`, `end_step`, each evaluation batch through
`batches("evaluation", n)`) and the phases that may legitimately take long: writing a
profiler trace is not timed, `paused("checkpoint save", save_timeout_s)` has its own
timeout. If a rank spends longer than the timeout in a watched phase, the watchdog thread
writes <run_dir>/hang/rank_<r>.<time>.txt: the step, the phase, the last collectives
torch's flight recorder holds and every thread's Python stack (faulthandler), then exits
the process with EXIT_HANG (75, sysexits' EX_TEMPFAIL). launch.slurm's job script requeues
the job on it (the run resumes from its last checkpoint); launch.local reports it.

Timeout: startup_timeout_s for the run's first step (one-time costs: lazy communicator
creation, allocator warm-up, compilation); then `watchdog.timeout_s`, or derived:
max(min_timeout_s, step_time_factor x the median of the last 50 step times), with
startup_timeout_s until 5 steps are timed.

Cost per step: a few attribute stores on the training thread; the watchdog thread wakes
once a second. The thread can run while the training thread is blocked: torch releases
the GIL inside collectives and operators. (A C extension that blocks while holding the
GIL would stall the watchdog too; the process group's own timeout is the backstop there.)

nvidia-resiliency-ext's fault_tolerance (heartbeat monitor processes started by its own
launcher, ft_launcher) was evaluated and not used: see docs/observability.md, "Hang watchdog".
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from pretrain.config import WatchdogConfig

EXIT_HANG = 75
HANG_DIR = "hang"
WARMUP_STEPS = 5


def enable_flight_recorder(cfg: WatchdogConfig) -> None:
    """Ask torch to record the last collectives of every process group (read from the
    environment when the process group is created: call before init_process_group)."""
    if cfg.enabled and cfg.flight_recorder_entries:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(cfg.flight_recorder_entries))


def flight_recorder_entries() -> list[dict]:
    """Every entry torch's flight recorder holds on this rank, oldest first (raises if this
    torch has no flight recorder)."""
    import torch._C._distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace_json", None) or c10d._dump_nccl_trace_json
    return json.loads(dump(True, False)).get("entries", [])


def group_sizes() -> dict[str, int]:
    """Process-group name (the flight recorder's `process_group[0]`) -> number of ranks.
    The recorder's own `pg_config` lists no ranks for gloo groups (torch 2.13)."""
    from torch.distributed import distributed_c10d

    return {name: pg.size() for pg, name in distributed_c10d._world.pg_names.items()}


def last_collectives(limit: int = 8) -> list[str]:
    """The newest entries of torch's flight recorder, one line each (oldest first)."""
    try:
        entries = flight_recorder_entries()
    except Exception as exc:  # a report without it is still worth writing
        return [f"(flight recorder unavailable: {type(exc).__name__}: {exc})"]
    if not entries:
        return ["(none recorded: the flight recorder is off, watchdog.flight_recorder_entries=0, "
                "or TORCH_FR_BUFFER_SIZE=0)"]
    lines = []
    for e in entries[-limit:]:
        group = e.get("process_group") or ["?", "?"]
        lines.append(f"{e.get('profiling_name')} on group {group[1]} (pg {group[0]}), "
                     f"collective #{e.get('collective_seq_id')}, p2p #{e.get('p2p_seq_id')}, "
                     f"inputs {e.get('input_sizes')}, state {e.get('state')}")
    return lines


class Watchdog:
    """Create it, `start()` it before the loop and `stop()` it after."""

    def __init__(self, cfg: WatchdogConfig, run_dir: str, rank: int, poll_s: float = 1.0):
        self.cfg, self.rank, self.poll_s = cfg, rank, poll_s
        self.dir = Path(run_dir) / HANG_DIR
        self._durations: collections.deque = collections.deque(maxlen=50)
        self._step = 0
        self._phase = "start-up"
        self._since = time.monotonic()
        self._watched = False
        self._phase_limit: Optional[tuple[float, str]] = None  # a paused phase's own timeout
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- called by the training thread (cheap: attribute stores)

    def begin_setup(self) -> None:
        """Watch set-up from here (rendezvous, checksums, checkpoint loading, dataset indices):
        all of it within watchdog.startup_timeout_s. Starts the thread."""
        self._phase, self._since, self._watched = "set-up", time.monotonic(), True
        self.start()

    def setup_phase(self, name: str) -> None:
        """Name the set-up step now running (for the report); the set-up clock runs on."""
        self._phase = f"set-up: {name}"

    def begin_step(self, step: int) -> None:
        self._step, self._phase, self._since, self._watched = step, "train step", time.monotonic(), True

    def end_step(self, duration_s: float) -> None:
        """The step's compute is done (logging and the stop check stay watched)."""
        self._durations.append(duration_s)
        self._phase = "after the step (logging, straggler report, stop check)"

    @contextlib.contextmanager
    def batches(self, phase: str, total: int):
        """A phase made of `total` batches (evaluation): yields `begin(i)`, to call before
        batch i (1-based). Each batch is timed by the step timeout, as a training step is
        (a forward-only batch of the same size does less work), so a long evaluation is not a
        hang and a batch stuck in a collective is. The step clock restarts after it."""
        previous = self._phase

        def begin(index: int) -> None:
            self._phase, self._since = f"{phase}, batch {index} of {total}", time.monotonic()

        try:
            yield begin
        finally:
            self._phase, self._since = previous, time.monotonic()

    @contextlib.contextmanager
    def paused(self, phase: str, timeout_s: Optional[float] = None, source: str = ""):
        """A phase that may take long by design (a checkpoint save, writing a trace): not
        timed by the step timeout; timed by `timeout_s` (named by `source` in the report) if
        given. The step clock restarts after it."""
        # The clock moves before the limit changes: the thread, holding the old clock, then
        # fails its `since == self._since` check instead of judging it by the new limit.
        previous = self._phase
        if timeout_s is None:
            self._watched, self._phase = False, phase
        else:
            self._phase, self._since = phase, time.monotonic()
            self._phase_limit = (timeout_s, source)
        try:
            yield
        finally:
            self._phase, self._since = previous, time.monotonic()
            self._phase_limit, self._watched = None, True

    # ---- the watchdog thread

    def timeout(self) -> tuple[float, str]:
        """The timeout now, and where it comes from."""
        if self._phase_limit is not None:
            return self._phase_limit
        if not self._durations:
            return self.cfg.startup_timeout_s, "watchdog.startup_timeout_s (set-up and the run's first step)"
        if self.cfg.timeout_s is not None:
            return self.cfg.timeout_s, "watchdog.timeout_s"
        durations = list(self._durations)
        if len(durations) < WARMUP_STEPS:
            return self.cfg.startup_timeout_s, f"watchdog.startup_timeout_s (fewer than {WARMUP_STEPS} steps timed)"
        median = statistics.median(durations)
        derived = self.cfg.step_time_factor * median
        if derived <= self.cfg.min_timeout_s:
            return self.cfg.min_timeout_s, "watchdog.min_timeout_s"
        return derived, f"{self.cfg.step_time_factor:g} x the median step time {median:.2f} s"

    def start(self) -> None:
        if self.cfg.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if not self._watched:
                continue
            since = self._since
            limit, source = self.timeout()
            stalled = time.monotonic() - since
            if self._watched and since == self._since and stalled > limit:
                self._fire(stalled, limit, source)

    def _fire(self, stalled: float, limit: float, source: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self.dir / f"rank_{self.rank}.{stamp}.txt"
        header = [
            f"hang watchdog: rank {self.rank} (pid {os.getpid()}, host {socket.gethostname()}) made no "
            f"progress for {stalled:.1f} s; timeout {limit:.1f} s ({source})",
            f"step {self._step}, phase: {self._phase}",
            f"last steps took (s): {', '.join(f'{d:.3f}' for d in list(self._durations)[-5:]) or 'none finished'}",
            "last collectives of this rank (torch flight recorder, oldest first):",
            *(f"  {line}" for line in last_collectives()),
            "Python stacks of every thread of this rank (faulthandler, most recent call first):",
        ]
        with open(path, "w") as f:
            f.write("\n".join(header) + "\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        print(f"[rank {self.rank}] hang watchdog: no progress in step {self._step} ({self._phase}) for "
              f"{stalled:.0f} s (timeout {limit:.0f} s); stacks in {path}; exiting with {EXIT_HANG} "
              "so the launcher can requeue", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_HANG)


def hang_reports(run_dir: str, newer_than: float = 0.0) -> list[Path]:
    """Watchdog reports under a run directory written after `newer_than` (a time.time())."""
    folder = Path(run_dir) / HANG_DIR
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("rank_*.txt") if p.stat().st_mtime >= newer_than)
