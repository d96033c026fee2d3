"""Training datasets through Megatron-Core's builders: sample layout, determinism per seed,
blend weights honoured, errors for bad blends, and the demo dataset."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from data_pipeline.datasets import (
    DatasetConfigError,
    build_gpt_datasets,
    ensure_demo_dataset,
)
from data_pipeline.preprocess import preprocess
from data_pipeline.tokenizers import load_tokenizer
from tests.data_pipeline.conftest import write_jsonl

DEMO = "data_pipeline/assets/demo_sp.model"


@pytest.fixture(scope="module")
def two_sources(module_tmp_factory, texts):
    """Two datasets from different books (Genesis-Exodus vs the rest)."""
    root = module_tmp_factory.mktemp("sources")
    for name, part in (("early", texts[:90]), ("late", texts[90:])):
        preprocess([write_jsonl(root / f"{name}.jsonl", part)], tokenizer=DEMO,
                   output_prefix=str(root / name), append_eod=True, workers=0)
    return str(root / "early"), str(root / "late")


def build(blend, tmp_path, seed=1234, num_samples=(10_000, 100, 0), split="95,5,0"):
    return build_gpt_datasets(blend=blend, split=split, seq_length=64, seed=seed,
                              num_samples=num_samples, tokenizer=load_tokenizer(DEMO),
                              cache_dir=str(tmp_path / "cache"))


def test_samples_have_megatrons_layout(two_sources, tmp_path):
    train, valid, test = build([(1.0, two_sources[0])], tmp_path)
    assert test is None and len(train) >= 10_000 and len(valid) >= 100
    item = train[0]
    assert set(item) == {"tokens", "labels", "loss_mask", "position_ids"}
    for value in item.values():
        assert value.shape == (64,)
    assert torch.equal(item["tokens"][1:], item["labels"][:-1])  # next-token targets
    assert torch.equal(item["position_ids"], torch.arange(64))
    assert int(item["tokens"].max()) < 4000


def test_blend_honours_weights_and_is_deterministic(two_sources, tmp_path):
    early, late = two_sources
    train, _, _ = build([(0.3, early), (0.7, late)], tmp_path)
    picks = np.array([int(train[i]["dataset_id"]) for i in range(10_000)])
    counts = np.bincount(picks, minlength=2)
    assert abs(counts[0] / 10_000 - 0.3) < 0.01 and abs(counts[1] / 10_000 - 0.7) < 0.01

    again, _, _ = build([(0.3, early), (0.7, late)], tmp_path / "fresh-cache")
    other, _, _ = build([(0.3, early), (0.7, late)], tmp_path / "other-seed", seed=7)
    for i in (0, 1, 2, 999):
        assert torch.equal(train[i]["tokens"], again[i]["tokens"])
    assert any(not torch.equal(train[i]["tokens"], other[i]["tokens"]) for i in range(20))


def test_build_under_an_initialised_process_group(two_sources, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        train, _, _ = build([(0.5, two_sources[0]), (0.5, two_sources[1])], tmp_path,
                            num_samples=(500, 10, 0))
        assert len(train) == 500
    finally:
        dist.destroy_process_group()


def test_mock_data(tmp_path):
    train, valid, test = build_gpt_datasets(blend=None, split="1,1,1", seq_length=32, seed=1,
                                            num_samples=(100, 10, 10), tokenizer=load_tokenizer(DEMO),
                                            cache_dir=str(tmp_path), mock=True)
    assert train[0]["tokens"].shape == (32,) and len(valid) >= 10 and len(test) >= 10


def test_bad_blends_name_the_problem(two_sources, tmp_path, texts):
    early, _ = two_sources
    with pytest.raises(DatasetConfigError, match="no dataset at prefix .*create it with python -m data_pipeline.preprocess"):
        build([(1.0, str(tmp_path / "missing"))], tmp_path)
    with pytest.raises(DatasetConfigError, match="must be a number > 0"):
        build([(0.0, early)], tmp_path)
    with pytest.raises(DatasetConfigError, match="blend is None"):
        build(None, tmp_path)
    byte_prefix = str(tmp_path / "bytes")
    preprocess([write_jsonl(tmp_path / "b.jsonl", texts[:5])], tokenizer="byte",
               output_prefix=byte_prefix, workers=0)
    with pytest.raises(DatasetConfigError, match="tokenised with 'byte', not the training tokenizer"):
        build([(1.0, byte_prefix)], tmp_path)


def test_demo_dataset_is_idempotent(tmp_path):
    prefix, tokenizer_path = ensure_demo_dataset(str(tmp_path / "demo"))
    assert os.path.samefile(tokenizer_path, DEMO)
    stamp = os.stat(prefix + ".bin").st_mtime_ns
    assert ensure_demo_dataset(str(tmp_path / "demo")) == (prefix, tokenizer_path)
    assert os.stat(prefix + ".bin").st_mtime_ns == stamp  # found up to date, not rewritten
    train, _, _ = build_gpt_datasets(blend=[(1.0, prefix)], split="99,1,0", seq_length=256,
                                     seed=0, num_samples=(1000, 10, 0),
                                     tokenizer=load_tokenizer(tokenizer_path), cache_dir=None)
    tokens = sum(int(n) for n in train.dataset.sequence_lengths)
    assert 1_000_000 < tokens < 3_000_000  # enough for a few hundred steps at seq 256
