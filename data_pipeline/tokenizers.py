"""Tokenizers behind one small interface.

`load_tokenizer(spec)` accepts:
- a SentencePiece model file (``*.model``), e.g. ``data_pipeline/assets/demo_sp.model``;
- a Hugging Face ``tokenizer.json`` file, or a directory holding one (special
  tokens are read from ``tokenizer_config.json`` beside it when present);
- a tiktoken BPE rank file (the format of Llama-3's ``tokenizer.model``), written
  ``tiktoken:PATH``; it is read with Llama-3's split pattern and special tokens;
- ``byte``: 256 byte ids plus BOS/EOD/PAD, for tests.

Every tokenizer exposes ``encode``/``decode``, ``vocab_size``, ``bos``, ``eod``
(= ``eos``), ``pad`` and ``unique_identifiers``: the attributes Megatron-Core's
``GPTDataset`` reads from its config's tokenizer, so the same object is handed
to the dataset builder. This module imports no torch/megatron: preprocessing
workers load it, and their start-up time is on the critical path.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from abc import ABC, abstractmethod
from collections import OrderedDict
from contextlib import contextmanager
from functools import cached_property

import numpy as np

TIKTOKEN_PREFIX = "tiktoken:"

# Llama-3's pre-tokenisation pattern and special tokens (llama_models/llama3/tokenizer.py).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_NAMED_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
    "<|python_tag|>", "<|image|>",
]
LLAMA3_SPECIALS = _LLAMA3_NAMED_SPECIALS + [
    f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(_LLAMA3_NAMED_SPECIALS))
]
# tiktoken's BPE is quadratic in the length of one pre-token, so Llama-3's reference
# encoder (llama_models/llama3/tokenizer.py) cuts the text every 400,000 characters and
# inside any run of more than 25,000 whitespace or non-whitespace characters; we cut at
# the same places, so ids equal the reference's and a 1 MB run cannot stall a worker.
_TIKTOKEN_MAX_CHARS = 400_000
_TIKTOKEN_MAX_RUN = 25_000
_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (_TIKTOKEN_MAX_RUN + 1, _TIKTOKEN_MAX_RUN + 1))
_WINDOW = _TIKTOKEN_MAX_RUN // 2


# Decoded tiktoken rank files (TiktokenTokenizer: _tiktoken_ranks), by content and tiktoken version.
RANKS_CACHE_DIR = os.environ.get("TIKTOKEN_RANKS_CACHE",
                                 os.path.join(os.path.expanduser("~"), ".cache", "mcore-stack", "tiktoken-ranks"))


class TokenizerLoadError(ValueError):
    """A tokenizer spec that cannot be loaded; the message says why and what to pass."""


class Tokenizer(ABC):
    """encode/decode plus the special ids the data pipeline and Megatron-Core need."""

    kind: str = ""

    def __init__(self, spec: str) -> None:
        self.spec = spec

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (the embedding table needs this many rows)."""

    @property
    @abstractmethod
    def bos(self) -> int | None:
        """Beginning-of-sequence id, or None."""

    @property
    @abstractmethod
    def eod(self) -> int | None:
        """End-of-document id (the EOS token), appended by `preprocess --append-eod`."""

    @property
    @abstractmethod
    def pad_id(self) -> int | None:
        """Padding id, or None when the tokenizer has none."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""

    @abstractmethod
    def decode(self, ids) -> str:
        """Text of `ids`."""

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as a NumPy integer array; overridden where the library returns arrays."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_documents(self, texts: list[str], dtype=np.int64, eod: int | None = None,
                         into: np.ndarray | None = None,
                         utf8: list[bytes | None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Every text's ids end to end as `dtype`, each followed by `eod` unless None, and
        each text's count (with its eod): the preprocess workers' call, one per chunk
        (fast_encoders.GigatokenEncoder has the same). `into`: see join_documents. `utf8`:
        each text's UTF-8 where the caller has it (sources.text_utf8), which only gigatoken
        uses."""
        return join_documents([self.encode_array(text) for text in texts], dtype, eod, into)

    def pieces(self, text: str) -> list[str]:
        """The parts the reference encodes one by one (their ids end to end are the text's)."""
        return [text]

    @property
    def eos(self) -> int | None:
        return self.eod

    @property
    def pad(self) -> int:
        # Megatron's GPTDataset uses tokenizer.pad to pad and to mask padded labels;
        # -1 is its own "no pad" value (megatron_dataset._PAD_TOKEN_ID), never a real id.
        return -1 if self.pad_id is None else self.pad_id

    @cached_property
    def unique_identifiers(self) -> OrderedDict:
        """What Megatron hashes into its dataset-index cache names (the tokenizer's identity)."""
        ids = OrderedDict(kind=self.kind, vocab_size=self.vocab_size, eod=self.eod)
        ids["sha256"] = self._content_hash()
        return ids

    def _content_hash(self) -> str:
        path = self.spec[len(TIKTOKEN_PREFIX):] if self.spec.startswith(TIKTOKEN_PREFIX) else self.spec
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            return self.spec
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return digest.hexdigest()

    def release_tables(self) -> None:
        """Free what only encode/decode need, where another encoder does the encoding
        (preprocess with gigatoken); they load it again if called. Most hold nothing worth it."""

    def describe(self) -> str:
        return (f"{self.kind} tokenizer {self.spec!r}: vocab {self.vocab_size}, "
                f"bos {self.bos}, eod {self.eod}, pad {self.pad_id}")

    # Pickled into DataLoader workers (via GPTDatasetConfig) and preprocess workers:
    # ship the spec and reload, since not every backend pickles.
    def __getstate__(self) -> dict:
        return {"spec": self.spec}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(load_tokenizer(state["spec"]).__dict__)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then BOS=256, EOD=257, PAD=258. For tests."""

    kind = "byte"

    vocab_size = 259
    bos = 256
    eod = 257
    pad_id = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def _content_hash(self) -> str:
        return "byte"


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(spec)
        except (OSError, RuntimeError) as err:
            raise TokenizerLoadError(f"{spec!r} is not a SentencePiece model ({err}); "
                                     "pass a .model file written by sentencepiece") from err

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def bos(self) -> int | None:
        return _none_if_negative(self._sp.bos_id())

    @property
    def eod(self) -> int | None:
        return _none_if_negative(self._sp.eos_id())

    @property
    def pad_id(self) -> int | None:
        return _none_if_negative(self._sp.pad_id())

    def encode(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def decode(self, ids) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer.json (special tokens from tokenizer_config.json)."""

    kind = "huggingface"

    _BOS_GUESSES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
    _EOS_GUESSES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
    _PAD_GUESSES = ("<pad>", "<|pad|>", "[PAD]")

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        from tokenizers import Tokenizer as _HF

        path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
        try:
            self._tok = _HF.from_file(path)
        except Exception as err:  # the Rust side raises a bare Exception
            raise TokenizerLoadError(f"{path!r} is not a Hugging Face tokenizer.json ({err})") from err
        config = _read_tokenizer_config(os.path.dirname(os.path.abspath(path)))
        self._bos = self._special_id(config.get("bos_token"), self._BOS_GUESSES)
        self._eos = self._special_id(config.get("eos_token"), self._EOS_GUESSES)
        self._pad = self._special_id(config.get("pad_token"), self._PAD_GUESSES)

    def _special_id(self, configured, guesses) -> int | None:
        if isinstance(configured, dict):  # {"content": "<s>", ...} in older configs
            configured = configured.get("content")
        for token in ([configured] if configured else []) + list(guesses):
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos(self) -> int | None:
        return self._bos

    @property
    def eod(self) -> int | None:
        return self._eos

    @property
    def pad_id(self) -> int | None:
        return self._pad

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=False: a post-processor would otherwise add BOS/EOS per call.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE rank file read with Llama-3's pattern and 256 special tokens."""

    kind = "tiktoken"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        self._digest = None  # the rank file's SHA-256, from its first load
        self._enc = self._load()
        self._vocab_size = self._enc.n_vocab

    def _load(self):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        path = self.spec[len(TIKTOKEN_PREFIX):]
        try:
            ranks, digest = _tiktoken_ranks(path, load_tiktoken_bpe)
        except TokenizerLoadError:
            raise
        except Exception as err:  # binascii/ValueError on a file of another format
            raise TokenizerLoadError(f"{path!r} is not a tiktoken BPE rank file ({err}); each line "
                                     "must be '<base64 token> <rank>'") from err
        if self._digest not in (None, digest):  # a reload (release_tables) of a replaced file
            raise TokenizerLoadError(f"{path!r} changed since it was loaded; load the tokenizer again")
        self._digest = digest
        self._specials = {tok: len(ranks) + i for i, tok in enumerate(LLAMA3_SPECIALS)}
        return tiktoken.Encoding(os.path.basename(path), pat_str=LLAMA3_PATTERN,
                                 mergeable_ranks=ranks, special_tokens=self._specials)

    def _content_hash(self) -> str:
        return self._digest  # hashed as the ranks were read: the file is not read again

    def release_tables(self) -> None:
        """Free tiktoken's tables: 48 of the 55 MB Llama-3's reference holds, which every
        forked preprocess worker would share for nothing once gigatoken encodes (cutting,
        special ids and vocab_size need none of them). encode/decode load them again."""
        self._enc = None

    def _encoding(self):
        if self._enc is None:
            self._enc = self._load()
        return self._enc

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos(self) -> int | None:
        return self._specials["<|begin_of_text|>"]

    @property
    def eod(self) -> int | None:
        return self._specials["<|end_of_text|>"]

    @property
    def pad_id(self) -> int | None:
        return self._specials["<|finetune_right_pad_id|>"]

    def pieces(self, text: str) -> list[str]:
        if len(text) <= _TIKTOKEN_MAX_RUN:  # the common case costs one len()
            return [text]
        return list(self._cut(text))

    def _cut(self, text: str):
        for start in range(0, len(text), _TIKTOKEN_MAX_CHARS):
            block = text[start:start + _TIKTOKEN_MAX_CHARS]
            if not _may_have_long_run(block):
                yield block
                continue
            cut = 0
            for run in _LONG_RUN.finditer(block):
                for end in range(run.start() + _TIKTOKEN_MAX_RUN, run.end(), _TIKTOKEN_MAX_RUN):
                    yield block[cut:end]
                    cut = end
            yield block[cut:]

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        # Special-token strings inside documents are encoded as plain text, never as control ids.
        enc = self._encoding()
        arrays = [enc.encode_to_numpy(piece, allowed_special=set(), disallowed_special=())
                  for piece in self.pieces(text)]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    def decode(self, ids) -> str:
        return self._encoding().decode([int(i) for i in ids])


