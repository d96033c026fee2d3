"""Every file of a checkpoint, with its size and an xxh3-64 checksum, in meta.json.

Writing: the shard files (`__R_S.distcp`, the bulk) are hashed while they are written, by
the writer processes themselves (`hashing_open`, hooked into dist_checkpointing's writer by
pretrain.megatron_fixes.dist_checkpointing and into checkpoints_tools' writer directly): each
leaves a small `<file>.xxh3` note next to its file. When a checkpoint is finalized, rank 0
folds the notes into the file table (`collect_file_table`) and hashes the few small files
(.metadata, common.pt, metadata.json, rng/*.pt, config.yaml) by reading them.

Loading: sizes are checked on every load (`size_problems`: a stat per file); checksums by
default (`checksum_problems`: reads every file; spread over the ranks in training), skipped
with `checkpoint.verify_checksums=false`. A checkpoint without a table (written before this
existed) is checked for the files its `.metadata` names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

import xxhash

from pretrain.checkpointing.metadata import read_metadata_safely

NOTE_SUFFIX = ".xxh3"
CHUNK = 8 << 20
# Not in the table: meta.json holds the table, COMPLETE is written after it.
_UNLISTED = {"meta.json", "COMPLETE"}


class _HashingFile:
    """A binary file opened for writing that hashes every byte written to it; on close it
    leaves `<path>.xxh3` with the size and digest (read by collect_file_table)."""

    def __init__(self, path: str, mode: str):
        self._file = open(path, mode)
        self._path = path
        self._hash = xxhash.xxh3_64()
        self._size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self._size += view.nbytes
        return self._file.write(view)

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.close()
        with open(self._path + NOTE_SUFFIX, "w") as note:
            json.dump({"bytes": self._size, "xxh3_64": self._hash.hexdigest()}, note)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name):  # tell, fileno, flush, seekable, ... of the real file
        return getattr(self._file, name)


def hashing_open(path, mode: str = "r", *args, **kwargs):
    """`open`, except that a checkpoint shard opened for writing is hashed as it is written."""
    if mode == "wb" and str(path).endswith(".distcp") and not args and not kwargs:
        return _HashingFile(str(path), mode)
    return open(path, mode, *args, **kwargs)


def file_digest(path: Path) -> dict:
    digest = xxhash.xxh3_64()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "xxh3_64": digest.hexdigest()}


def collect_file_table(directory: Path) -> dict[str, dict]:
    """{relative path: {bytes, xxh3_64}} for every file of the checkpoint being finalized,
    from the writers' notes where they left one (then removed), else by reading the file."""
    directory = Path(directory)
    table = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        if name in _UNLISTED or name.endswith(NOTE_SUFFIX):
            continue
        note = Path(str(path) + NOTE_SUFFIX)
        entry = json.loads(note.read_text()) if note.is_file() else None
        if entry is None or entry["bytes"] != path.stat().st_size:
            entry = file_digest(path)  # small files, and any shard without a (matching) note
        table[name] = entry
    for note in directory.rglob("*" + NOTE_SUFFIX):
        note.unlink()
    return table


def _named_by_metadata(directory: Path) -> list[str]:
    """For checkpoints without a table: the files torch_dist needs (its .metadata names the shards)."""

    metadata = read_metadata_safely(directory / ".metadata")
    names = sorted({info.relative_path for info in metadata.storage_data.values()}) + [".metadata"]
    # Megatron-Core 0.17+ keeps the common state inside the shards (object `common_state`);
    # a checkpoint written before keeps it in common.pt, which it then cannot load without.
    if not any(key.startswith("common_state/") for key in metadata.state_dict_metadata):
        names.append("common.pt")
    return names


def size_problems(directory: Path, table: Optional[dict]) -> list[str]:
    """Missing or wrongly sized files (a stat per file): one line each."""
    directory = Path(directory)
    problems = []
    expected = table.items() if table else ((name, None) for name in _named_by_metadata(directory))
    for name, entry in expected:
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif entry is not None and path.stat().st_size != entry["bytes"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, {entry['bytes']} were written")
    return problems


def checksum_problems(directory: Path, table: dict, names: Optional[Iterable[str]] = None) -> list[str]:
    """Files (all, or `names`) whose content differs from what was written."""
    problems = []
    for name in sorted(table) if names is None else names:
        entry = table[name]
        got = file_digest(Path(directory) / name)
        if got != entry:
            problems.append(f"{name} differs from what was written (xxh3-64 {got['xxh3_64']}, "
                            f"recorded {entry['xxh3_64']})")
    return problems


def remove_notes(directory: Path) -> None:
    for note in Path(directory).rglob("*" + NOTE_SUFFIX):
        try:
            os.unlink(note)
        except FileNotFoundError:
            pass
