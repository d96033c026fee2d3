"""train_tokenizer: BPE and unigram models from text and jsonl, with byte fallback, pad and
user-defined specials, written atomically."""

from __future__ import annotations

import gzip

import pytest

from data_pipeline.sources import InputError
from data_pipeline.tokenizers import load_tokenizer
from data_pipeline.train_tokenizer import main, train
from tests.data_pipeline.conftest import write_jsonl


def test_bpe_from_jsonl_with_specials(tmp_path, texts):
    corpus = write_jsonl(tmp_path / "kjv.jsonl.gz", texts[:60])
    path = train([corpus], str(tmp_path / "sp"), vocab_size=500, byte_fallback=True, pad=True,
                 user_defined_symbols=["<|sep|>"], progress=False)
    tok = load_tokenizer(path)
    assert (tok.vocab_size, tok.bos, tok.eod, tok.pad_id) == (500, 1, 2, 3)
    sep = tok._sp.PieceToId("<|sep|>")
    assert sep == 4 and sep in tok.encode("the end<|sep|>the start")
    for text in texts[60:70]:  # unseen chapters round-trip exactly
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("ünïcödé ✓")) == "ünïcödé ✓"  # byte fallback
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kjv.jsonl.gz", "sp.model", "sp.vocab"]


def test_unigram_from_plain_text(tmp_path, texts):
    with gzip.open(tmp_path / "kjv.txt.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(texts[:40]))
    code = main(["-i", str(tmp_path / "kjv.txt.gz"), "-o", str(tmp_path / "uni"),
                 "--vocab-size", "300", "--model-type", "unigram", "--no-progress"])
    assert code == 0
    tok = load_tokenizer(str(tmp_path / "uni.model"))
    assert tok.vocab_size == 300 and tok.pad_id is None
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    proto = model_pb2.ModelProto.FromString((tmp_path / "uni.model").read_bytes())
    assert proto.trainer_spec.model_type == model_pb2.TrainerSpec.UNIGRAM
    # Trained on lines and without byte fallback, a newline is <unk>; lines round-trip.
    for line in texts[50].splitlines()[2:8]:
        assert tok.decode(tok.encode(line)) == line


def test_errors(tmp_path, capsys):
    with pytest.raises(InputError, match="not found"):
        train([str(tmp_path / "none.txt")], str(tmp_path / "x"), vocab_size=100, progress=False)
    with pytest.raises(InputError, match="does not exist"):
        train([str(tmp_path / "none.txt")], str(tmp_path / "no" / "x"), vocab_size=100,
              progress=False)
    (tmp_path / "tiny.txt").write_text("just a few words\n")
    assert main(["-i", str(tmp_path / "tiny.txt"), "-o", str(tmp_path / "x"), "--vocab-size",
                 "5000", "--no-progress"]) == 2
    assert "sentencepiece training failed" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.txt"]
