"""Async checkpoint writing whose training stall is one memcpy of the state.

Megatron-Core's default async path (TemporalAsyncCaller) clones every CPU tensor that is a
view (all DDP parameters and optimizer states are) into freshly allocated memory, then
forks the training process to write. Both cost the training process: fresh pages fault
in at ~1 GB/s on these machines (a 1.6 GB clone: 1.6 s), and after the fork every page
the next optimizer step writes is copied once more (copy-on-write: another 1.6 s, not
visible in the save call but in the steps after it).

Here instead:
- `StagingPool`: one shared-memory tensor per written chunk, allocated by the first save
  and reused, so later saves copy into memory that is already paged in (~10 GB/s);
- `staging(pool)`: while dist_checkpointing plans a save, every tensor it will write is
  copied into the pool and handed over in its place;
- `WriterCaller`: one writer process, spawned at the first async save (a fresh
  interpreter, no copy of the trainer's memory: it costs ~4.5 CPU-s of imports, which a run
  that never saves asynchronously should not pay), receives each save's write plan with
  handles to the shared staging tensors, runs dist_checkpointing's own file writer on it
  and sends the write results back with its done message (megatron_fixes.dist_checkpointing
  fix 2: no Manager process).

The next save waits for the previous one (Checkpointer.save), so a staging tensor is never
overwritten while the writer still reads it.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import signal
import traceback

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import is_main_replica
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCaller, AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.dist_checkpointing.utils import extract_sharded_base

from pretrain.megatron_fixes import dist_checkpointing as checkpointing_fixes
from pretrain.megatron_fixes.dist_checkpointing import tensors_through
from pretrain.runtime import collective_device

SHM_MARGIN = 64 << 20  # left free in the tmpfs for everything else that uses it


class WriterError(RuntimeError):
    """The checkpoint writer process failed or died; the message says how."""


class StagingPool:
    """Reused shared-memory copies of the tensors a save writes, by (key, chunk offset)."""

    def __init__(self, shm_dir: str = "/dev/shm") -> None:
        self._tensors: dict[tuple, torch.Tensor] = {}
        self.shm_dir = shm_dir
        # One save strategy for every async save, so that saves after the first reuse its
        # validated global plan and metadata instead of planning again (the same model and
        # layout write the same chunks every time).
        self.strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def stage(self, key: tuple, data: torch.Tensor) -> torch.Tensor:
        buf = self._tensors.get(key)
        if buf is None or buf.shape != data.shape or buf.dtype != data.dtype:
            buf = self._tensors[key] = self._allocate(data)
        buf.copy_(data.detach())
        return buf

    def shm_free(self) -> int:
        """Bytes that new staging memory may take: free space in the tmpfs, and no more than
        the memory the machine has available (a tmpfs is sized apart from RAM)."""
        free = 1 << 62
        if os.path.isdir(self.shm_dir):
            stat = os.statvfs(self.shm_dir)
            free = stat.f_bavail * stat.f_frsize
        return min(free, _mem_available())

    def room_for(self, sharded_state: dict) -> tuple[bool, int]:
        """(whether this rank's part of the next save fits the shared memory, bytes needed).
        A full tmpfs kills the trainer with SIGBUS when a page is first touched, so the
        caller asks before a save and all ranks agree on the answer."""
        need = sum(sh.data.numel() * sh.data.element_size()
                   for sh in nested_values(extract_sharded_base(sharded_state)[0])
                   if sh.data is not None and is_main_replica(sh.replica_id))
        # Every rank on this node stages its share from the same tmpfs and RAM at once.
        local_ranks = _ranks_on_this_node()
        return (need - self.nbytes) * local_ranks <= self.shm_free() - SHM_MARGIN, need

    def _allocate(self, data: torch.Tensor) -> torch.Tensor:
        need = data.numel() * data.element_size()
        if need > self.shm_free():  # room_for() said yes; still never risk a SIGBUS
            raise WriterError(f"no room for {need / 2**20:.0f} MiB more in {self.shm_dir}")
        # Straight into shared memory (share_memory_() would allocate privately, then copy).
        storage = torch.UntypedStorage._new_shared(need)
        return torch.empty(0, dtype=data.dtype).set_(storage, 0, data.shape)


def _ranks_on_this_node() -> int:
    """Ranks sharing this node's memory: torchrun's LOCAL_WORLD_SIZE, else Slurm's tasks per
    node (srun starts the ranks itself; SLURM_TASKS_PER_NODE reads like "8(x2)" or "4,3")."""
    value = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") \
        or os.environ.get("SLURM_TASKS_PER_NODE", "1")
    digits = ""
    for char in value:
        if not char.isdigit():
            break
        digits += char
    return max(1, int(digits or 1))


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # not Linux: unknown, not limited here


def staging(pool: StagingPool):
    """Async save: every tensor written is first copied into the pool."""
    return tensors_through(pool.stage)


def without_clones():
    """Sync save: nothing changes while it writes, yet dist_checkpointing clones every CPU
    tensor that is a view (all parameters and optimizer states are) into fresh memory: the
    whole state twice over (a ~1B model's 15 GB no longer fit in 24 GB), and ~1 s per GB
    of page faults. Each tensor is handed over as an alias with its own storage instead."""
    return tensors_through(lambda key, data: own_storage_alias(data))


def own_storage_alias(data: torch.Tensor) -> torch.Tensor:
    """`data` (a contiguous CPU view) as a tensor whose storage is exactly its bytes, without
    a copy: torch's checkpoint writers clone any tensor whose storage is larger. The alias is
    a slice of the owner's storage (same memory; the owner stays resizable, which
    Megatron-FSDP needs to free its gathered buckets after a save). Use it only while the
    owner's memory is alive: for the duration of a synchronous save."""
    if data.device.type != "cpu" or not data.is_contiguous():
        return data
    storage = data.untyped_storage()
    nbytes = data.numel() * data.element_size()
    if storage.nbytes() == nbytes:
        return data  # already a whole storage
    start = data.storage_offset() * data.element_size()
    return torch.empty(0, dtype=data.dtype).set_(storage[start:start + nbytes], 0, data.shape)


def helper_process_init() -> None:
    """For processes a rank spawns to help it save. Slurm delivers SIGTERM/SIGUSR1 to every
    process of the job step, and a spawned child would die of it while its rank saves (seen:
    Megatron's write-results Manager killed as it started, the stop-save failing). The rank
    decides when to stop; its helpers die with it (PR_SET_PDEATHSIG)."""
    from data_pipeline.processes import die_with_parent

    die_with_parent()
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


class _ResultsQueue:
    """Stands in a request's arguments for the trainer's write-results queue, which cannot
    cross to the writer process: the writer gives the write function a queue of its own and
    sends what was put in it back with the done message."""


def _writer_loop(requests, done, parent_pid: int) -> None:
    """The writer process: run each request's write function, report its index or error."""
    from data_pipeline.processes import get_unless_orphaned

    # A fresh (spawned) interpreter: shards must be hashed as they are written here too.
    # This also imports dist_checkpointing's writer now, while the trainer is starting.
    checkpointing_fixes.install_write_hashing()
    helper_process_init()
    # Training comes first: the writer (and the per-file processes it starts) gets the CPU
    # time training leaves; its work is mostly copying into the page cache and fsync.
    os.nice(10)
    torch.set_num_threads(1)
    while True:
        item = get_unless_orphaned(requests, parent_pid, poll=5.0)
        if item is None:
            return
        call_idx, fn, args, kwargs = item
        results: queue.Queue = queue.Queue()
        args = [results if isinstance(a, _ResultsQueue) else a for a in args]
        try:
            fn(*args, **kwargs)
            done.put((call_idx, None, [results.get_nowait() for _ in range(results.qsize())]))
        except BaseException:  # reported to the trainer, which raises it on every rank
            done.put((call_idx, traceback.format_exc(), []))
        del item, fn, args, kwargs, results


class WriterCaller(AsyncCaller):
    """Megatron's AsyncCaller interface over one long-lived spawned writer process."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._requests, self._done = ctx.Queue(), ctx.Queue()
        # Not a daemon: Megatron's write function starts one process per file. So that an
        # exit without close() (an exception) does not wait on it forever, stop it at exit.
        self.process = ctx.Process(target=_writer_loop, name="checkpoint-writer",
                                   args=(self._requests, self._done, os.getpid()))
        self.process.start()
        self._active: int | None = None
        self._results = checkpointing_fixes.write_results_queue()
        atexit.register(self.close)

    def schedule_async_call(self, async_req) -> None:
        if async_req.async_fn is None:
            return
        # preload_fn only moves GPU tensors to the host; ours are staged on the host already.
        self._active = async_req.call_idx
        args = [_ResultsQueue() if a is self._results else a for a in async_req.async_fn_args]
        self._requests.put((async_req.call_idx, async_req.async_fn, args, dict(async_req.async_fn_kwargs or {})))

    def _finished(self, blocking: bool) -> bool:
        """Whether this rank's current write is done; raises if it failed."""
        while self._active is not None:
            try:
                call_idx, error, reported = self._done.get(timeout=1.0) if blocking else self._done.get_nowait()
            except queue.Empty:
                if not self.process.is_alive():
                    raise WriterError(f"the checkpoint writer process died (exit code "
                                      f"{self.process.exitcode}) while writing a checkpoint: "
                                      "killed or out of memory") from None
                if not blocking:
                    return False
                continue
            for item in reported:  # where the trainer's finalize step reads them
                self._results.put(item)
            if error is not None:
                self._active = None
                raise WriterError(f"writing the checkpoint failed in the writer process:\n{error}")
            if call_idx == self._active:
                self._active = None
        return True

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        alive = int(not self._finished(blocking))
        if no_dist:
            return not alive
        flag = torch.tensor([alive], dtype=torch.int, device=collective_device())
        dist.all_reduce(flag)  # done only once every rank's writer is done
        return int(flag.item()) == 0

    def close(self, abort: bool = False) -> None:
        if self.process is None:
            return
        if abort or not self.process.is_alive():
            self.process.kill()
        else:
            self._requests.put(None)
            self.process.join(timeout=60)
            if self.process.is_alive():
                self.process.kill()
        self.process.join()
        self.process = None

    def __del__(self) -> None:
        pass


class WriterQueue(AsyncCallsQueue):
    """AsyncCallsQueue whose calls all go to one WriterCaller."""

    def __init__(self) -> None:
        super().__init__(persistent=True)
        self.persistent_caller = WriterCaller()

    def _get_async_caller(self):
        return self.persistent_caller

    def close(self, abort: bool = False) -> None:
        # Megatron-Core 0.19's close() finishes the calls, then closes only the persistent
        # caller it keeps on the class (none here): ours must be stopped too, or a rank that
        # ends as a multiprocessing child waits forever on the writer when it exits.
        super().close(abort=abort)
        self.persistent_caller.close(abort=abort)

