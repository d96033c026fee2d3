"""The step profiler: torch.profiler (or nsys) over a window of steps on chosen ranks.

    # profile steps 10 and 11 on ranks 0 and 1: <run_dir>/profile/rank_<r>/trace.json.gz
    python -m launch.local --recipe tiny-llama --nproc 2 profile.start_step=10 profile.ranks=[0,1]

torch mode: the window starts one step early when it can (a warm-up step the profiler
discards: its first step carries the profiler's own start-up), records CPU (+ CUDA)
activity, shapes and memory, then writes a Chrome/Perfetto trace per rank and a table of
the top operators (printed by the lowest profiled rank, written by each as top_ops.txt).
Forward, backward and optimizer show as ranges (`pretrain.observe.timers`).

nsys mode (CUDA): cudaProfilerStart/Stop around the window and NVTX ranges, for
`nsys profile --capture-range=cudaProfilerApi` (docs/observability.md, "Profiler").

A memory snapshot (CUDA) records the caching allocator's history during one step and dumps
it as memory_snapshot.pickle (pytorch.org/memory_viz).

With the flight recorder on (the watchdog's, on by default), each profiled rank also writes
collectives.json: the collectives the window's steps issued, as the process groups' backends
ran them, with each group's size (`launch.comm_replay` replays them).

Off (profile.start_step unset, or a rank not in profile.ranks): `build` returns None and
the loop calls nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

from pretrain.config import ConfigError, ExperimentConfig, ProfileConfig
from pretrain.observe.timers import StepTimers

TRACE = "trace.json.gz"
TOP_OPS = "top_ops.txt"
SNAPSHOT = "memory_snapshot.pickle"
COLLECTIVES = "collectives.json"


def profile_dir(config: ExperimentConfig) -> Path:
    return Path(config.profile.dir or Path(config.logging.run_dir) / "profile")


def profiles_rank(profile: ProfileConfig, rank: int) -> bool:
    active = profile.start_step is not None or profile.memory_snapshot_step is not None
    return active and (profile.ranks == "all" or rank in profile.ranks)


def rank_dir(config: ExperimentConfig, rank: int) -> Path:
    return profile_dir(config) / f"rank_{rank}"


def check_writable(config: ExperimentConfig, rank: int) -> None:
    """Create this rank's profile directory and prove it writable, before training starts
    (a profile that fails to write after hours of training is lost)."""
    if not profiles_rank(config.profile, rank):
        return
    where = rank_dir(config, rank)
    try:
        where.mkdir(parents=True, exist_ok=True)
        probe = where / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"profile directory {where} is not writable ({exc.strerror or exc}); set "
                          "profile.dir to a directory this rank can write") from None


class StepProfiler:
    """Call `before_step(step)` and `after_step(step)` around every step."""

    def __init__(self, config: ExperimentConfig, rank: int, timers: StepTimers, start_step: int, log):
        self.cfg = config.profile
        self.rank, self.timers, self.log = rank, timers, log
        self.out = rank_dir(config, rank)
        self.print_table = rank == (0 if self.cfg.ranks == "all" else min(self.cfg.ranks))
        first = self.cfg.start_step
        self.window = range(first, first + self.cfg.num_steps) if first is not None else range(0)
        # A warm-up step before the window, unless the window starts at this run's first step.
        self.warmup = 1 if first is not None and first - 1 > start_step else 0
        self.prof = None
        self._window_ns: Optional[int] = None  # when the window's first step began

    def before_step(self, step: int) -> None:
        if step == self.cfg.memory_snapshot_step:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        if self.window and step == self.window.start:
            self._window_ns = time.time_ns()
        if not self.window or step != self.window.start - self.warmup:
            return
        if self.cfg.mode == "nsys":
            torch.cuda.profiler.start()
            self.timers.ranges = "nvtx"
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=self.warmup, active=self.cfg.num_steps, repeat=1),
            on_trace_ready=self._write,
            record_shapes=self.cfg.record_shapes,
            profile_memory=self.cfg.profile_memory,
            with_stack=self.cfg.with_stack,
        )
        self.prof.start()
        self.timers.ranges = "record_function"

    def after_step(self, step: int) -> None:
        if step == self.cfg.memory_snapshot_step:
            torch.cuda.memory._dump_snapshot(str(self.out / SNAPSHOT))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.log(f"rank {self.rank}: CUDA memory snapshot of step {step} in {self.out / SNAPSHOT}")
        if self.window and step == self.window.stop - 1:
            self._write_collectives()
        if self.cfg.mode == "nsys":
            if step == self.window.stop - 1:
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
                self.timers.ranges = None
            return
        if self.prof is not None:
            self.prof.step()  # after the last active step this calls _write
            if step == self.window.stop - 1:
                self.close()

    def close(self) -> None:
        """Stop the profiler (the loop calls this at the end too: a run that stops inside the
        window still writes what it recorded)."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            self.timers.ranges = None
            prof.stop()

    def _write_collectives(self) -> None:
        """The flight recorder's entries from the window's steps (none written when it is off)."""
        from pretrain.observe.watchdog import flight_recorder_entries, group_sizes

        if self._window_ns is None or not torch.distributed.is_initialized():
            return
        try:  # both read torch internals (private in 2.13)
            entries, sizes = flight_recorder_entries(), group_sizes()
        except Exception as exc:  # this torch has none: the profile is still worth having
            self.log(f"rank {self.rank}: no collectives.json ({type(exc).__name__}: {exc})")
            return
        if not entries:
            return
        keep = ("profiling_name", "process_group", "input_sizes", "output_sizes", "input_dtypes")
        window = [{k: e.get(k) for k in keep} for e in entries if e.get("time_created_ns", 0) >= self._window_ns]
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / COLLECTIVES).write_text(json.dumps({
            "steps": [self.window.start, self.window.stop - 1],
            # The recorder keeps its newest entries only: a window that issued more lost its first.
            "may_be_truncated": len(entries) >= int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) > 0
            and len(window) == len(entries),
            "group_sizes": sizes, "entries": window}))

    def _write(self, prof) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out / TRACE))
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=self.cfg.top_ops)
        (self.out / TOP_OPS).write_text(table + "\n")
        steps = f"{self.window.start}-{self.window.stop - 1}" if len(self.window) > 1 else str(self.window.start)
        self.log(f"rank {self.rank}: profile of steps {steps} in {self.out / TRACE}")
        if self.print_table:
            self.log(f"top operators of rank {self.rank}, steps {steps} (by {sort}):\n{table}")


def build(config: ExperimentConfig, rank: int, timers: Optional[StepTimers], start_step: int, log
          ) -> Optional[StepProfiler]:
    """The profiler for this rank, or None when it profiles nothing (or the window is past)."""
    cfg = config.profile
    if timers is None or not profiles_rank(cfg, rank):
        return None
    # A window that began before this (resumed) run's first step is not profiled.
    window_left = cfg.start_step is not None and cfg.start_step > start_step
    snapshot_left = cfg.memory_snapshot_step is not None and cfg.memory_snapshot_step > start_step
    if not (window_left or snapshot_left):
        return None
    return StepProfiler(config, rank, timers, start_step, log)