def _tiktoken_ranks(path: str, load) -> tuple[dict[bytes, int], str]:
    """(ranks, the file's SHA-256): the ranks from load(path) (tiktoken's load_tiktoken_bpe), or
    the same from the copy an earlier load left under RANKS_CACHE_DIR. Decoding Llama-3's
    128,000 base64 ranks takes 0.22 CPU-s, more than half of the reference's load, which
    every preprocess run pays for its exactness check; the copy reads back in ~0.08. It is
    named by the file's SHA-256 and tiktoken's version and holds the ranks' bytes end to
    end, their lengths and the ranks (an .npz, CRC-checked as it is read; no pickle); one that
    does not read back whole and consistent is decoded afresh and rewritten."""
    import tiktoken

    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    cache = os.path.join(RANKS_CACHE_DIR, f"{digest}-tiktoken{tiktoken.__version__}.npz")
    try:
        with np.load(cache, allow_pickle=False) as entry:
            blob, lengths, ranks = entry["blob"].tobytes(), entry["lengths"], entry["ranks"]
        ends = np.cumsum(lengths).tolist()
        if lengths.ndim == 1 and ranks.shape == lengths.shape and ends and ends[-1] == len(blob):
            return {blob[end - size:end]: rank
                    for end, size, rank in zip(ends, lengths.tolist(), ranks.tolist())}, digest
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # missing, or not whole
        pass
    with tiktoken_reads_files_afresh(path):
        ranks = load(path)
    keys = list(ranks)
    partial = f"{cache}.{os.getpid()}.partial.npz"
    try:
        os.makedirs(RANKS_CACHE_DIR, exist_ok=True)
        np.savez(partial, blob=np.frombuffer(b"".join(keys), np.uint8),
                 lengths=np.fromiter(map(len, keys), np.int64, len(keys)),
                 ranks=np.fromiter(ranks.values(), np.int64, len(keys)))
        with open(path, "rb") as f:  # the file as decoded is still the one named by `digest`
            if hashlib.sha256(f.read()).hexdigest() == digest:
                os.replace(partial, cache)  # atomic: readers see all or nothing
    except OSError:
        pass  # a read-only home costs the decoding on every load, nothing else
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return ranks, digest


