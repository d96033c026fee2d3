"""Atomic writing of Megatron-Core indexed datasets (`<prefix>.bin` + `<prefix>.idx`).

The bytes are written by Megatron-Core's own `IndexedDatasetBuilder`, under
temporary names (`<prefix>.bin.partial`, `<prefix>.idx.partial`) that no reader
takes for a dataset. On success they are renamed in an order that keeps every
intermediate state invalid-looking: the old `.idx` goes first, the new `.idx`
arrives last, so a `.bin/.idx` pair on disk is always a complete one. A small
`<prefix>.meta.json` manifest records how the pair was made, so re-running the
same command skips finished outputs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import struct
import warnings
from array import array

import numpy as np


@contextlib.contextmanager
def quiet_megatron_import():
    """megatron.core's package import warns about Transformer Engine/Apex on every CPU
    machine; irrelevant to reading and writing token files or building datasets."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex",
                                category=UserWarning)
        yield


with quiet_megatron_import():
    from megatron.core.datasets.indexed_dataset import (
        _INDEX_HEADER,
        DType,
        IndexedDataset,  # for inspect and config validation, which read datasets through it
        IndexedDatasetBuilder,
        _IndexWriter,
        get_bin_path,
        get_idx_path,
    )

# Kept in a module without Megatron-Core, so the CLIs can refuse bad outputs before importing it.
from data_pipeline.output_paths import DatasetFileError, OutputError, check_dataset_files, manifest_path

MANIFEST_VERSION = 1
# Index entries read per block when merging: 1M entries = 8 MB of int64, whatever the data size.
MERGE_BLOCK_ENTRIES = 1 << 20
# Bytes of tokens between syncs of the .bin while it is written (see _sync_written).
SYNC_EVERY_BYTES = 16 << 20


def partial_paths(prefix: str) -> list[str]:
    return [get_bin_path(prefix) + ".partial", get_idx_path(prefix) + ".partial",
            manifest_path(prefix) + ".partial"]


def open_index(prefix: str):
    """Megatron's index reader for the dataset at `prefix`, after checking that both files
    exist, the .idx reads, and the .bin holds exactly the bytes the index points into.

    A .bin cut short (a copy that stopped, a full disk) otherwise passes every reader and
    fails at the first batch that reaches its end; one with extra bytes is not the .bin
    this .idx was written with. Costs a stat, not a read of the .bin.
    """
    from megatron.core.datasets.indexed_dataset import _IndexReader

    bin_path, idx_path = get_bin_path(prefix), get_idx_path(prefix)
    check_dataset_files(prefix)
    try:
        index = _IndexReader(idx_path, multimodal=False)
        lengths, pointers = index.sequence_lengths, index.sequence_pointers
        documents = index.document_indices
        consistent = len(documents) >= 1 and documents[-1] == len(lengths) and documents[0] == 0
    except (ValueError, struct.error, AssertionError, IndexError, OSError) as exc:
        raise DatasetFileError(f"{idx_path} is damaged ({type(exc).__name__}: {exc}); re-create the "
                               f"dataset with python -m data_pipeline.preprocess") from None
    if not consistent:
        raise DatasetFileError(f"{idx_path} is damaged (its document index does not cover its "
                               f"{len(lengths):,} sequences); re-create the dataset")
    expected = int(pointers[-1]) + int(lengths[-1]) * DType.size(index.dtype) if len(lengths) else 0
    actual = os.path.getsize(bin_path)
    if actual < expected:
        raise DatasetFileError(f"{bin_path} is truncated: {actual:,} bytes, but its index {idx_path} "
                               f"describes {expected:,}; copy it again or re-create the dataset")
    if actual > expected:
        raise DatasetFileError(f"{bin_path} has {actual:,} bytes, {actual - expected:,} more than its index "
                               f"{idx_path} describes: the two files are not from the same run; "
                               "re-create the dataset")
    return index


class _VectorisedIndexWriter(_IndexWriter):
    """Megatron's index writer with the byte offsets computed by NumPy instead of a
    per-document Python loop (same values; a list of Python ints per document
    would dominate peak memory at the end of a large run)."""

    def _sequence_pointers(self, sequence_lengths) -> np.ndarray:
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=pointers[1:])
        return pointers * DType.size(self.dtype)


class CompactIndexedDatasetBuilder(IndexedDatasetBuilder):
    """IndexedDatasetBuilder that keeps its per-document index in typed arrays
    (12 bytes per document instead of ~70 as Python ints) and adds whole chunks
    of documents with one write."""

    def __init__(self, bin_path: str, dtype: type) -> None:
        super().__init__(bin_path, dtype=dtype)
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
        with _VectorisedIndexWriter(idx_path, self.dtype) as writer:
            writer.write(np.frombuffer(self.sequence_lengths, dtype=np.int32), None,
                         np.frombuffer(self.document_indices, dtype=np.int64))


