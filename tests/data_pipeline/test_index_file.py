"""index_file writes Megatron-Core's indexed-dataset format without importing it: the guard
that its constants are Megatron's, and the files byte for byte what Megatron's own builder
writes, for every token dtype and for an empty dataset."""

from __future__ import annotations

import filecmp

import numpy as np
import pytest

from data_pipeline.index_file import (
    DTYPE_CODES,
    HEADER_BYTES,
    INDEX_MAGIC,
    INDEX_VERSION,
    CompactIndexedDatasetBuilder,
)


def test_the_format_constants_are_megatrons(tmp_path):
    """Fails when Megatron-Core changes its index format; index_file must follow it then."""
    import struct

    from megatron.core.datasets import indexed_dataset as megatron

    assert INDEX_MAGIC == megatron._INDEX_HEADER
    assert DTYPE_CODES == {megatron.DType.dtype_from_code(m.value): m.value for m in megatron.DType}
    # The version and the header's size, read back from a file of Megatron's writer.
    with open(_megatron_file(np.uint16, [[1, 2, 3]], tmp_path) + ".idx", "rb") as f:
        head = f.read(HEADER_BYTES + 1)
    assert head[:len(INDEX_MAGIC)] == INDEX_MAGIC
    assert struct.unpack("<QBQQ", head[len(INDEX_MAGIC):HEADER_BYTES]) == (INDEX_VERSION, 8, 1, 2)
    assert head[HEADER_BYTES:] == struct.pack("<i", 3)[:1]  # the first length follows the header


def _megatron_file(dtype, documents, directory) -> str:
    """Megatron's IndexedDatasetBuilder's files for `documents` (lists of ids), one sequence each."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = f"{directory}/megatron-{np.dtype(dtype).name}-{len(documents)}"
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for ids in documents:
        builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.parametrize("dtype", list(DTYPE_CODES), ids=lambda t: t.__name__)
def test_the_files_are_megatrons_bytes(tmp_path, dtype):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 120, size=n).astype(dtype) for n in (5, 1, 0, 300, 17, 64)]
    documents[2] = np.zeros(0, dtype=dtype)  # an empty document is one empty sequence in both
    reference = _megatron_file(dtype, documents, tmp_path)
    ours = CompactIndexedDatasetBuilder(str(tmp_path / "ours.bin"), dtype)
    for part in (documents[:2], documents[2:]):  # chunks of documents, as preprocess adds them
        ours.add_documents(np.concatenate(part), np.array([len(d) for d in part]))
    ours.finalize(str(tmp_path / "ours.idx"))
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(reference + ext, str(tmp_path / "ours") + ext, shallow=False), ext


def test_an_empty_dataset_is_megatrons_bytes(tmp_path):
    reference = _megatron_file(np.int32, [], tmp_path)
    ours = CompactIndexedDatasetBuilder(str(tmp_path / "ours.bin"), np.int32)
    ours.finalize(str(tmp_path / "ours.idx"))
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(reference + ext, str(tmp_path / "ours") + ext, shallow=False), ext


def test_a_dtype_megatron_cannot_store_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not <class 'numpy.uint32'>"):
        CompactIndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint32)
    assert not (tmp_path / "x.bin").exists()
