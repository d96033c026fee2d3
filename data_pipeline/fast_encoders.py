"""gigatoken encoders that give the reference tokenizers' ids, and the `--encoder` choice.

    encoder, why = choose_encoder(load_tokenizer(spec), "auto", sample_texts)

gigatoken (Rust; PyPI `gigatoken`, pinned in pyproject.toml) encodes 4-12x faster
than SentencePiece / tiktoken per core, but it is a second implementation of the
same algorithms, so it is used only where it reproduces the reference's ids:
- SentencePiece BPE models with byte fallback (Mistral's, ours trained with
  --byte-fallback, the demo model), through gigatoken's own .model converter.
  Unigram models and BPE without byte fallback are refused by gigatoken 0.10.0.
- Llama-3's tiktoken rank file, through transformers' TikTokenConverter (a
  tokenizer.json): gigatoken 0.10.0's `from_tiktoken` panics on this file
  (assertion at src/bpe/tiktoken.rs:614). Text is cut where the reference cuts it
  (`TiktokenTokenizer.pieces`): BPE across a 400,000-character cut differs.
- Hugging Face tokenizer.json files that gigatoken loads (byte-level BPE,
  SentencePiece-style BPE).
Special-token strings inside documents: the reference's plain encode reads them
as text for SentencePiece and tiktoken (`<s>` is `<`, `s`, `>`), so their added
tokens are removed from the tokenizer.json gigatoken loads; Hugging Face's encode
matches added tokens in the text, and gigatoken does the same with them kept.
Whatever the route, `choose_encoder` compares ids on tricky built-in strings and a
sample of the input before using it; `auto` falls back to the reference on any
difference, and an explicit `gigatoken` is then an error. The reference's ids of the
built-in strings are cached by all they depend on (`probe_reference_ids`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np

from data_pipeline.heap import return_freed_memory
from data_pipeline.tokenizers import (
    LLAMA3_PATTERN, TIKTOKEN_PREFIX, HFTokenizer, SentencePieceTokenizer,
    TiktokenTokenizer, Tokenizer, TokenizerLoadError, join_documents, tiktoken_reads_files_afresh,
)

ENCODERS = ("auto", "reference", "gigatoken")

# Strings on which a second implementation is most likely to differ from the reference:
# special-token strings of every family, runs past the reference's cutting lengths,
# whitespace of every kind and empty lines, Unicode that normalisers treat specially.
_SPECIALS = ("<s>", "</s>", "<unk>", "<pad>", "<mask>", "[CLS]", "[SEP]", "<|begin_of_text|>",
             "<|end_of_text|>", "<|eot_id|>", "<|endoftext|>", "<|im_start|>", "<|fim_prefix|>",
             "<|reserved_special_token_5|>", "<0x41>", "▁", "<<s>>", "<s</s>>")
PROBE_TEXTS = (
    " ".join(_SPECIALS), "".join(_SPECIALS), "x<s>y</s>z\n<s>\n\n</s> <|endoftext|>.",
    "  leading and trailing spaces  ", "\n\n\nempty lines\n\n\n\nbetween\n \n\t\n", "\r\n\r\n\r",
    " " * 30_001 + "x", "x" + "\n" * 26_000 + "y", "\t \n" * 9_000 + "end",
    "a" * 30_000, "ab1" * 10_000, "€" * 26_000, "1234567890" * 3_000 + " 42 3.14159 -0.5e-10",
    ("word " * 1_000 + "\n") * 90,  # ~450,000 characters: past tiktoken's 400,000 cut
    "\ufffd\ufffd é e\u0301 ñ Å Å ﬁ ＡＢＣ ｶﾞ ① ² ½ ⅷ",  # replacement char, NFC/NFD/NFKC pairs
    "\u00a0nbsp\u2002en\u3000ideographic\u200bzero-width\u2028line\u2029para\u0085nel",
    "\ufeffBOM \x00NUL \x01\x07\x1b[0m \x7f \ufdd0 \uffff \U0010ffff \ue000 private",
    "中文字符 日本語のテキスト 한국어 ไทย العربية עברית हिन्दी Ελληνικά русский",
    "😀👍🏽👨‍👩‍👧‍👦🇫🇷 \u202eRTL\u202c \u200d\u200c",
    "don't WE'LL they're I'M it's 's 'S", "def f(x):\n\tif x:\n\t\treturn {'a': [1, 2]}\n",
)
CACHE_DIR = os.environ.get("GIGATOKEN_JSON_CACHE",
                           os.path.join(os.path.expanduser("~"), ".cache", "mcore-stack", "gigatoken"))
SAMPLE_BYTES = 1 << 18  # of the input, compared too (the first chunk of the first input)


class EncoderUnavailable(TokenizerLoadError):
    """--encoder gigatoken for a tokenizer it cannot encode exactly; the message says why."""


def gigatoken_json(tok: Tokenizer) -> str:
    """The tokenizer.json gigatoken loads for `tok` (see the module docstring), or
    EncoderUnavailable naming why there is none."""
    if isinstance(tok, SentencePieceTokenizer):
        return _cached(tok, _sentencepiece_json)
    if isinstance(tok, TiktokenTokenizer):
        return _cached(tok, _tiktoken_json)
    if isinstance(tok, HFTokenizer):
        path = os.path.join(tok.spec, "tokenizer.json") if os.path.isdir(tok.spec) else tok.spec
        with open(path, encoding="utf-8") as f:
            return f.read()
    raise EncoderUnavailable(f"gigatoken has no encoder for the {tok.kind} tokenizer {tok.spec!r}")


def _sentencepiece_json(tok: SentencePieceTokenizer) -> str:
    from gigatoken._load.sentencepiece import sentencepiece_to_tokenizer_json

    with open(tok.spec, "rb") as f:
        try:
            data = json.loads(sentencepiece_to_tokenizer_json(f.read()))
        except ValueError as err:  # "only BPE sentencepiece models are supported", ...
            raise EncoderUnavailable(f"gigatoken cannot load {tok.spec!r}: {err}") from None
    data["added_tokens"] = []  # SentencePiece's EncodeAsIds reads "<s>" as text
    return json.dumps(data)


def _tiktoken_json(tok: TiktokenTokenizer) -> str:
    try:
        import transformers.utils.logging as hf_logging
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError:
        raise EncoderUnavailable("gigatoken reads tiktoken ranks here through transformers' "
                                 "TikTokenConverter: pip install transformers==5.23.0") from None

    hf_logging.set_verbosity_error()  # it warns about tiktoken's own file format
    path = tok.spec[len(TIKTOKEN_PREFIX):]
    with tiktoken_reads_files_afresh(path):  # the converter reads the ranks through tiktoken
        converted = TikTokenConverter(vocab_file=path, pattern=LLAMA3_PATTERN).converted()
    data = json.loads(converted.to_str())
    # No added tokens: Llama-3's specials (ids above the ranks) stay text, as in
    # TiktokenTokenizer.encode_array.
    data["added_tokens"] = []
    return json.dumps(data)


def _cached(tok: Tokenizer, convert) -> str:
    """convert(tok), kept under CACHE_DIR by the tokenizer's content hash: converting
    Llama-3's ranks takes ~7 s (transformers' import and merge recovery), reading ~0.1 s.
    A stale or corrupt entry cannot change ids unseen: choose_encoder compares them."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "none"

    # Another converter version may convert differently: its own entry.
    tag = "-".join(f"{name}{installed(name)}" for name in ("gigatoken", "transformers"))
    path = os.path.join(CACHE_DIR, f"{tok.kind}-{tok.unique_identifiers['sha256']}-{tag}.json")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        pass
    data = convert(tok)
    try:
        os.makedirs(CACHE_DIR, exist_ok=True)
        with open(f"{path}.{os.getpid()}.partial", "w", encoding="utf-8") as f:
            f.write(data)
        os.replace(f"{path}.{os.getpid()}.partial", path)  # atomic: readers see all or nothing
    except OSError:
        pass  # a read-only home costs the conversion on every run, nothing else
    return data


