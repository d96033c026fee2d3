"""Tokenizers: every backend round-trips real text, exposes the right special ids,
pickles, and fails to load with a message that names the fix."""

from __future__ import annotations

import hashlib
import json
import os
import pickle

import numpy as np
import pytest

from data_pipeline.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    TokenizerLoadError,
    load_tokenizer,
)

SAMPLE = "In the beginning God created the heaven and the earth.  Zürich, 2024 — ‘naïve’ café\n\ttab"


def test_byte_tokenizer_round_trip_and_specials():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode(SAMPLE)
    assert ids == list(SAMPLE.encode("utf-8"))
    assert tok.decode(ids + [tok.eod]) == SAMPLE  # specials decode to nothing
    assert (tok.vocab_size, tok.bos, tok.eod, tok.pad) == (259, 256, 257, 258)
    assert np.array_equal(tok.encode_array(SAMPLE), ids)


def test_demo_sentencepiece_round_trips_real_text(demo_tokenizer, texts):
    tok = demo_tokenizer
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.bos, tok.eod, tok.pad_id) == (4000, 1, 2, 3)
    for text in texts[:20] + [SAMPLE]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text  # identity normalisation, whitespace kept
        assert max(ids) < tok.vocab_size
    # byte fallback: characters never seen in the KJV still encode losslessly
    assert tok.decode(tok.encode("日本語 ✓")) == "日本語 ✓"


def test_hf_tokenizer_json_file_and_directory(tmp_path, texts):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600,
                                                      special_tokens=["<s>", "</s>", "<pad>"]))
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    for spec in (str(tmp_path), str(tmp_path / "tokenizer.json")):
        tok = load_tokenizer(spec)
        assert isinstance(tok, HFTokenizer)
        assert (tok.bos, tok.eod, tok.pad_id) == (0, 1, 2)
        assert tok.vocab_size == hf.get_vocab_size()
        ids = tok.encode(texts[0])
        assert ids == hf.encode(texts[0], add_special_tokens=False).ids
        assert tok.decode(ids) == texts[0]


def test_llama3_tiktoken_matches_reference_encoder(llama3_model, texts):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    tok = load_tokenizer("tiktoken:" + llama3_model)
    assert isinstance(tok, TiktokenTokenizer)
    assert (tok.vocab_size, tok.bos, tok.eod, tok.pad_id) == (128256, 128000, 128001, 128004)
    # The reference: tiktoken itself, built from the pattern in llama_models' own source.
    source = open(llama3_model.replace("tokenizer.model", "tokenizer.py"), encoding="utf-8").read()
    pattern = source.split('pat_str = r"', 1)[1].split('"  #', 1)[0]
    reference = tiktoken.Encoding("ref", pat_str=pattern, mergeable_ranks=load_tiktoken_bpe(llama3_model),
                                  special_tokens={})
    for text in texts[:20] + [SAMPLE, "<|end_of_text|> is text here"]:
        assert tok.encode(text) == reference.encode_ordinary(text)
        assert tok.decode(tok.encode(text)) == text
    # detected without the tiktoken: prefix too
    assert isinstance(load_tokenizer(llama3_model), TiktokenTokenizer)


def test_tiktoken_cuts_long_inputs_where_llamas_reference_does(llama3_model):
    tok = load_tokenizer("tiktoken:" + llama3_model)
    cases = ["a" * 60_000 + " tail " + "\n" * 30_000 + "x", "c" * 25_000, "c" * 25_001,
             ("b" * 25_000 + " ") * 3, " " * 50_001 + "z", "é" * 70_000 + "\u3000" * 30_000 + "q",
             "word " * 90_000]  # 450,000 characters: cut at 400,000 as well
    try:
        from llama_models.llama3.tokenizer import Tokenizer as Reference
    except ImportError:  # installed without its dependencies: check the round trip only
        Reference = None
    for text in cases:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        if Reference is not None:
            assert ids == Reference.get_instance().encode(text, bos=False, eos=False)


def test_mistral_sentencepiece(mistral_model, texts):
    import sentencepiece

    tok = load_tokenizer(mistral_model)
    sp = sentencepiece.SentencePieceProcessor(model_file=mistral_model)
    assert (tok.vocab_size, tok.bos, tok.eod, tok.pad_id, tok.pad) == (32000, 1, 2, None, -1)
    for text in texts[:10]:
        assert tok.encode(text) == sp.encode(text)


@pytest.mark.parametrize("spec", ["byte", "data_pipeline/assets/demo_sp.model"])
def test_pickles_by_spec(spec):
    tok = load_tokenizer(spec)
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(SAMPLE) == tok.encode(SAMPLE)
    assert clone.unique_identifiers == tok.unique_identifiers


