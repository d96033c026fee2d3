"""Writing Megatron-Core indexed datasets (`<prefix>.bin` + `<prefix>.idx`) atomically,
without importing Megatron-Core.

Megatron's own writer (`IndexedDatasetBuilder`, `_IndexWriter`) is reachable only through
`import megatron.core`, which brings torch and the package's __init__: 373 MB of PSS and
4.5 CPU-s on a 2-core VM (~9 on another) in the process that writes. In preprocess that
import held most of the run's peak memory beside the workers, and cost more CPU than
gigatoken's whole encode of 100 MB. The layout is small and fixed (Megatron-Core 0.16.1,
index version 1): a header (magic, version, dtype code), the sequence and document
counts, the sequence lengths (int32), their byte offsets into the .bin (int64), the
document ends in sequences (int64, a leading 0). What ties these bytes to Megatron's:
tests/data_pipeline/test_index_file.py compares the constants with megatron.core's and the
files with what `IndexedDatasetBuilder` writes for every token dtype, and every read goes
through Megatron's reader (`indexed_writer.open_index`).

Files are written under temporary names (`<prefix>.bin.partial`, `<prefix>.idx.partial`)
that no reader takes for a dataset. On success they are renamed in an order that keeps
every intermediate state invalid-looking: the old `.idx` goes first, the new `.idx`
arrives last, so a `.bin/.idx` pair on disk is always a complete one. A small
`<prefix>.meta.json` manifest records how the pair was made, so re-running the same
command skips finished outputs.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
from array import array

import numpy as np

from data_pipeline.output_paths import OutputError, dataset_paths, manifest_path

MANIFEST_VERSION = 1
# Bytes of tokens between syncs of the .bin while it is written (see _sync_written).
SYNC_EVERY_BYTES = 16 << 20

# Megatron-Core's `_INDEX_HEADER`, index version and `DType` codes (0.16.1).
INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5,
               np.float64: 6, np.float32: 7, np.uint16: 8}
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, two counts


def index_header(dtype: type, sequences: int, documents: int) -> bytes:
    """The .idx's header; `documents` counts the document index's entries (the leading 0
    included), as Megatron's writer does."""
    return (INDEX_MAGIC + struct.pack("<Q", INDEX_VERSION) + struct.pack("<B", DTYPE_CODES[dtype])
            + struct.pack("<Q", sequences) + struct.pack("<Q", documents))


def write_index(path: str, dtype: type, lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """A whole .idx: header, int32 lengths, int64 byte offsets (NumPy's cumsum, not a Python
    int per document, which would dominate peak memory at the end of a large run), int64
    document ends."""
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    with open(path, "wb") as f:
        f.write(index_header(dtype, len(lengths), len(document_indices)))
        f.write(memoryview(lengths).cast("B"))
        f.write(memoryview(pointers).cast("B"))
        f.write(memoryview(np.asarray(document_indices, dtype=np.int64)).cast("B"))


def partial_paths(prefix: str) -> list[str]:
    idx_path, bin_path = dataset_paths(prefix)
    return [bin_path + ".partial", idx_path + ".partial", manifest_path(prefix) + ".partial"]


class CompactIndexedDatasetBuilder:
    """Writes the .bin as chunks of documents arrive (one write per chunk) and keeps the
    per-document index in typed arrays (12 bytes per document, ~70 as Python ints) until
    `finalize` writes the .idx. One sequence per document, as preprocess makes them."""

    def __init__(self, bin_path: str, dtype: type) -> None:
        if dtype not in DTYPE_CODES:
            raise ValueError(f"indexed datasets store {', '.join(t.__name__ for t in DTYPE_CODES)}, "
                             f"not {dtype}")
        self.data_file = open(bin_path, "wb")
        self.dtype = dtype
        self.sequence_lengths = array("i")
        self.document_indices = array("q", [0])
        self._unsynced = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one token array and their lengths (one sequence each)."""
        assert tokens.dtype == np.dtype(self.dtype) and int(lengths.sum()) == len(tokens)
        self.data_file.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
        self._unsynced += tokens.nbytes
        if self._unsynced >= SYNC_EVERY_BYTES:
            self._sync_written()
        start = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(lengths.astype(np.int32).tobytes())
        ends = np.arange(start + 1, start + 1 + len(lengths), dtype=np.int64)
        self.document_indices.frombytes(ends.tobytes())

    def _sync_written(self) -> None:
        # Sync what we have every SYNC_EVERY_BYTES while the workers tokenise ahead, so the
        # fsync at commit, which nothing overlaps, has only the last few MB left: commit of
        # 57 MB of tokens took 55 ms with one fsync at the end, 9 ms this way.
        self._unsynced = 0
        self.data_file.flush()
        os.fdatasync(self.data_file.fileno())

    def finalize(self, idx_path: str) -> None:
        self.data_file.close()
        write_index(idx_path, self.dtype, np.frombuffer(self.sequence_lengths, dtype=np.int32),
                    np.frombuffer(self.document_indices, dtype=np.int64))


class AtomicIndexedDataset:
    """Context manager around a builder writing to temporary names.

    `commit(manifest)` makes the output visible; leaving the block without a
    commit (error, Ctrl-C) removes the temporary files. A SIGKILL leaves only
    `*.partial` files, which the next run for the same prefix overwrites.
    A builder has `data_file` (the open .bin) and `finalize(idx_path)`.
    """

    def __init__(self, prefix: str, dtype: type, builder_class: type = None) -> None:
        self.prefix = prefix
        self.dtype = dtype
        self.builder_class = builder_class or CompactIndexedDatasetBuilder
        self.bin_tmp, self.idx_tmp, self.meta_tmp = partial_paths(prefix)
        self.builder = None
        self._lock = None
        self._committed = False

    def __enter__(self) -> "AtomicIndexedDataset":
        self._lock = open(self.prefix + ".lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise OutputError(f"another process is writing {self.prefix!r} (it holds "
                              f"{self.prefix}.lock); wait for it or choose another prefix") from None
        try:
            self.builder = self.builder_class(self.bin_tmp, self.dtype)
        except BaseException:
            self.__exit__(None, None, None)  # not called when __enter__ raises
            raise
        return self

    def commit(self, manifest: dict) -> None:
        self.builder.finalize(self.idx_tmp)
        with open(self.meta_tmp, "w", encoding="utf-8") as f:
            json.dump({"version": MANIFEST_VERSION, **manifest}, f, indent=2, sort_keys=True)
        for path in (self.bin_tmp, self.idx_tmp, self.meta_tmp):
            _fsync(path)
        idx_path, bin_path = dataset_paths(self.prefix)
        # Order matters: while the old .idx exists, the old pair may be read; remove it
        # first, and let the new .idx (the file readers test for) appear last.
        for stale in (idx_path, manifest_path(self.prefix)):
            if os.path.exists(stale):
                os.unlink(stale)
        os.replace(self.bin_tmp, bin_path)
        os.replace(self.meta_tmp, manifest_path(self.prefix))
        os.replace(self.idx_tmp, idx_path)
        # The renames themselves survive a power cut only once the directory is synced.
        _fsync(os.path.dirname(os.path.abspath(self.prefix)))
        self._committed = True

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.builder is not None and not self.builder.data_file.closed:
            self.builder.data_file.close()
        if not self._committed:
            for path in (self.bin_tmp, self.idx_tmp, self.meta_tmp):
                if os.path.exists(path):
                    os.unlink(path)
        os.unlink(self._lock.name)  # while still holding it: a waiter fails, never half-writes
        self._lock.close()


def _fsync(path: str) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