@contextmanager
def tiktoken_reads_files_afresh(path: str):
    """Around a tiktoken read of the rank file `path` (tiktoken.load.load_tiktoken_bpe, also
    inside transformers' TikTokenConverter): tiktoken 0.14.0 keeps a copy of every file it
    reads, local paths included, under the hash of the path in $TIKTOKEN_CACHE_DIR (default
    /tmp/data-gym-cache), and reads that copy from then on. A tokenizer file replaced at the
    same path was then read as the old one, while unique_identifiers hashes the new one:
    the old ids under the new tokenizer's name. TIKTOKEN_CACHE_DIR="" turns the copy off;
    it is set only for the read (tiktoken reads it at each call). Guard: what tiktoken reads
    must be the file's bytes, else a loud error (an upstream change to that cache)."""
    from tiktoken.load import read_file_cached

    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        with open(path, "rb") as f:
            on_disk = f.read()
        if read_file_cached(path) != on_disk:
            raise TokenizerLoadError(
                f"tiktoken read {path!r} from its own cache, not from the file, although "
                "TIKTOKEN_CACHE_DIR is empty: this tiktoken changes how it caches files "
                "(data_pipeline.tokenizers.tiktoken_reads_files_afresh was written for 0.14.0)")
        yield
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved


def join_documents(arrays: list[np.ndarray], dtype, eod: int | None,
                   into: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`arrays` end to end as `dtype`, `eod` after each unless None, and their lengths (eod
    included): one copy, casting as it goes (ids < vocab size fit the output dtype: see
    output_paths.token_dtype), instead of a concatenate, an astype and an insert.
    `into` (an array of `dtype`): written at its start, and a view of it returned, where the
    ids fit (preprocess's workers pass shared memory: workers.TokenSlots)."""
    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    if eod is not None:
        end = np.array([eod], dtype=dtype)
        arrays = [part for ids in arrays for part in (ids, end)]
        lengths += 1
    if not arrays:
        return np.empty(0, dtype), lengths
    total = int(lengths.sum())
    if into is not None and into.dtype == np.dtype(dtype) and total <= len(into):
        return np.concatenate(arrays, out=into[:total], casting="unsafe"), lengths
    return np.concatenate(arrays, dtype=dtype, casting="unsafe"), lengths


def absolute_spec(spec: str) -> str:
    """The spec with an absolute path, so it stays valid from another directory."""
    if spec == "byte":
        return spec
    if spec.startswith(TIKTOKEN_PREFIX):
        return TIKTOKEN_PREFIX + os.path.abspath(spec[len(TIKTOKEN_PREFIX):])
    return os.path.abspath(spec)


def _may_have_long_run(block: str) -> bool:
    """False when `block` surely has no run of more than 25,000 whitespace or
    non-whitespace characters. Such a run covers a whole aligned window of 12,500, which
    is then all whitespace or lacks the common whitespace characters; each test stops
    within a few characters on ordinary text, unlike a regex search over every position
    (which cost a third of the encode time on long documents)."""
    for start in range(0, len(block) - _WINDOW + 1, _WINDOW):
        window = block[start:start + _WINDOW]
        if window.isspace() or not (" " in window or "\n" in window or "\t" in window):
            return True
    return False


def _none_if_negative(value: int) -> int | None:
    return None if value < 0 else value


def _read_tokenizer_config(directory: str) -> dict:
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_tokenizer(spec: str) -> Tokenizer:
    """Load a tokenizer from a spec (see the module docstring); errors name the fix."""
    if spec == "byte":
        return ByteTokenizer(spec)
    if spec.startswith(TIKTOKEN_PREFIX):
        _require_file(spec[len(TIKTOKEN_PREFIX):], spec)
        return TiktokenTokenizer(spec)
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "tokenizer.json")):
            raise TokenizerLoadError(f"directory {spec!r} has no tokenizer.json; pass a SentencePiece "
                                     ".model, a tokenizer.json, 'tiktoken:PATH' or 'byte'")
        return HFTokenizer(spec)
    _require_file(spec, spec)
    if spec.endswith(".json"):
        return HFTokenizer(spec)
    with open(spec, "rb") as f:
        head = f.read(64)
    if _looks_like_tiktoken(head):
        return TiktokenTokenizer(TIKTOKEN_PREFIX + spec)
    return SentencePieceTokenizer(spec)


def _looks_like_tiktoken(head: bytes) -> bool:
    # A rank file starts "<base64> <int>\n"; a SentencePiece model is a binary protobuf.
    first = head.split(b"\n", 1)[0].split(b" ")
    return len(first) == 2 and first[1].isdigit() and re.fullmatch(rb"[A-Za-z0-9+/=]+", first[0]) is not None


def _require_file(path: str, spec: str) -> None:
    if not os.path.exists(path):
        raise TokenizerLoadError(
            f"tokenizer {spec!r} not found: {path!r} does not exist. Pass a SentencePiece .model, "
            "a tokenizer.json (or its directory), 'tiktoken:PATH' or 'byte'")
