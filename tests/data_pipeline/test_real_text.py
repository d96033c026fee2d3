"""Real pretrained tokenizers on real text fetched from Debian (the Jargon File, from
jargon-text via apt-get download + dpkg -x): decode(read(preprocess(text))) reproduces
every document's token ids exactly."""

from __future__ import annotations

import numpy as np
import pytest

from data_pipeline.preprocess import preprocess
from data_pipeline.tokenizers import load_tokenizer
from tests.data_pipeline.conftest import read_documents, write_jsonl


@pytest.mark.parametrize("which", ["mistral", "llama3"])
def test_round_trip_of_the_jargon_file(tmp_path, debian_jargon, which, request):
    spec = request.getfixturevalue("mistral_model") if which == "mistral" else \
        "tiktoken:" + request.getfixturevalue("llama3_model")
    assert len(debian_jargon) > 2000  # entries of the Jargon File
    corpus = write_jsonl(tmp_path / "jargon.jsonl.gz", debian_jargon)
    summary = preprocess([corpus], tokenizer=spec, output_prefix=str(tmp_path / "jargon"),
                         append_eod=True, workers=2)
    tok = load_tokenizer(spec)
    docs = read_documents(str(tmp_path / "jargon"))
    assert len(docs) == len(debian_jargon) == summary.total("documents")
    assert docs[0].dtype == (np.int32 if which == "llama3" else np.uint16)
    for text, ids in zip(debian_jargon, docs, strict=True):
        assert ids[-1] == tok.eod
        assert ids[:-1].tolist() == tok.encode(text)
    # Exact text round trip where the tokenizer is lossless (tiktoken is byte-level BPE).
    if which == "llama3":
        assert all(tok.decode(ids[:-1].tolist()) == text for text, ids in zip(debian_jargon, docs, strict=True))