def test_unique_identifiers_follow_content(tmp_path):
    import shutil

    copy = tmp_path / "copy.model"
    shutil.copy("data_pipeline/assets/demo_sp.model", copy)
    a, b = load_tokenizer("data_pipeline/assets/demo_sp.model"), load_tokenizer(str(copy))
    assert a.unique_identifiers["sha256"] == b.unique_identifiers["sha256"]
    assert a.unique_identifiers["sha256"] != load_tokenizer("byte").unique_identifiers["sha256"]


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(TokenizerLoadError, match="not found.*does not exist"):
        load_tokenizer(str(tmp_path / "missing.model"))
    with pytest.raises(TokenizerLoadError, match="has no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x00\x01 this is not a model")
    with pytest.raises(TokenizerLoadError, match="not a SentencePiece model"):
        load_tokenizer(str(garbage))
    bad_json = tmp_path / "tokenizer.json"
    bad_json.write_text("{}")
    with pytest.raises(TokenizerLoadError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(str(bad_json))
    ranks = tmp_path / "ranks.txt"
    ranks.write_text("not-base64!! x\n")
    with pytest.raises(TokenizerLoadError, match="not a tiktoken BPE rank file"):
        load_tokenizer("tiktoken:" + str(ranks))


def test_tiktoken_ranks_come_back_from_their_cache_exactly(llama3_model, tmp_path, monkeypatch):
    """The decoded ranks are kept by the file's content: the second load reads them back
    (tiktoken's decoder is not called), equal and in order; an entry that is not whole is
    decoded afresh; another file gets its own entry."""
    from tiktoken.load import load_tiktoken_bpe

    from data_pipeline import tokenizers

    monkeypatch.setattr(tokenizers, "RANKS_CACHE_DIR", str(tmp_path / "ranks"))
    calls = []

    def counted(path):
        calls.append(path)
        return load_tiktoken_bpe(path)

    want = load_tiktoken_bpe(llama3_model)
    first, digest = tokenizers._tiktoken_ranks(llama3_model, counted)
    again, digest_again = tokenizers._tiktoken_ranks(llama3_model, counted)
    assert digest == digest_again == hashlib.sha256(open(llama3_model, "rb").read()).hexdigest()
    assert len(calls) == 1 and list(first.items()) == list(again.items()) == list(want.items())
    (entry,) = (tmp_path / "ranks").iterdir()
    assert entry.name.endswith(".npz") and [p.name for p in (tmp_path / "ranks").iterdir()] == [entry.name]
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # not whole
    assert tokenizers._tiktoken_ranks(llama3_model, counted)[0] == want and len(calls) == 2
    assert tokenizers._tiktoken_ranks(llama3_model, counted)[0] == want and len(calls) == 2  # rewritten
    other = tmp_path / "other.model"
    other.write_bytes(b"".join(open(llama3_model, "rb").read().splitlines(keepends=True)[:1000]))
    assert len(tokenizers._tiktoken_ranks(str(other), counted)[0]) == 1000 and len(calls) == 3
    assert len(list((tmp_path / "ranks").iterdir())) == 2
    import tiktoken

    fresh = tiktoken.Encoding("fresh", pat_str=tokenizers.LLAMA3_PATTERN, mergeable_ranks=want, special_tokens={})
    tok = load_tokenizer(f"tiktoken:{llama3_model}")  # its ranks from the cache: the same ids
    assert tok.encode(SAMPLE + " <|begin_of_text|>") == fresh.encode(SAMPLE + " <|begin_of_text|>")


def test_released_tiktoken_tables_load_again_from_the_same_file(llama3_model, tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(open(llama3_model, "rb").read())
    tok = load_tokenizer(f"tiktoken:{path}")
    want, vocab = tok.encode(SAMPLE), tok.vocab_size
    tok.release_tables()
    assert tok._enc is None and tok.vocab_size == vocab and tok.eod == 128001
    assert tok.pieces("x" * 30_000) == ["x" * 25_000, "x" * 5_000]  # cutting needs no tables
    assert tok.encode(SAMPLE) == want and tok._enc is not None  # loaded again
    tok.release_tables()
    path.write_bytes(b"".join(open(llama3_model, "rb").read().splitlines(keepends=True)[:1000]))
    with pytest.raises(TokenizerLoadError, match="changed since it was loaded"):
        tok.encode(SAMPLE)


def test_a_tiktoken_file_replaced_at_the_same_path_is_read_anew(llama3_model, tmp_path, monkeypatch):
    """tiktoken keeps a copy of every file it reads under the hash of its path and reads the
    copy next time: a replaced tokenizer file must still be read as the new one (the one
    unique_identifiers hashes), by the reference and by gigatoken's converted form."""
    from tiktoken.load import load_tiktoken_bpe

    from data_pipeline.fast_encoders import GigatokenEncoder, choose_encoder

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))
    monkeypatch.setenv("GIGATOKEN_JSON_CACHE", str(tmp_path / "gigatoken-cache"))
    monkeypatch.setattr("data_pipeline.fast_encoders.CACHE_DIR", str(tmp_path / "gigatoken-cache"))
    monkeypatch.setattr("data_pipeline.tokenizers.RANKS_CACHE_DIR", str(tmp_path / "ranks-cache"))
    path = tmp_path / "tokenizer.model"
    lines = open(llama3_model, "rb").read().splitlines(keepends=True)
    path.write_bytes(b"".join(lines))
    assert len(load_tiktoken_bpe(str(path))) == 128000  # tiktoken now holds a copy of it
    path.write_bytes(b"".join(lines[:1000]))  # another tokenizer at the same path
    tok = load_tokenizer(f"tiktoken:{path}")
    assert tok.vocab_size == 1000 + 256 and tok.eod == 1001
    assert max(tok.encode(SAMPLE)) < 1000  # the new file's ranks
    assert (tmp_path / "tiktoken-cache").is_dir() and os.environ["TIKTOKEN_CACHE_DIR"].endswith("tiktoken-cache")
    encoder, why = choose_encoder(tok, "auto", [SAMPLE])
    assert isinstance(encoder, GigatokenEncoder), why
    assert encoder.encode_array(SAMPLE).tolist() == tok.encode(SAMPLE)