class StreamingConcatBuilder(IndexedDatasetBuilder):
    """Megatron's `add_index` concatenation with memory that does not grow with the data.

    Megatron-Core 0.16.1's `IndexedDatasetBuilder.add_index` streams the .bin
    (shutil.copyfileobj) but extends in-memory lists with every input's sequence lengths
    and document indices, and `finalize` then builds the whole pointer array: memory grows
    with the number of documents (12+ bytes each). Here `add_index` copies the .bin and
    only remembers the input; `finalize` writes the .idx in Megatron's layout (the header
    of `_IndexWriter`, then lengths, pointers, document indices) reading each input's
    arrays in blocks of MERGE_BLOCK_ENTRIES with plain reads (no mmap, whose touched pages
    would count as resident). The bytes equal what `add_index` + `finalize` write.
    """

    def __init__(self, bin_path: str, dtype: type) -> None:
        super().__init__(bin_path, dtype=dtype)
        self._inputs: list[tuple[str, int, int]] = []  # (prefix, sequences, documents + 1)

    def add_index(self, path_prefix: str) -> None:
        from megatron.core.datasets.indexed_dataset import _IndexReader

        idx_path = get_idx_path(path_prefix)
        index = _IndexReader(idx_path, multimodal=False)  # header, dtype and counts only
        if index.dtype != self.dtype:
            raise DatasetFileError(f"{idx_path} stores {index.dtype.__name__}, the merge writes "
                                   f"{self.dtype.__name__}")
        sequences, documents = index.sequence_count, index.document_count
        del index
        expected = _HEADER_BYTES + 12 * sequences + 8 * documents
        if os.path.getsize(idx_path) != expected:  # the layout finalize relies on
            raise DatasetFileError(f"{idx_path} is not a plain Megatron index ({os.path.getsize(idx_path):,} "
                                   f"bytes, expected {expected:,}); multimodal datasets cannot be merged")
        self._inputs.append((path_prefix, sequences, documents))
        with open(get_bin_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self.data_file, 1 << 20)

    def finalize(self, idx_path: str) -> None:
        self.data_file.close()
        sequences = sum(n for _, n, _ in self._inputs)
        documents = 1 + sum(d - 1 for _, _, d in self._inputs)
        with open(idx_path, "wb") as out:
            out.write(_INDEX_HEADER + struct.pack("<Q", 1) + struct.pack("<B", DType.code_from_dtype(self.dtype)))
            out.write(struct.pack("<Q", sequences) + struct.pack("<Q", documents))
            for prefix, n, _ in self._inputs:  # lengths, as they are
                for block in _blocks(get_idx_path(prefix), _HEADER_BYTES, np.int32, n):
                    out.write(block.tobytes())
            byte_offset = 0
            for prefix, n, _ in self._inputs:  # pointers, shifted by the .bin bytes before
                for block in _blocks(get_idx_path(prefix), _HEADER_BYTES + 4 * n, np.int64, n):
                    out.write((block + byte_offset).tobytes())
                byte_offset += os.path.getsize(get_bin_path(prefix))
            out.write(np.zeros(1, dtype=np.int64).tobytes())
            sequence_offset = 0
            for prefix, n, d in self._inputs:  # document ends (the leading 0 once), shifted
                for block in _blocks(get_idx_path(prefix), _HEADER_BYTES + 12 * n + 8, np.int64, d - 1):
                    out.write((block + sequence_offset).tobytes())
                sequence_offset += n


_HEADER_BYTES = len(_INDEX_HEADER) + 8 + 1 + 8 + 8  # header, version, dtype code, two counts


def _blocks(path: str, offset: int, dtype, count: int):
    """`count` items of `dtype` from `path` at byte `offset`, MERGE_BLOCK_ENTRIES at a time."""
    with open(path, "rb") as f:
        f.seek(offset)
        while count > 0:
            n = min(count, MERGE_BLOCK_ENTRIES)
            block = np.fromfile(f, dtype=dtype, count=n)
            if len(block) != n:
                raise DatasetFileError(f"{path} ended early (truncated while merging?)")
            count -= n
            yield block


class AtomicIndexedDataset:
    """Context manager around a builder writing to temporary names.

    `commit(manifest)` makes the output visible; leaving the block without a
    commit (error, Ctrl-C) removes the temporary files. A SIGKILL leaves only
    `*.partial` files, which the next run for the same prefix overwrites.
    """

    def __init__(self, prefix: str, dtype: type, builder_class: type = None) -> None:
        self.prefix = prefix
        self.dtype = dtype
        self.builder_class = builder_class or CompactIndexedDatasetBuilder
        self.bin_tmp, self.idx_tmp, self.meta_tmp = partial_paths(prefix)
        self.builder: IndexedDatasetBuilder | None = None
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
        bin_path, idx_path = get_bin_path(self.prefix), get_idx_path(self.prefix)
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

