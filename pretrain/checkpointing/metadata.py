"""The safe reader of a torch_dist checkpoint's `.metadata`: our own API, used by the
training's loader (through the fix in pretrain.megatron_fixes.dist_checkpointing), by
pretrain.checkpointing's integrity and format checks, and by checkpoints_tools.

torch's `FileSystemReader.read_metadata` unpickles `.metadata` with plain `pickle.load`, so a
crafted file would run code on resume, reshard or export. `MetadataUnpickler` admits only the
classes such a file holds and refuses anything else before it is called.

    from pretrain.checkpointing.metadata import UnsafeCheckpoint, read_metadata_safely
    metadata = read_metadata_safely("ckpt/step_000010/.metadata")
"""

from __future__ import annotations

import pickle

import torch

_DCP = "torch.distributed.checkpoint"
# Every global a torch_dist `.metadata` refers to (found by tracing the unpickling of
# checkpoints of every layout this project writes, and of checkpoints_tools' output; a
# test keeps the tools' output loadable: tests/checkpoints_tools).
METADATA_GLOBALS = frozenset(
    [(f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")]
    + [(f"{_DCP}.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")]
    # Megatron's cached save plans (a save whose structure repeats the previous one) store
    # every rank's SavePlan, with the filesystem writer's per-rank file prefix.
    + [(f"{_DCP}.filesystem", "_StorageInfo"), (f"{_DCP}.filesystem", "_StoragePrefix"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
       ("collections", "OrderedDict"),
       # StorageMeta.checkpoint_id, when the writer was given a path (checkpoints_tools' is)
       ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")]
)


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint file refers to something a checkpoint never holds (maybe crafted to run code)."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata`, admitting only the classes such a file holds (and torch
    dtypes): anything else is refused before it is called."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"refusing to load {module}.{name} from a checkpoint's .metadata: it holds only checkpoint "
            "metadata, so this file is damaged or crafted to run code; do not use this checkpoint")


def read_metadata_safely(path) -> "object":
    """The `torch.distributed.checkpoint.metadata.Metadata` in file `path` (a `.metadata`)."""
    with open(path, "rb") as f:
        return MetadataUnpickler(f).load()
