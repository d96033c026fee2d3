"""gigatoken against the reference tokenizers on real text (the Jargon File, from Debian's
jargon-text) plus documents built to break it: ids equal for every document and every
tokenizer kind it loads; preprocess output byte-identical with either encoder; a clear
refusal where gigatoken cannot be exact."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest

from data_pipeline.fast_encoders import (
    PROBE_TEXTS, EncoderUnavailable, GigatokenEncoder, choose_encoder, first_difference,
    probe_reference_ids,
)
from data_pipeline.preprocess import main, preprocess
from data_pipeline.tokenizers import load_tokenizer
from data_pipeline.train_tokenizer import train
from tests.data_pipeline.conftest import output_files, write_jsonl

SPECIALS = ["<s>", "</s>", "<unk>", "<pad>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
            "<|endoftext|>", "<|reserved_special_token_7|>", "<mask>"]


def hard_documents(real: list[str]) -> list[str]:
    """Real entries with special strings, long runs, odd Unicode and empty lines worked in,
    and one document past tiktoken's 400,000-character cut."""
    docs = []
    for i, text in enumerate(real[:300]):
        special = SPECIALS[i % len(SPECIALS)]
        words = text.split(" ")
        middle = len(words) // 2
        docs.append(" ".join(words[:middle] + [special] + words[middle:]) + special)
        docs.append(special + text.replace("\n", "\n\n\n \n", 3))
    sample = real[0]
    docs += [
        sample + " " * 30_000 + sample,                     # whitespace run past the 25,000 cut
        sample + "\n" * 26_000 + "\t" * 100 + sample,
        sample + "x" * 40_000 + sample,                     # non-whitespace run past it
        sample + "-" * 60_000,
        "\n\n".join(real[:2000])[:450_000],                 # one document past the 400,000 cut
        "\ufffd" * 50 + sample + "\ufffd",                   # what a decoder's errors="replace" yields
        "e\u0301 ﬁ ＡＢＣ ① ½ \u00a0\u3000\u200b\u2028\u0085 \ufeff\x00\x1b[0m \ufdd0\uffff\U0010ffff " + sample,
        "😀👨‍👩‍👧‍👦🇫🇷 中文 日本語 한국어 العربية " + sample,
        "\n\n\n" + sample + "\n\n\n\n",
    ]
    return docs


def assert_same_ids(tok, encoder, texts: list[str]) -> None:
    """Both ways preprocess's workers can hand documents over: as str, and with the UTF-8 of
    the non-ASCII ones (sources.text_utf8) beside them."""
    utf8 = [None if text.isascii() else text.encode("utf-8") for text in texts]
    for form in (None, utf8):
        tokens, lengths = encoder.encode_documents(texts, utf8=form)
        assert len(lengths) == len(texts) and lengths.sum() == len(tokens)
        ends = np.cumsum(lengths)
        for index, text in enumerate(texts):
            ours = tokens[ends[index] - lengths[index]:ends[index]].tolist()
            assert ours == tok.encode(text), f"document {index} differs ({'UTF-8' if form else 'str'})"


@pytest.fixture(scope="module")
def jargon_docs(debian_jargon) -> list[str]:
    assert len(debian_jargon) > 2000
    return debian_jargon + hard_documents(debian_jargon)


@pytest.fixture(scope="module")
def own_models(module_tmp_factory, debian_jargon) -> dict[str, str]:
    """Our own SentencePiece models trained on the Jargon File (train_tokenizer)."""
    root = module_tmp_factory.mktemp("own")
    corpus = write_jsonl(root / "train.jsonl", debian_jargon[:400])
    return {f"{kind}-{fallback}": train([corpus], str(root / f"{kind}-{fallback}"), vocab_size=1000,
                                        model_type=kind, byte_fallback=fallback, progress=False)
            for kind, fallback in (("bpe", True), ("bpe", False), ("unigram", True))}


