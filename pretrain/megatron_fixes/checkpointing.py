"""dist_checkpointing (torch_dist) save hooks. Known for megatron-core 0.16.1 with torch 2.13.

1. A hook on the save planner's tensors. `MCoreSavePlanner` (strategies/torch.py) inherits
   torch's `DefaultSavePlanner.resolve_data`, which returns each tensor the writer will
   write; the planner resolves all of them before `dist_checkpointing.save` returns.
   `apply()` installs a `resolve_data` on `MCoreSavePlanner` that passes each tensor through
   the converter set by `tensors_through(convert)` (none outside it). Our checkpointing uses
   it to stage an async save into reused shared memory, and to hand a sync save whole-storage
   aliases instead of the clones of every view that the writer would otherwise make
   (pretrain.checkpointing.async_writer says why each matters).
2. The write-results Manager started up front. Every save (sync or async) reports through
   `filesystem_async._get_write_results_queue()`, which spawns a multiprocessing Manager at
   the first save: seconds of start-up, and under Slurm exposed to the stop signal that
   asked for that very save (seen: the Manager killed by USR1 as it started, the stop-save
   failing). `start_write_results_queue()` starts it when the checkpointer is made, as a
   helper that ignores stop signals and dies with its rank, and sets the module global the
   function returns from then on.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from typing import Callable, Optional

import torch

from pretrain.megatron_fixes._guard import expect_absent, expect_sources

SOURCES = {
    # MCoreSavePlanner inherits it; our hook wraps it.
    "torch.distributed.checkpoint.default_planner:DefaultSavePlanner.resolve_data": "852bcff10b56dac7",
    # Creates the Manager lazily from the module global we set.
    "megatron.core.dist_checkpointing.strategies.filesystem_async:_get_write_results_queue": "349269cbdd569d41",
}
# (key, chunk offset), tensor -> the tensor to write instead; None = write as is.
_CONVERT: list[Optional[Callable]] = [None]


@contextlib.contextmanager
def tensors_through(convert: Callable):
    """Within: every tensor a torch_dist save writes goes through convert((key, offset), t)."""
    if _CONVERT[0] is not None:
        raise RuntimeError("tensors_through() does not nest")
    _CONVERT[0] = convert
    try:
        yield
    finally:
        _CONVERT[0] = None


def _install_resolve_data_hook() -> None:
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner

    owner = "megatron.core.dist_checkpointing.strategies.torch:MCoreSavePlanner"
    expect_absent("checkpointing", owner, "resolve_data")
    inherited = MCoreSavePlanner.resolve_data

    def resolve_data(self, write_item):
        data = inherited(self, write_item)
        convert = _CONVERT[0]
        if convert is not None and isinstance(data, torch.Tensor):
            data = convert((write_item.index.fqn, tuple(write_item.index.offset or ())), data)
        return data

    MCoreSavePlanner.resolve_data = resolve_data


def start_write_results_queue(initializer: Callable) -> None:
    """Start dist_checkpointing's write-results Manager now (see 2 above); `initializer` runs
    in the Manager process (ours: ignore stop signals, die with the rank)."""
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=initializer)
        filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive


def apply() -> None:
    expect_sources("checkpointing", SOURCES)
    _install_resolve_data_hook()
