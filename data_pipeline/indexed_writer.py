"""Megatron-Core's side of indexed datasets: its reader (`open_index`, `IndexedDataset`) and
the streaming concatenation of datasets (merge), which import megatron.core.

Writing a dataset needs no Megatron-Core (`index_file`); reading goes
through Megatron's own reader, so what the two write and read stays Megatron's format.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import warnings

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
        DType,
        IndexedDataset,  # for inspect and config validation, which read datasets through it
        get_bin_path,
        get_idx_path,
    )

# Kept in modules without Megatron-Core, so the CLIs can refuse bad outputs (and preprocess
# write whole datasets) without importing it.
from data_pipeline.index_file import HEADER_BYTES, index_header
from data_pipeline.output_paths import DatasetFileError, check_dataset_files

# Index entries read per block when merging: 1M entries = 8 MB of int64, whatever the data size.
MERGE_BLOCK_ENTRIES = 1 << 20


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


class StreamingConcatBuilder:
    """Megatron's `add_index` concatenation with memory that does not grow with the data.

    Megatron-Core 0.16.1's `IndexedDatasetBuilder.add_index` streams the .bin
    (shutil.copyfileobj) but extends in-memory lists with every input's sequence lengths
    and document indices, and `finalize` then builds the whole pointer array: memory grows
    with the number of documents (12+ bytes each). Here `add_index` copies the .bin and
    only remembers the input; `finalize` writes the .idx in Megatron's layout (index_file's
    header, then lengths, pointers, document indices) reading each input's
    arrays in blocks of MERGE_BLOCK_ENTRIES with plain reads (no mmap, whose touched pages
    would count as resident). The bytes equal what `add_index` + `finalize` write.
    """

    def __init__(self, bin_path: str, dtype: type) -> None:
        self.data_file = open(bin_path, "wb")
        self.dtype = dtype
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
        expected = HEADER_BYTES + 12 * sequences + 8 * documents
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
            out.write(index_header(self.dtype, sequences, documents))
            for prefix, n, _ in self._inputs:  # lengths, as they are
                for block in _blocks(get_idx_path(prefix), HEADER_BYTES, np.int32, n):
                    out.write(block.tobytes())
            byte_offset = 0
            for prefix, n, _ in self._inputs:  # pointers, shifted by the .bin bytes before
                for block in _blocks(get_idx_path(prefix), HEADER_BYTES + 4 * n, np.int64, n):
                    out.write((block + byte_offset).tobytes())
                byte_offset += os.path.getsize(get_bin_path(prefix))
            out.write(np.zeros(1, dtype=np.int64).tobytes())
            sequence_offset = 0
            for prefix, n, d in self._inputs:  # document ends (the leading 0 once), shifted
                for block in _blocks(get_idx_path(prefix), HEADER_BYTES + 12 * n + 8, np.int64, d - 1):
                    out.write((block + sequence_offset).tobytes())
                sequence_offset += n


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
