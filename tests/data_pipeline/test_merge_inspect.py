"""merge joins existing datasets exactly as one preprocess run would have written them;
inspect reports counts, lengths and decoded documents."""

from __future__ import annotations

import filecmp

import numpy as np
import pytest

from data_pipeline.inspect import length_histogram, main as inspect_main
from data_pipeline.merge import MergeError, main as merge_main, merge
from data_pipeline.preprocess import preprocess
from tests.data_pipeline.conftest import read_documents, write_jsonl

DEMO = "data_pipeline/assets/demo_sp.model"


@pytest.fixture()
def shards(tmp_path, texts):
    (tmp_path / "shards").mkdir()
    paths = [write_jsonl(tmp_path / f"part{i}.jsonl", texts[40 * i:40 * i + 40]) for i in range(3)]
    preprocess(paths, tokenizer=DEMO, output_dir=str(tmp_path / "shards"), append_eod=True,
               workers=0)
    return tmp_path, paths


def test_merge_equals_one_preprocess_of_all_inputs(shards):
    tmp_path, paths = shards
    manifest = merge([str(tmp_path / "shards" / "*")], str(tmp_path / "merged"))
    preprocess(paths, tokenizer=DEMO, output_prefix=str(tmp_path / "direct"), append_eod=True,
               workers=0)
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(str(tmp_path / "merged") + ext, str(tmp_path / "direct") + ext,
                           shallow=False)
    assert manifest["documents"] == 120
    assert manifest["tokens"] == sum(len(d) for d in read_documents(str(tmp_path / "direct")))


def test_merge_refuses_mismatched_inputs(shards, texts):
    tmp_path, _ = shards
    byte_corpus = write_jsonl(tmp_path / "bytes.jsonl", texts[:3])
    preprocess([byte_corpus], tokenizer="byte", output_prefix=str(tmp_path / "bytes"), workers=0)
    shard = str(tmp_path / "shards" / "part0")
    with pytest.raises(MergeError, match="different tokenizers"):
        merge([shard, str(tmp_path / "bytes")], str(tmp_path / "m"))
    with pytest.raises(MergeError, match="no dataset at"):
        merge([shard, str(tmp_path / "missing")], str(tmp_path / "m"))
    with pytest.raises(MergeError, match="also an input"):
        merge([shard], shard)
    merge([shard], str(tmp_path / "m"))
    with pytest.raises(MergeError, match="already exist; pass --overwrite"):
        merge([shard], str(tmp_path / "m"))
    assert merge_main(["-i", shard + ".idx", "-o", str(tmp_path / "m"), "--overwrite",
                       "--no-progress"]) == 0


def test_merge_refuses_different_dtypes(tmp_path, texts, llama3_model):
    corpus = write_jsonl(tmp_path / "c.jsonl", texts[:3])
    preprocess([corpus], tokenizer="byte", output_prefix=str(tmp_path / "u16"), workers=0)
    preprocess([corpus], tokenizer="tiktoken:" + llama3_model, output_prefix=str(tmp_path / "i32"),
               workers=0)
    with pytest.raises(MergeError, match=r"different token dtypes: .*u16 \(uint16\), .*i32 \(int32\)"):
        merge([str(tmp_path / "u16"), str(tmp_path / "i32")], str(tmp_path / "m"))


def test_length_histogram_buckets_by_powers_of_two():
    assert length_histogram(np.array([1, 2, 3, 4, 7, 8, 1000])) == [
        (1, 2, 1), (2, 4, 2), (4, 8, 2), (8, 16, 1), (512, 1024, 1)]
    assert length_histogram(np.array([], dtype=np.int64)) == []


def test_inspect_reports_counts_and_decodes(shards, capsys):
    tmp_path, _ = shards
    prefix = str(tmp_path / "shards" / "part0")
    assert inspect_main([prefix, "--docs", "1", "--scan-ids"]) == 0
    out = capsys.readouterr().out
    assert "uint16" in out and "40" in out and "3,999" not in out.split("largest token id")[0]
    assert "Genesis 1" in out and "document 0:" in out and "histogram" in out
    assert inspect_main([str(tmp_path / "nothing")]) == 2


def test_light_existence_check_names_megatrons_files(tmp_path):
    """output_paths.check_dataset_files (run before megatron.core's import) looks for the
    files Megatron's reader opens: a guard for when its names change."""
    from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path

    from data_pipeline.output_paths import DatasetFileError, check_dataset_files

    for case, names in enumerate(([], [get_idx_path], [get_bin_path], [get_idx_path, get_bin_path])):
        prefix = str(tmp_path / f"d{case}")
        for name in names:
            open(name(prefix), "wb").close()
        if len(names) == 2:
            check_dataset_files(prefix)  # both there: no error
        else:
            with pytest.raises(DatasetFileError, match="no dataset at prefix"):
                check_dataset_files(prefix)


def test_light_output_checks_agree_with_megatron(tmp_path):
    """preprocess decides before megatron.core's import whether an output is finished
    (read_manifest), exists (output_exists) and which dtype its ids take (token_dtype):
    the same answers as Megatron's IndexedDataset.exists and DType.optimal_dtype."""
    import json

    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, get_bin_path, get_idx_path

    from data_pipeline.output_paths import manifest_path, output_exists, read_manifest, token_dtype

    for vocab in (1, 256, 32_000, 65_499, 65_500, 65_536, 128_256):
        assert np.dtype(token_dtype(vocab)) == np.dtype(DType.optimal_dtype(vocab)), vocab
    for case, names in enumerate(([], [get_idx_path], [get_bin_path], [get_idx_path, get_bin_path])):
        prefix = str(tmp_path / f"d{case}")
        for name in names:
            open(name(prefix), "wb").close()
        with open(manifest_path(prefix), "w") as f:
            json.dump({"case": case}, f)
        assert output_exists(prefix) == bool(names)
        assert (read_manifest(prefix) is not None) == IndexedDataset.exists(prefix) == (len(names) == 2)
