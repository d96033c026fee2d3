"""Megatron-Core's timer hook, used for profiler ranges and per-rank compute time.

Megatron-Core calls `config.timers(name, log_level=...).start()` / `.stop()` around the
forward and backward compute of every micro-batch ('forward-compute', 'backward-compute'),
pipeline sends/receives ('forward-recv', ...), the gradient all-reduce ('all-grads-sync')
and the optimizer's parts ('optimizer-inner-step', ...) whenever `ModelParallelConfig.timers`
/ `OptimizerConfig.timers` is set (megatron/core/pipeline_parallel/schedules.py,
distributed/finalize_model_grads.py, optimizer/optimizer.py). It is None by default, and we
set it only when a profiler window or the straggler report needs it: zero cost otherwise.
Megatron-LM's own `Timers` cannot be used here: it synchronizes CUDA at every start/stop.

`StepTimers` does two things with those calls:
- ranges: during a profiler window, each timer becomes a `record_function` range (torch
  mode: the Chrome trace shows forward/backward/optimizer) or an NVTX range (nsys mode);
  'forward-compute' is named "forward", 'backward-compute' "backward";
- compute time: the seconds this rank spent in forward/backward compute (excluding pipeline
  waits, the gradient all-reduce and the optimizer), for the straggler report. On GPU from
  CUDA events, read after the step (whose loss `.item()` has synchronized the device).
"""

from __future__ import annotations

import time
from typing import Literal, Optional

import torch

RANGE_NAMES = {"forward-compute": "forward", "backward-compute": "backward"}
COMPUTE = frozenset(RANGE_NAMES)
RangeMode = Optional[Literal["record_function", "nvtx"]]


class _Timer:
    __slots__ = ("owner", "label", "compute", "_range", "_t0", "_event")

    def __init__(self, owner: "StepTimers", name: str):
        self.owner = owner
        self.label = RANGE_NAMES.get(name, name)
        self.compute = name in COMPUTE and owner.measure_compute
        self._range = None
        self._t0 = 0.0
        self._event = None

    def start(self, barrier: bool = False) -> None:
        mode = self.owner.ranges
        if mode == "record_function":
            self._range = torch.autograd.profiler.record_function(self.label)
            self._range.__enter__()
        elif mode == "nvtx":
            torch.cuda.nvtx.range_push(self.label)
            self._range = "nvtx"
        if self.compute:
            if self.owner.cuda:
                self._event = torch.cuda.Event(enable_timing=True)
                self._event.record()
            else:
                self._t0 = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        if self.compute:
            if self.owner.cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.owner._events.append((self._event, end))
            else:
                self.owner._compute_s += time.perf_counter() - self._t0
        if self._range == "nvtx":
            torch.cuda.nvtx.range_pop()
        elif self._range is not None:
            self._range.__exit__(None, None, None)
        self._range = None


class StepTimers:
    """The object set as Megatron-Core's `config.timers` (callable: name -> timer)."""

    def __init__(self, measure_compute: bool):
        self.measure_compute = measure_compute
        self.cuda = torch.cuda.is_available()
        self.ranges: RangeMode = None  # set by the profiler for its window
        self._timers: dict[str, _Timer] = {}
        self._compute_s = 0.0
        self._events: list = []

    def __call__(self, name: str, log_level: Optional[int] = None) -> _Timer:
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = _Timer(self, name)
        return timer

    def take_compute_s(self) -> float:
        """Compute seconds since the last call (call after a step: on GPU the events must
        have completed, which the step's loss `.item()` guarantees)."""
        total = self._compute_s + sum(a.elapsed_time(b) for a, b in self._events) / 1000
        self._compute_s, self._events = 0.0, []
        return total


def install(state, timers: Optional[StepTimers]) -> None:
    """Set (or clear, with None) the timers on the model chunks' and the optimizers' configs."""
    from megatron.core.utils import get_model_config

    for chunk in state.model:
        get_model_config(chunk).timers = timers
    optimizer = state.optimizer
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "config", None) is not None:
            opt.config.timers = timers
