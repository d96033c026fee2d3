"""dist_checkpointing (torch_dist) save hooks. Known for megatron-core 0.19.2 with torch 2.13
(written for 0.16.1; what 0.19 changed is said with each fix).

1. A hook on the save planner's tensors. `MCoreSavePlanner` (strategies/torch.py) inherits
   torch's `DefaultSavePlanner.resolve_data`, which returns each tensor the writer will
   write; the planner resolves all of them before `dist_checkpointing.save` returns.
   `apply()` installs a `resolve_data` on `MCoreSavePlanner` that passes each tensor through
   the converter set by `tensors_through(convert)` (none outside it). Our checkpointing uses
   it to stage an async save into reused shared memory, and to hand a sync save whole-storage
   aliases instead of the clones of every view that the writer would otherwise make
   (pretrain.checkpointing.async_writer says why each matters).
2. No write-results Manager. Every save (sync or async) reports its write results through
   `filesystem_async.get_write_results_queue()`, which spawns a multiprocessing Manager at
   the first save. That Manager is a fresh interpreter per rank (it re-imports `__main__`,
   torch and our modules: ~5 CPU-s, measured on a one-step tiny-llama run) and, under Slurm,
   is exposed to the stop signal that asked for the save (seen: killed by USR1 as it
   started, the stop-save failing). 0.19 renamed `_get_write_results_queue` to
   `get_write_results_queue(mp_mode)`; it still creates the Manager lazily from the same
   module global `_results_queue`, which is what we set. Our saves report from the process that asked for them
   (a sync save) or from our own writer process, which sends the results back with its
   done message (pretrain.checkpointing.async_writer). So `apply()` sets the module global
   the function returns to a plain in-process `queue.Queue`. Megatron's own async callers
   (which fork and report through that queue) are not used here.
3. Loading never runs code from a checkpoint. torch's `FileSystemReader.read_metadata`
   (distributed/checkpoint/filesystem.py, `pickle.load`) unpickles a checkpoint's `.metadata`
   with no restriction, and `DefaultLoadPlanner.load_bytes` (default_planner.py) unpickles
   every stored object (Megatron's ShardedObjects, e.g. `_extra_state`) with
   `torch.load(weights_only=False)`: a crafted file ran code on resume, reshard and export.
   `read_metadata` now unpickles with `pretrain.checkpointing.metadata.MetadataUnpickler`
   (our safe reader, which admits only the DCP metadata classes a checkpoint's .metadata
   holds), and `load_bytes` with torch's weights-only unpickler. checkpoints_tools read
   `.metadata` through that module's `read_metadata_safely` and never unpickle stored objects. A
   format-1 `common.pt` and our `rng/*.pt` are read with `weights_only=True` (torch's default
   since 2.6) already; 0.19's common state (the object `common_state` in the shards) is read
   through `load_bytes`, so with the weights-only unpickler too.
4. Shard files hashed as they are written. `FileSystemWriterAsync.write_preloaded_data`
   (strategies/filesystem_async.py, every torch_dist save, sync or async) opens each shard
   with `open_file = open; with open_file(file_name, "wb")`: the module global `open` is set
   to `pretrain.checkpointing.integrity.hashing_open`, which hashes the bytes on their way
   to the file (pretrain.checkpointing.integrity says what is done with the digests). Installed
   in the trainer and in our async writer process (`install_write_hashing`).
   0.19 writes a checkpoint's files from threads of the saving process (the last bucket in
   the calling thread) instead of forked processes; each file still opens through the module
   global `open`, and each `_HashingFile` hashes only its own file.
"""

from __future__ import annotations

import contextlib
import io
import queue
from typing import Callable, Optional

import torch

from pretrain.checkpointing.integrity import hashing_open
from pretrain.checkpointing.metadata import MetadataUnpickler
from pretrain.megatron_fixes._guard import expect_absent, expect_sources

SOURCES = {
    # MCoreSavePlanner inherits it; our hook wraps it.
    "torch.distributed.checkpoint.default_planner:DefaultSavePlanner.resolve_data": "852bcff10b56dac7",
    # Creates the Manager lazily from the module global we set.
    "megatron.core.dist_checkpointing.strategies.filesystem_async:get_write_results_queue": "e395fb0e86a062e2",
    # Replaced: plain pickle.load of .metadata; torch.load(weights_only=False) of stored objects.
    "torch.distributed.checkpoint.filesystem:FileSystemReader.read_metadata": "8586ce344a523602",
    "torch.distributed.checkpoint.default_planner:DefaultLoadPlanner.load_bytes": "666701f9808c4bc2",
    # Opens each shard through the module global `open`, which we set.
    "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync.write_preloaded_data":
        "d6182c03ee672d1a",
}

def _install_safe_loading() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = MetadataUnpickler(metadata_file).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # The upstream body with weights_only=True: tensors, numbers, strings, containers.
        import torch
        from torch.distributed.checkpoint._traverse import set_element

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

    FileSystemReader.read_metadata = read_metadata
    DefaultLoadPlanner.load_bytes = load_bytes
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
    expect_absent("dist_checkpointing", owner, "resolve_data")
    inherited = MCoreSavePlanner.resolve_data

    def resolve_data(self, write_item):
        data = inherited(self, write_item)
        convert = _CONVERT[0]
        if convert is not None and isinstance(data, torch.Tensor):
            data = convert((write_item.index.fqn, tuple(write_item.index.offset or ())), data)
        return data

    MCoreSavePlanner.resolve_data = resolve_data


def install_write_results_queue() -> None:
    """Fix 2: write results reported in-process, through a plain queue."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def write_results_queue() -> queue.Queue:
    """The queue dist_checkpointing's savers report their write results to (fix 2)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    install_write_results_queue()
    return filesystem_async._results_queue


def install_write_hashing() -> None:
    """Fix 4 (also called in the async writer process, which is spawned fresh)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async


    filesystem_async.open = hashing_open


@contextlib.contextmanager
def unhashed_writes():
    """Within: shards are written with the plain `open` (for the checkpoint benchmark's
    with/without comparison; a checkpoint saved so has no checksums for its shards)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    hooked = filesystem_async.__dict__.pop("open", None)
    try:
        yield
    finally:
        if hooked is not None:
            filesystem_async.open = hooked


def apply() -> None:
    expect_sources("dist_checkpointing", SOURCES)
    _install_resolve_data_hook()
    _install_safe_loading()
    install_write_hashing()
    install_write_results_queue()