class GigatokenEncoder:
    """`reference`'s ids from gigatoken: `encode_array` per document, `encode_documents`
    per chunk (on this thread: see workers' module docstring)."""

    name = "gigatoken"

    def __init__(self, reference: Tokenizer, tokenizer_json: str | None = None) -> None:
        self.reference = reference
        self._json = tokenizer_json if tokenizer_json is not None else gigatoken_json(reference)
        self._load()

    def _load(self) -> None:
        """gigatoken's tokenizer from self._json, its load's freed buffers handed back."""
        import gigatoken

        self._tok = None  # a reload frees the old tables and cache before building new ones
        try:
            self._tok = gigatoken.Tokenizer.from_json(self._json)
        except BaseException as err:  # a Rust panic arrives as pyo3's PanicException(BaseException)
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            first_line = (str(err).strip().splitlines() or [""])[0]  # Rust adds its source location
            raise EncoderUnavailable(f"gigatoken failed to load {self.reference.spec!r}: "
                                     f"{type(err).__name__}: {first_line}") from None
        return_freed_memory()

    def encode_array(self, text: str, utf8: bytes | None = None) -> np.ndarray:
        """`text`'s ids; `utf8`: its UTF-8 if the caller has it (the same ids: gigatoken reads
        str as UTF-8, and a non-ASCII str would be encoded to it once more for the call)."""
        pieces = self.reference.pieces(text)
        if len(pieces) == 1:  # the common case: no cut
            return self._tok.encode(text if utf8 is None else utf8)
        return np.concatenate([self._tok.encode(piece) for piece in pieces])

    def encode_documents(self, texts: list[str], dtype=np.int64, eod: int | None = None,
                         into: np.ndarray | None = None,
                         utf8: list[bytes | None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """As Tokenizer.encode_documents. One call into Rust per document: as fast as
        encode_batch(parallel=False) here, and no awkward array (its import alone cost
        0.13 CPU-s per process, more than encoding 30 MB of Llama-3 text)."""
        if utf8 is None:
            arrays = [self.encode_array(text) for text in texts]
        else:
            arrays = [self.encode_array(text, data) for text, data in zip(texts, utf8, strict=True)]
        return join_documents(arrays, dtype, eod, into)

    def reset_cache(self) -> None:
        """Empty gigatoken's cache of encoded pieces, which only grows (workers.retire_after),
        by loading the tokenizer afresh (0.7 CPU-s for Llama-3's, less for smaller ones)."""
        self._load()

    # Spawned workers rebuild it from the converted tokenizer.json (no second conversion).
    def __getstate__(self) -> dict:
        return {"reference": self.reference, "json": self._json}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["reference"], state["json"])


def first_difference(reference: Tokenizer, encoder, texts, wanted: list | None = None) -> int | None:
    """Index of the first text whose ids differ between the two encoders, or None.
    `wanted`: the reference's ids of the first len(wanted) texts, where known."""
    wanted = wanted or []
    # Non-ASCII texts as UTF-8 too, as the workers hand them over (sources.text_utf8).
    utf8 = [None if text.isascii() else text.encode("utf-8") for text in texts]
    tokens, lengths = encoder.encode_documents(list(texts), utf8=utf8)
    ends = np.cumsum(lengths)
    for index, text in enumerate(texts):
        ours = tokens[ends[index] - lengths[index]:ends[index]]
        want = wanted[index] if index < len(wanted) else reference.encode_array(text)
        if not np.array_equal(ours, want):
            return index
    return None


# The library that computes each reference's ids: its version is part of what they depend on.
_REFERENCE_LIBRARIES = {"sentencepiece": "sentencepiece", "tiktoken": "tiktoken",
                        "huggingface": "tokenizers"}


def probe_reference_ids(tok: Tokenizer) -> list[np.ndarray]:
    """The reference's ids for PROBE_TEXTS, kept under CACHE_DIR: computing them is most of
    choose_encoder's cost (0.1 CPU-s with Llama-3's tiktoken, 0.3 with Mistral's
    SentencePiece, the 450,000-character string most of it), reading them ~1 ms. The
    entry's name hashes all they depend on: the tokenizer's content (unique_identifiers),
    the library computing them and its version, the probe strings, and data_pipeline/
    tokenizers.py (size and mtime: the reference's own code, e.g. tiktoken's cutting). An
    entry that does not read back whole is recomputed; gigatoken is still run on every
    probe string each time."""
    library = _REFERENCE_LIBRARIES.get(tok.kind)
    module = sys.modules.get(library) if library else None
    if module is None:
        return [tok.encode_array(text) for text in PROBE_TEXTS]
    from data_pipeline import tokenizers

    code = os.stat(tokenizers.__file__)
    key = hashlib.sha256(json.dumps([dict(tok.unique_identifiers), library, getattr(module, "__version__", "?"),
                                     code.st_size, code.st_mtime_ns], sort_keys=True).encode())
    for text in PROBE_TEXTS:
        key.update(text.encode("utf-8", "surrogatepass") + b"\0")
    path = os.path.join(CACHE_DIR, f"probe-ids-{tok.kind}-{key.hexdigest()[:32]}.npy")
    count = len(PROBE_TEXTS)
    try:
        flat = np.load(path, allow_pickle=False)  # the counts, then the ids end to end
        ends = count + np.cumsum(flat[:count])
        if flat.ndim == 1 and len(flat) > count and ends[-1] == len(flat):
            return np.split(flat[count:], ends[:-1] - count)
    except (OSError, ValueError, EOFError):  # missing, or not whole
        pass
    ids = [tok.encode_array(text) for text in PROBE_TEXTS]
    try:
        os.makedirs(CACHE_DIR, exist_ok=True)
        partial = f"{path}.{os.getpid()}.partial.npy"
        np.save(partial, np.concatenate([[len(a) for a in ids], *ids]).astype(np.int64), allow_pickle=False)
        os.replace(partial, path)  # atomic: readers see all or nothing
    except OSError:
        pass  # a read-only home costs the computation on every run, nothing else
    return ids


def choose_encoder(tok: Tokenizer, choice: str, sample: list[str]):
    """(encoder, one line saying which and why) for --encoder `choice`; `sample` holds
    documents of the input, compared with the built-in PROBE_TEXTS. Raises
    EncoderUnavailable for `gigatoken` where it cannot be exact."""
    if choice not in ENCODERS:
        raise EncoderUnavailable(f"--encoder must be one of {', '.join(ENCODERS)}, got {choice!r}")
    if choice == "reference":
        return tok, f"encoder: reference ({tok.kind}), as asked (--encoder reference)"
    try:
        fast = GigatokenEncoder(tok)
        texts = list(PROBE_TEXTS) + list(sample)
        bad = first_difference(tok, fast, texts, probe_reference_ids(tok))
    except EncoderUnavailable as err:
        if choice == "gigatoken":
            raise EncoderUnavailable(f"--encoder gigatoken: {err}; use --encoder reference "
                                     "(or auto)") from None
        return tok, f"encoder: reference ({tok.kind}), since {err}"
    if bad is not None:
        where = (f"built-in probe string {bad}" if bad < len(PROBE_TEXTS)
                 else f"document {bad - len(PROBE_TEXTS) + 1} of the input sample")
        why = f"gigatoken's ids differ from the {tok.kind} reference's on {where}"
        if choice == "gigatoken":
            raise EncoderUnavailable(f"--encoder gigatoken: {why}; use --encoder reference (or auto)")
        return tok, f"encoder: reference ({tok.kind}), since {why}"
    sample_mb = sum(len(text.encode("utf-8", "surrogatepass")) for text in sample) / 1e6
    return fast, (f"encoder: gigatoken, same ids as the {tok.kind} reference on {len(PROBE_TEXTS)} "
                  f"probe strings and {len(sample)} input documents ({sample_mb:.2f} MB)")


def input_sample(sources, text_field: str, size: int = SAMPLE_BYTES) -> list[str]:
    """The valid documents of the first `size` bytes of the first input (what choose_encoder
    compares besides its probe strings)."""
    from data_pipeline.sources import BadRecord, check_text, iter_chunks, iter_records

    chunk = next(iter_chunks(sources[:1], size, text_field), None)
    texts = []
    for _, text in iter_records(chunk, text_field) if chunk is not None else ():
        try:
            if not isinstance(text, BadRecord):
                check_text(text)
                texts.append(text)
        except BadRecord:
            pass
    return texts