@pytest.fixture(scope="module")
def gpt2_style(module_tmp_factory, debian_jargon) -> str:
    """A GPT-2 style byte-level BPE tokenizer.json with <|endoftext|> as a special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(debian_jargon[:1500], trainers.BpeTrainer(
        vocab_size=3000, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    path = str(module_tmp_factory.mktemp("gpt2") / "tokenizer.json")
    tok.save(path)
    return path


def _spec(which: str, request) -> str:
    if which == "mistral":
        return request.getfixturevalue("mistral_model")
    if which == "llama3":
        return "tiktoken:" + request.getfixturevalue("llama3_model")
    if which == "gpt2-style":
        return request.getfixturevalue("gpt2_style")
    if which == "demo":
        return "data_pipeline/assets/demo_sp.model"
    return request.getfixturevalue("own_models")["bpe-True"]


@pytest.mark.parametrize("which", ["mistral", "llama3", "gpt2-style", "own-bpe", "demo"])
def test_gigatoken_ids_equal_the_reference_on_real_text(which, jargon_docs, request):
    tok = load_tokenizer(_spec(which, request))
    encoder, why = choose_encoder(tok, "auto", jargon_docs[:50])
    assert isinstance(encoder, GigatokenEncoder), why
    assert why.startswith("encoder: gigatoken")
    assert_same_ids(tok, encoder, jargon_docs)
    assert_same_ids(tok, encoder, list(PROBE_TEXTS))


def test_special_strings_stay_text_as_in_each_reference(request, gpt2_style):
    """SentencePiece and tiktoken read "<s>" / "<|begin_of_text|>" as characters; a Hugging
    Face tokenizer.json matches its added tokens in the text (its encode does)."""
    for spec, special in ((request.getfixturevalue("mistral_model"), "<s>"),
                          ("tiktoken:" + request.getfixturevalue("llama3_model"), "<|begin_of_text|>")):
        tok = load_tokenizer(spec)
        ids = GigatokenEncoder(tok).encode_array(f"a {special} b").tolist()
        assert ids == tok.encode(f"a {special} b") and tok.bos not in ids
    tok = load_tokenizer(gpt2_style)
    ids = GigatokenEncoder(tok).encode_array("a<|endoftext|>b").tolist()
    assert ids == tok.encode("a<|endoftext|>b") and ids.count(tok.eod) == 1


@pytest.mark.parametrize("model", ["bpe-False", "unigram-True"])
def test_models_gigatoken_cannot_load_fall_back_or_refuse(model, own_models, tmp_path, capsys):
    tok = load_tokenizer(own_models[model])
    encoder, why = choose_encoder(tok, "auto", [])
    assert encoder is tok and why.startswith("encoder: reference (sentencepiece), since gigatoken")
    with pytest.raises(EncoderUnavailable, match="--encoder gigatoken: gigatoken cannot load .*"
                                                 "use --encoder reference"):
        choose_encoder(tok, "gigatoken", [])
    # The CLI: one line, exit 2, before any output exists.
    corpus = write_jsonl(tmp_path / "in.jsonl", ["some text"])
    out = tmp_path / "out"
    out.mkdir()
    handler = signal.getsignal(signal.SIGTERM)  # main() installs its own
    try:
        code = main(["-i", corpus, "-o", str(out / "x"), "-t", own_models[model], "--encoder", "gigatoken"])
    finally:
        signal.signal(signal.SIGTERM, handler)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "use --encoder reference" in err
    assert output_files(out) == []


def test_a_difference_is_found_and_located(mistral_model, jargon_docs):
    """first_difference compares every text: another tokenizer's gigatoken encoder differs."""
    mistral = load_tokenizer(mistral_model)
    demo = GigatokenEncoder(load_tokenizer("data_pipeline/assets/demo_sp.model"))
    assert first_difference(mistral, GigatokenEncoder(mistral), jargon_docs[:200]) is None
    assert first_difference(mistral, demo, ["", ""] + jargon_docs[:3]) == 2


@pytest.mark.parametrize("which", ["mistral", "llama3"])
def test_preprocess_output_is_byte_identical_with_either_encoder(which, jargon_docs, request, tmp_path):
    spec = _spec(which, request)
    corpus = tmp_path / "in.jsonl"
    write_jsonl(corpus, jargon_docs[:1500] + jargon_docs[-20:])
    with open(corpus, "a", encoding="utf-8") as f:  # records the reader refuses (skipped)
        f.write('{"text": "lone \\ud800 surrogate"}\n{"text": "   "}\nnot json\n')
        f.write(json.dumps({"text": "after the bad records <s>"}) + "\n")
    outputs = {}
    for encoder, workers in (("reference", 2), ("gigatoken", 2), ("auto", 0)):
        prefix = str(tmp_path / f"{encoder}-{workers}")
        summary = preprocess([str(corpus)], tokenizer=spec, output_prefix=prefix, append_eod=True,
                             workers=workers, skip_bad_records=True, encoder=encoder, chunk_bytes=1 << 18)
        assert dict(summary.skipped) == {"empty document": 1, "invalid UTF-8": 1, "malformed JSON": 1}
        outputs[encoder] = [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]
    assert outputs["gigatoken"] == outputs["reference"] == outputs["auto"]


def test_spawned_workers_get_the_same_encoder(mistral_model, jargon_docs):
    """Spawned workers unpickle it (forked ones inherit it): rebuilt from the converted
    tokenizer.json, same ids."""
    import pickle

    tok = load_tokenizer(mistral_model)
    copy = pickle.loads(pickle.dumps(GigatokenEncoder(tok)))
    assert isinstance(copy, GigatokenEncoder) and copy.reference.spec == tok.spec
    assert_same_ids(tok, copy, jargon_docs[:100])


def test_probe_reference_ids_are_cached_by_tokenizer_and_a_bad_entry_is_recomputed(
        mistral_model, tmp_path, monkeypatch):
    from data_pipeline import fast_encoders
    from data_pipeline.tokenizers import SentencePieceTokenizer

    monkeypatch.setattr(fast_encoders, "CACHE_DIR", str(tmp_path))
    tok = load_tokenizer(mistral_model)
    want = [tok.encode_array(text).tolist() for text in PROBE_TEXTS]
    assert [ids.tolist() for ids in probe_reference_ids(tok)] == want
    [entry] = tmp_path.glob("probe-ids-sentencepiece-*.npy")
    real = SentencePieceTokenizer.encode_array

    def refuse(self, text):
        raise AssertionError("encoded although cached")

    monkeypatch.setattr(SentencePieceTokenizer, "encode_array", refuse)
    assert [ids.tolist() for ids in probe_reference_ids(tok)] == want  # read back, not encoded
    with pytest.raises(AssertionError, match="although cached"):  # another model: its own entry
        probe_reference_ids(load_tokenizer("data_pipeline/assets/demo_sp.model"))
    monkeypatch.setattr(SentencePieceTokenizer, "encode_array", real)
    entry.write_bytes(entry.read_bytes()[:1000])  # cut short: recomputed and rewritten
    assert [ids.tolist() for ids in probe_reference_ids(tok)] == want
    assert entry.stat().st_size > 1000 and len(list(tmp_path.glob("probe-ids-*.npy"))) == 1
