"""The async checkpoint writer's parts on their own: staging memory and the writer process.
(End to end, async saves are checked by exact resume in test_checkpoint.py.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

from pretrain.checkpointing.async_writer import StagingPool, WriterCaller, WriterError


def test_staging_reuses_one_shared_buffer_per_chunk():
    pool = StagingPool()
    source = torch.arange(12, dtype=torch.float32).view(3, 4)
    first = pool.stage(("w", (0, 0)), source[1:])  # a view, as DDP parameters are
    assert first.is_shared() and torch.equal(first, source[1:])
    # its own storage: dist_checkpointing's writer does not clone it again
    assert first.untyped_storage().nbytes() == first.numel() * first.element_size()
    source.add_(100)
    again = pool.stage(("w", (0, 0)), source[1:])
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, source[1:])
    assert pool.nbytes == 8 * 4


def test_room_for_counts_main_replicas_beyond_what_is_staged(monkeypatch):
    pool = StagingPool()
    main = ShardedTensor.from_rank_offsets("a", torch.zeros(1000), replica_id=0)
    replica = ShardedTensor.from_rank_offsets("b", torch.zeros(5000), replica_id=1)  # not written here
    monkeypatch.setattr(pool, "shm_free", lambda: (64 << 20) + 4000)
    assert pool.room_for({"a": main, "b": replica}) == (True, 4000)
    monkeypatch.setattr(pool, "shm_free", lambda: (64 << 20) + 3999)
    assert pool.room_for({"a": main, "b": replica}) == (False, 4000)


def _write(path: str, text: str) -> None:
    Path(path).write_text(text)


def _fail(message: str) -> None:
    raise OSError(message)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _request(fn, *args, call_idx=0) -> AsyncRequest:
    return AsyncRequest(fn, args, [], call_idx=call_idx)


def test_writer_runs_requests_in_order_and_reports_failures(tmp_path):
    caller = WriterCaller()
    try:
        caller.schedule_async_call(_request(_write, str(tmp_path / "a"), "one", call_idx=0))
        assert caller.is_current_async_call_done(blocking=True, no_dist=True)
        assert (tmp_path / "a").read_text() == "one"
        caller.schedule_async_call(_request(_fail, "disk full", call_idx=1))
        with pytest.raises(WriterError, match="OSError: disk full"):
            caller.is_current_async_call_done(blocking=True, no_dist=True)
    finally:
        caller.close()
    assert caller.process is None


def test_a_dead_writer_is_an_error_not_a_hang():
    caller = WriterCaller()
    try:
        caller.schedule_async_call(_request(_sleep, 60.0))
        assert not caller.is_current_async_call_done(blocking=False, no_dist=True)
        os.kill(caller.process.pid, signal.SIGKILL)
        with pytest.raises(WriterError, match="writer process died"):
            caller.is_current_async_call_done(blocking=True, no_dist=True)
    finally:
        caller.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sync_save_aliases_views_instead_of_cloning(dtype):
    from pretrain.checkpointing.async_writer import own_storage_alias

    whole = torch.arange(40).to(dtype)
    view = whole[10:30].view(4, 5)  # a parameter inside DDP's flat buffer
    alias = own_storage_alias(view)
    assert alias.dtype == dtype and alias.shape == view.shape and torch.equal(alias, view)
    assert alias.data_ptr() == view.data_ptr()  # no copy
    assert alias.untyped_storage().nbytes() == 20 * whole.element_size()  # so no clone either


@pytest.mark.parametrize("env, expected", [
    ({"LOCAL_WORLD_SIZE": "4"}, 4), ({"SLURM_TASKS_PER_NODE": "8(x2)"}, 8),
    ({"SLURM_TASKS_PER_NODE": "4,3"}, 4), ({}, 1),
])
def test_staging_room_is_shared_by_the_node_ranks(monkeypatch, env, expected):
    from pretrain.checkpointing.async_writer import _ranks_on_this_node

    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _ranks_on_this_node() == expected


def _report(rank: int, written: list, results) -> None:
    """Reports as dist_checkpointing's write function does: into the queue it is given."""
    results.put({rank: written})


def test_the_writer_sends_write_results_back_to_the_trainer_queue(tmp_path):
    """No Manager process: the trainer's results queue is in-process; the writer gives the
    write function a queue of its own and the results come back with its done message."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from pretrain.megatron_fixes.dist_checkpointing import write_results_queue

    results = write_results_queue()
    assert isinstance(results, queue.Queue) and filesystem_async.get_write_results_queue() is results
    caller = WriterCaller()
    try:
        caller.schedule_async_call(_request(_report, 3, ["shard_0.distcp"], results))
        assert caller.is_current_async_call_done(blocking=True, no_dist=True)
        assert results.get_nowait() == {3: ["shard_0.distcp"]} and results.empty()
    finally:
        caller.close()


def test_no_helper_process_until_the_first_async_save(tmp_path):
    """Making the checkpointer starts nothing (a run whose only save is its last one, written
    in-process, never starts the ~4.5 CPU-s writer interpreter)."""
    import multiprocessing

    from pretrain.checkpointing.checkpointer import Checkpointer
    from pretrain.recipes import get_recipe

    config = get_recipe("tiny-llama")
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(
        update={"dir": str(tmp_path), "async_save": True})})
    before = set(multiprocessing.active_children())
    saver = Checkpointer(config, 1, print)
    assert set(multiprocessing.active_children()) == before and saver._queue is None
    saver.close()
