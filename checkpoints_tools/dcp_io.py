"""Read and write torch_dist (DCP) checkpoints offline, in one process, one region at a time.

Megatron-Core's `dist_checkpointing` needs as many ranks as the layout and a process
group; offline tools need neither. A torch_dist checkpoint is a plain
`torch.distributed.checkpoint` directory (`.metadata` + `__R_T.distcp` shards) plus
Megatron's `metadata.json`; its non-sharded ("common") state is the object `common_state`
inside the DCP files (Megatron-Core 0.17+; 0.16 and earlier wrote it to `common.pt`, which
`read_common` still reads), so:

- `CheckpointReader.read(key, index)` loads one layer (one expert) of a stacked tensor
  through DCP's own storage reader and resharding read-item planner;
- `write_checkpoint(...)` hands DCP's file writer a plan of every output chunk up front
  and produces each chunk only when the writer asks for it (`resolve_data`), so memory
  holds one chunk (plus the caller's one-layer cache), never the model.

Chunks are cut for a target layout (per layer, per expert, per TP rank, SwiGLU gate and
up halves apart, as Megatron-Core itself saves), so loading at that layout reads each
rank's bytes only. Any other layout still loads: DCP reshards on read.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import pickle
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from checkpoints_tools.mapping import TP_SPLIT, generic_key, is_expert_key, stacked_axes
from models.layout import ParallelLayout
from pretrain.checkpointing.async_writer import own_storage_alias
from pretrain.checkpointing.integrity import hashing_open
from pretrain.checkpointing.metadata import UnsafeCheckpoint, read_metadata_safely

# What Megatron-Core writes next to the DCP files (dist_checkpointing/core.py).
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}
# Where Megatron-Core 0.17+ keeps the common state: ShardedObject("common_state", (1,), (0,))
# (dist_checkpointing/serialization.py: save and load_common_state_dict), stored as
# torch.save([state]) like every ShardedObject.
COMMON_STATE_KEY = "common_state/shard_0_1"
LEGACY_COMMON_FILE = "common.pt"


class CheckpointFormatError(ValueError):
    """A torch_dist checkpoint that is damaged or not what its metadata says."""


class _RegionPlanner:
    """The three LoadPlanner calls FileSystemReader.read_data makes, into one region."""

    def __init__(self, dest: Optional[torch.Tensor] = None):
        self.dest = dest
        self.blobs: dict[str, bytes] = {}

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        view = self.dest
        for dim, (start, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor returned a view of dest: the copy already landed there

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        self.blobs[item.dest_index.fqn] = value.getvalue()


class _HashingFileSystem(FileSystem):
    """torch's local file system for DCP, with shard files hashed as they are written
    (pretrain.checkpointing.integrity: the notes become meta.json's file table)."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with hashing_open(path, mode) as stream:
            yield stream


class CheckpointReader:
    """Random access to the tensors and objects of one torch_dist checkpoint directory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not (self.path / ".metadata").is_file():
            raise CheckpointFormatError(
                f"{self.path} has no .metadata: not a torch_dist checkpoint (or its save did not finish)")
        self._reader = FileSystemReader(str(self.path))
        try:
            # Not the reader's own read_metadata: that one unpickles with no restriction.
            self.metadata = read_metadata_safely(self.path / ".metadata")
        except UnsafeCheckpoint as exc:
            raise CheckpointFormatError(f"{self.path}/.metadata: {exc}") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise CheckpointFormatError(f"{self.path}/.metadata is damaged ({type(exc).__name__}: {exc}); "
                                        "use another checkpoint") from None
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        self._check_files()

    def _check_files(self) -> None:
        files = {info.relative_path for info in self.metadata.storage_data.values()}
        missing = sorted(f for f in files if not (self.path / f).is_file())
        if missing:
            raise CheckpointFormatError(
                f"checkpoint {self.path} is missing shard file(s) {', '.join(missing)}; "
                "copy the complete directory (every __*.distcp file) and retry")

    def tensor_keys(self) -> list[str]:
        return [k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]

    def object_keys(self) -> list[str]:
        """The ShardedObjects of the model and optimizer (not the common state: `read_common`)."""
        return [k for k, v in self.metadata.state_dict_metadata.items()
                if isinstance(v, BytesStorageMetadata) and k != COMMON_STATE_KEY]

    def has(self, key: str) -> bool:
        return key in self.metadata.state_dict_metadata

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensor_md(key).size)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensor_md(key).properties.dtype

    def _tensor_md(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointFormatError(f"checkpoint {self.path} holds no tensor {key!r}")
        return md

    def read(self, key: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        """The sub-tensor `tensor[index]` (e.g. one layer, one expert), loaded alone."""
        md = self._tensor_md(key)
        size = list(md.size)
        offsets = list(index) + [0] * (len(size) - len(index))
        sizes = [1] * len(index) + size[len(index):]
        dest = torch.empty(sizes, dtype=md.properties.dtype)
        items = create_read_items_for_chunk_list(key, md, [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))])
        covered = sum(math.prod(item.lengths) for item in items)
        if covered != dest.numel():
            raise CheckpointFormatError(
                f"checkpoint {self.path}: the stored chunks of {key!r} cover {covered} of the "
                f"{dest.numel()} values of index {index}; the checkpoint is damaged")
        self._read(items, _RegionPlanner(dest))
        return dest.reshape(size[len(index):])

    def read_object(self, key: str) -> bytes:
        """The raw serialized bytes of a ShardedObject (copied as is, never unpickled here)."""
        if not isinstance(self.metadata.state_dict_metadata.get(key), BytesStorageMetadata):
            raise CheckpointFormatError(f"checkpoint {self.path} holds no object {key!r}")
        index = MetadataIndex(key)
        item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size((0,)),
                        storage_index=index, storage_offsets=torch.Size((0,)), lengths=torch.Size((0,)))
        planner = _RegionPlanner()
        self._read([item], planner)
        return planner.blobs[key]

    def _read(self, items: list[ReadItem], planner: _RegionPlanner) -> None:
        plan = self._reader.prepare_global_plan([self._reader.prepare_local_plan(LoadPlan(items))])[0]
        try:
            self._reader.read_data(plan, planner).wait()
        except (OSError, RuntimeError, EOFError) as exc:
            raise CheckpointFormatError(f"reading checkpoint {self.path} failed ({exc}); "
                                        "a shard file is truncated or damaged") from exc


# --- writing -------------------------------------------------------------------------


def layout_chunks(key: str, shape: tuple[int, ...], layout: ParallelLayout, gated: bool) -> list[tuple[tuple, tuple]]:
    """(offsets, sizes) of the chunks Megatron-Core would save for `key` at this layout.

    One chunk per layer (and per expert) and per TP shard; a SwiGLU fc1 is split into
    gate and up halves first, each halved again by TP, exactly as each rank holds it.
    Experts are split over EP along the expert axis, which is per-expert here already;
    expert weights are split by the expert-TP size.
    """
    lead = stacked_axes(key)
    tp = layout.expert_tp if is_expert_key(key) else layout.tensor_parallel
    body = shape[lead:]
    dim, glu = TP_SPLIT.get(generic_key(key), (None, False))
    gated = gated and glu
    pieces = [(0, body[dim] if dim is not None else 0)]
    if dim is not None:
        halves = [(0, body[dim] // 2), (body[dim] // 2, body[dim] // 2)] if gated else [(0, body[dim])]
        pieces = [(start + r * length // tp, length // tp) for start, length in halves for r in range(tp)]
    chunks = []
    for index in _indices(shape[:lead]):
        for start, length in pieces:
            offsets, sizes = [*index, *([0] * len(body))], [*([1] * lead), *body]
            if dim is not None:
                offsets[lead + dim], sizes[lead + dim] = start, length
            chunks.append((tuple(offsets), tuple(sizes)))
    return chunks


def _indices(lead_shape: tuple[int, ...]) -> Iterable[tuple[int, ...]]:
    if not lead_shape:
        yield ()
        return
    for i in range(lead_shape[0]):
        for rest in _indices(lead_shape[1:]):
            yield (i, *rest)


class _LazyPlanner:
    """What FileSystemWriter asks of a SavePlanner while writing: the data of one item."""

    def __init__(self, produce: Callable[[str, tuple, tuple], torch.Tensor], objects: dict[str, bytes],
                 dtypes: dict[str, torch.dtype]):
        self.produce, self.objects, self.dtypes = produce, objects, dtypes

    def resolve_data(self, item: WriteItem):
        if item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.objects[item.index.fqn])
        chunk = item.tensor_data.chunk
        tensor = self.produce(item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))
        if tuple(tensor.shape) != tuple(chunk.sizes):
            raise AssertionError(f"{item.index.fqn}: produced {tuple(tensor.shape)}, planned {tuple(chunk.sizes)}")
        # One copy at most (a cast, or a TP split across columns); a view of the source
        # layer goes out as an alias rather than being cloned again by the writer.
        return own_storage_alias(tensor.to(self.dtypes[item.index.fqn]).contiguous())


class _Writer(FileSystemWriter):
    def storage_meta(self):
        # torch records the writer's path in .metadata as a pathlib object: here the staging
        # folder, moved away right after, and a class the safe .metadata reader
        # (pretrain.checkpointing.metadata) refuses, so the tools' outputs were unreadable.
        # Nothing reads it back (loading needs only state_dict_metadata and storage_data).
        return None


def write_checkpoint(
    out: Path,
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype, list]],
    produce: Callable[[str, tuple, tuple], torch.Tensor],
    objects: dict[str, bytes],
    common: dict,
    threads: int = 1,
) -> None:
    """Write a torch_dist checkpoint that Megatron-Core's `dist_checkpointing.load` reads.

    tensors: key -> (global shape, dtype, chunks as (offsets, sizes)), written in this order;
    produce(key, offsets, sizes) returns a chunk when the writer reaches it (from `threads`
    writer threads at once: it must be thread-safe). objects: the
    ShardedObject bytes (key/shard_... -> serialized). common: Megatron's non-sharded state
    (scheduler, optimizer param groups), stored as its `common_state` object.
    """
    out.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save([common], buffer)
    objects = {**objects, COMMON_STATE_KEY: buffer.getvalue()}
    items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in objects]
    for key, (shape, dtype, chunks) in tensors.items():
        for offsets, sizes in chunks:
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                            properties=TensorProperties(dtype=dtype), size=torch.Size(shape))))
    # One writer thread by default: chunks come in plan order, so a one-layer cache
    # upstream reads each layer once. Two threads (files) overlap serialization with
    # writing, but DCP balances their buckets by size, so they drift apart by layers and
    # re-read some (measured on 2 busy cores: no faster, 5 of 27 layers read twice).
    writer = _Writer(str(out), single_file_per_rank=True, sync_files=True, thread_count=threads)
    writer.fs = _HashingFileSystem()  # shards hashed as written, as training's saves are
    writer.set_up_storage_writer(True)
    plans, metadata = create_default_global_save_plan([writer.prepare_local_plan(SavePlan(items))])
    plan = writer.prepare_global_plan(plans)[0]
    planner = _LazyPlanner(produce, objects, {k: v[1] for k, v in tensors.items()})
    results = writer.write_data(plan, planner).wait()
    writer.finish(metadata, [results])
    (out / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))


def read_common(path: Path) -> dict:
    """The common state of a torch_dist checkpoint (scheduler, optimizer param groups): from
    `common.pt` (Megatron-Core <= 0.16) or its `common_state` object (0.17+), else {}. Plain
    numbers and strings, so the restricted (weights_only) unpickler suffices."""
    file = Path(path) / LEGACY_COMMON_FILE
    if file.is_file():
        return torch.load(file, weights_only=True)
    reader = CheckpointReader(path)
    if not reader.has(COMMON_STATE_KEY):
        return {}
    return torch.load(io.BytesIO(reader.read_object(COMMON_STATE_KEY)), weights_only=True)[0]
