"""Training datasets: weighted blends of indexed datasets through Megatron-Core's builders.

    from data_pipeline.datasets import build_gpt_datasets, ensure_demo_dataset
    from data_pipeline.tokenizers import load_tokenizer

    prefix, tokenizer_path = ensure_demo_dataset("runs/data")
    train, valid, test = build_gpt_datasets(
        blend=[(1.0, prefix)], split="98,2,0", seq_length=256, seed=1234,
        num_samples=(10_000, 200, 0), tokenizer=load_tokenizer(tokenizer_path),
        cache_dir="runs/data/index-cache")

`build_gpt_datasets` must be called on every rank once torch.distributed is
initialised: Megatron builds (and caches) the indices on rank 0, barriers, then
the other ranks load them from `cache_dir`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import math
import os

from data_pipeline.tokenizers import Tokenizer

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
DEMO_CORPUS = os.path.join(ASSETS, "kjv.jsonl.gz")
DEMO_TOKENIZER = os.path.join(ASSETS, "demo_sp.model")
DEMO_PREFIX_NAME = "kjv_demo_sp"


class DatasetConfigError(ValueError):
    """A blend/split/size that cannot be built; the message names the entry and the fix."""


def _import_megatron_datasets():
    from data_pipeline.indexed_writer import quiet_megatron_import

    with quiet_megatron_import():
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    return BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig, MockGPTDataset


SPLIT_NAMES = ("train", "validation", "test")


def parse_split(split: str) -> tuple[float, float, float]:
    """"969,30,1" -> the (train, validation, test) fractions. Up to three non-negative
    numbers separated by commas (missing parts are 0), the train part above 0. Stricter
    than Megatron's parser, which reads any digits in the string ("abc" -> an assertion
    at dataset build time, "-1,1,0" -> 1,1,0)."""
    parts = [p.strip() for p in str(split).split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(parts) <= 3 or len(values) != len(parts) or not all(
            math.isfinite(v) and v >= 0 for v in values):
        raise DatasetConfigError(f"split={split!r} is not up to three non-negative numbers separated by "
                                 "commas (train, validation, test), e.g. 969,30,1")
    values += [0.0] * (3 - len(values))
    if values[0] <= 0:
        raise DatasetConfigError(f"split={split!r} gives the train part 0; e.g. 969,30,1")
    total = sum(values)
    return tuple(v / total for v in values)


def check_blend(blend: list[tuple[float, str]], tokenizer: Tokenizer) -> None:
    """Every prefix exists and is intact, weights are positive, and each dataset fits the
    tokenizer."""
    import numpy as np

    from data_pipeline.indexed_writer import DatasetFileError, open_index
    from data_pipeline.output_paths import read_manifest

    if not blend:
        raise DatasetConfigError("blend is empty; give [(weight, prefix), ...] or use mock data")
    for entry in blend:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise DatasetConfigError(f"blend entry {entry!r} is not (weight, prefix)")
        weight, prefix = entry
        if not isinstance(weight, (int, float)) or not weight > 0 or not math.isfinite(weight):
            raise DatasetConfigError(f"blend weight {weight!r} for {prefix!r} must be a number > 0")
        try:
            stored = open_index(prefix).dtype
        except DatasetFileError as exc:
            raise DatasetConfigError(str(exc)) from None
        if tokenizer.vocab_size - 1 > np.iinfo(stored).max:
            raise DatasetConfigError(f"{prefix} stores {stored.__name__} tokens but the tokenizer "
                                     f"has {tokenizer.vocab_size} ids; re-run preprocess with it")
        manifest = read_manifest(prefix)
        made_with = (manifest or {}).get("request", {}).get("tokenizer", {}).get("sha256")
        if made_with and made_with != tokenizer.unique_identifiers["sha256"]:
            raise DatasetConfigError(
                f"{prefix} was tokenised with {manifest.get('tokenizer_spec')!r}, not "
                f"the training tokenizer {tokenizer.spec!r}; re-run preprocess or fix the config")


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not Linux: unknown, no bound
        return 1 << 62


def _source_sizes(blend, mock: bool, vocab_size: int) -> list[tuple[str, float, int, int]]:
    """(name, weight, documents, tokens) of every source the builder would index."""
    from data_pipeline.indexed_writer import open_index

    if mock:
        import types

        _import_megatron_datasets()  # the package import, without its TE/Apex warning
        from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

        low = MockGPTLowLevelDataset(types.SimpleNamespace(vocab_size=vocab_size, eod=0))
        return [("mock data", 1.0, len(low), int(low.sequence_lengths.sum()) + len(low))]
    sizes = []
    for weight, prefix in blend:
        index = open_index(prefix)
        sizes.append((prefix, float(weight), len(index.document_indices) - 1,
                      int(index.sequence_lengths.sum(dtype="int64"))))
    return sizes


def split_documents(split: str, documents: int) -> tuple[int, int, int]:
    """Documents of a dataset in its (train, validation, test) parts, as Megatron-Core's builder
    cuts them: cumulative fractions as book-ends, each rounded (Python's round) times the count."""
    fractions = parse_split(split)
    ends = [0.0]
    for f in fractions:
        ends.append(ends[-1] + f)
    return tuple(int(round(ends[i + 1] * documents)) - int(round(ends[i] * documents)) for i in range(3))


def check_split_documents(*, blend, mock: bool, split: str, vocab_size: int) -> None:
    """Refuse a split that leaves a part Megatron-Core builds (weight > 0) with no document of
    some source: its GPTDataset then counts epochs of zero tokens forever (`_get_num_epochs`,
    megatron-core 0.16.1), at 100% CPU, deaf to SIGTERM."""
    fractions = parse_split(split)
    for name, _, documents, _ in _source_sizes(blend, mock, vocab_size):
        parts = split_documents(split, documents)
        empty = [i for i in range(3) if fractions[i] > 0 and parts[i] == 0]
        if not empty:
            continue
        need = documents + 1
        while any(fractions[i] > 0 and not split_documents(split, need)[i] for i in range(3)):
            need += 1
        zeroed = [str(p).strip() for p in str(split).split(",")] + ["0"] * (3 - len(str(split).split(",")))
        for i in empty:
            zeroed[i] = "0"
        names = " and ".join(SPLIT_NAMES[i] for i in empty)
        raise DatasetConfigError(
            f"split={split} gives the {names} part 0 of the {documents} documents of {name} (Megatron-Core "
            f"would never finish building it); give that part weight 0 (e.g. split={','.join(zeroed)}) or use "
            f"at least {need} documents")


def check_sample_budget(*, blend, mock: bool, split: str, seq_length: int, num_samples: tuple[int, int, int],
                        vocab_size: int) -> None:
    """Refuse a request for far more samples than the data can give.

    Megatron-Core's GPTDataset repeats a source until it covers the samples asked of it:
    it counts the epochs one by one and builds, in memory, a document index of epochs x
    documents and sample/shuffle indices of ~24 bytes per sample. Asking 10^12 steps
    spins there for hours, then runs out of memory. Here the same sizes are computed
    directly (as the builder splits them: weights normalised, +0.5% margin) and refused
    when the indices alone would exceed this machine's memory.
    """
    check_split_documents(blend=blend, mock=mock, split=split, vocab_size=vocab_size)
    fractions = parse_split(split)
    sources = _source_sizes(blend, mock, vocab_size)
    total_weight = sum(w for _, w, _, _ in sources)
    memory = _memory_bytes()
    need, worst = 0, None
    for part, samples in enumerate(num_samples):
        if not samples or not fractions[part]:
            continue
        for name, weight, documents, tokens in sources:
            share = samples if len(sources) == 1 else math.ceil(samples * weight / total_weight * 1.005)
            split_docs = max(1, round(documents * fractions[part]))
            split_tokens = max(1, tokens * fractions[part])
            epochs = math.ceil((share * seq_length + 1) / split_tokens)
            bytes_ = 4 * epochs * split_docs + 24 * share
            need += bytes_
            if worst is None or bytes_ > worst[0]:
                worst = (bytes_, SPLIT_NAMES[part], share, name, int(split_tokens), epochs)
    if need > memory:
        bytes_, part, share, name, split_tokens, epochs = worst
        raise DatasetConfigError(
            f"{share:,} {part} samples of {seq_length} tokens from {name} ({split_tokens:,} tokens in its "
            f"{part} split) would repeat it {epochs:,} times, and Megatron's sample indices would need "
            f"{need / 2**30:,.1f} GiB, more than this machine's {memory / 2**30:,.1f} GiB of memory")


def one_epoch_samples(*, blend, split: str, seq_length: int, part: int) -> tuple[int, str, int]:
    """The most samples one split (`part`: 0 train, 1 validation, 2 test) of a blend gives
    before Megatron-Core's GPTDataset repeats its sequences (a second, reshuffled epoch), with
    the source that limits it and that source's tokens in the split: (samples, prefix, tokens).
    Exact per source: the split's sequences are the builder's book-ends over sequence_lengths,
    a sample takes seq_length tokens of the epoch plus one (the shifted label), and a blend
    asks each source for its weight's share plus the builder's 0.5% margin."""
    from data_pipeline.indexed_writer import open_index

    total_weight = sum(float(w) for w, _ in blend)
    best = None
    for weight, prefix in blend:
        index = open_index(prefix)  # kept while its lengths are read: they are a view of its mmap
        lengths = index.sequence_lengths
        counts = split_documents(split, len(lengths))
        start = sum(counts[:part])
        tokens = int(lengths[start:start + counts[part]].sum(dtype="int64"))
        fits = max(0, (tokens - 1) // seq_length)
        if len(blend) > 1:
            share = float(weight) / total_weight * 1.005
            fits = int(fits / share)
            while fits and math.ceil(fits * share) > max(0, (tokens - 1) // seq_length):
                fits -= 1
        if best is None or fits < best[0]:
            best = (fits, prefix, tokens)
    return best


@dataclasses.dataclass(frozen=True)
class DocumentMasking:
    """Megatron-LM's three switches for packed samples (see pretrain's DataConfig). A
    document ends with, and includes, the EOD token: the token after an EOD starts the next."""
    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    eod_mask_loss: bool = False

    @property
    def any(self) -> bool:
        return self.reset_attention_mask or self.reset_position_ids or self.eod_mask_loss


def document_ids(tokens, eod: int):
    """Per-token document index within each sample ([..., s] -> [..., s] int32): the number
    of EOD tokens strictly before the token. O(s), the whole description of the boundaries
    that `reset_attention_mask` needs (the model builds its mask from it), instead of
    Megatron's s x s `attention_mask` per sample (create_attention_mask, which we keep off)."""
    import torch

    is_eod = (tokens == eod).to(torch.int32)
    return (torch.cumsum(is_eod, dim=-1) - is_eod).to(torch.int32)


def count_eod(prefix: str, eod: int, max_tokens: int = 1 << 24) -> tuple[int, int]:
    """(EOD tokens, tokens scanned) in the first `max_tokens` tokens of an indexed dataset
    (a memory-mapped read of at most 32-64 MiB: cheap enough for every start-up)."""
    import numpy as np

    from data_pipeline.indexed_writer import get_bin_path, open_index

    dtype = open_index(prefix).dtype
    data = np.memmap(get_bin_path(prefix), dtype=dtype, mode="r")
    head = data[:max_tokens]
    return int(np.count_nonzero(head == eod)), int(head.size)


def build_gpt_datasets(*, blend: list[tuple[float, str]] | None, split: str, seq_length: int,
                       seed: int, num_samples: tuple[int, int, int], tokenizer: Tokenizer,
                       cache_dir: str | None, mock: bool = False,
                       documents: DocumentMasking = DocumentMasking()):
    """(train, valid, test) Megatron-Core GPT datasets (None for a split weighted 0).

    Items are dicts of torch tensors: tokens, labels, loss_mask, position_ids (restarting
    after each EOD with `documents.reset_position_ids`; loss_mask 0 on EOD inputs with
    `documents.eod_mask_loss`: Megatron's own `_get_ltor_masks_and_position_ids`). The
    attention mask is never built here (O(s^2) per sample): see `document_ids`.
    `blend` is [(weight, prefix), ...]; `split` like "98,2,0" splits every
    prefix's documents; `num_samples` are the samples each split must provide
    (Megatron repeats epochs to reach them); the shuffle is a function of `seed`.
    `cache_dir` holds Megatron's index cache (None: beside each dataset).
    """
    builder_cls, gpt_cls, config_cls, mock_cls = _import_megatron_datasets()
    if seq_length <= 0:
        raise DatasetConfigError(f"seq_length must be > 0, got {seq_length}")
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise DatasetConfigError(f"num_samples must be 3 counts >= 0 (train, valid, test), "
                                 f"got {num_samples!r}")
    if not mock:
        if blend is None:
            raise DatasetConfigError("blend is None: give [(weight, prefix), ...] or mock=True")
        check_blend(blend, tokenizer)
    check_sample_budget(blend=blend, mock=mock, split=split, seq_length=seq_length, num_samples=num_samples,
                        vocab_size=tokenizer.vocab_size)
    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
    if mock:
        megatron_blend = None
    elif len(blend) == 1:  # weights None: Megatron skips a pointless one-source BlendedDataset
        megatron_blend = ([blend[0][1]], None)
    else:
        megatron_blend = ([p for _, p in blend], [float(w) for w, _ in blend])
    config = config_cls(
        random_seed=seed,
        sequence_length=seq_length,
        blend=megatron_blend,
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=documents.reset_position_ids,
        # Megatron only uses this to build the dense mask, which create_attention_mask=False
        # skips; the batch carries `document_ids` instead (pretrain.data).
        reset_attention_mask=documents.reset_attention_mask,
        eod_mask_loss=documents.eod_mask_loss,
        create_attention_mask=False,  # the model builds its mask itself
    )
    builder = builder_cls(mock_cls if mock else gpt_cls, list(num_samples), lambda: True, config)
    with _rank_zero_without_process_group():
        datasets = builder.build()
    return tuple(datasets)


@contextlib.contextmanager
def _rank_zero_without_process_group():
    """Megatron-Core's dataset builders assume torch.distributed is initialised (0.16.1's
    BlendedDataset._build_indices calls torch.distributed.get_rank() unguarded, line ~153).
    A plain single process is rank 0 of a world of one: while building, give it exactly
    that, a one-rank gloo group on an in-memory store (no port, no patch). With a process
    group already up, nothing changes."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def ensure_demo_dataset(out_dir: str) -> tuple[str, str]:
    """Tokenise the shipped KJV corpus with the shipped SentencePiece model into out_dir.

    Idempotent and safe to call from several processes at once: the first one
    writes (atomically), the others wait and find it up to date. Tokenises in
    the calling process (workers=0, ~2 s): training ranks should not fork.
    Returns (prefix, tokenizer_path).
    """
    from data_pipeline.preprocess import preprocess

    os.makedirs(out_dir, exist_ok=True)
    prefix = os.path.join(out_dir, DEMO_PREFIX_NAME)
    with open(os.path.join(out_dir, ".demo.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocking: later callers wait, then skip
        preprocess([DEMO_CORPUS], tokenizer=DEMO_TOKENIZER, output_prefix=prefix,
                   append_eod=True, workers=0, overwrite=True)
    return prefix, DEMO_TOKENIZER


def ensure_verses_dataset(out_dir: str, chapters: int = 100) -> tuple[str, str]:
    """The shipped KJV corpus with one document per verse (~37 tokens; the first `chapters`
    chapters), tokenised with the demo SentencePiece model, EOD appended: real text whose
    64-token samples hold 1-3 document boundaries, for document masking's tests and
    benchmark. Made once in out_dir (a lock: several processes may ask at once).
    Returns (prefix, tokenizer_path)."""
    import gzip
    import json

    from data_pipeline.output_paths import output_exists
    from data_pipeline.preprocess import preprocess

    os.makedirs(out_dir, exist_ok=True)
    prefix = os.path.join(out_dir, "kjv_verses")
    with open(os.path.join(out_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not output_exists(prefix):
            with gzip.open(DEMO_CORPUS, "rt") as f:
                texts = [json.loads(line)["text"] for line in f][:chapters]
            # A chapter is "Book N" then one numbered verse per line.
            verses = [line.strip() for text in texts for line in text.splitlines()[1:] if line.strip()]
            jsonl = os.path.join(out_dir, "verses.jsonl")
            with open(jsonl, "w") as out:
                out.writelines(json.dumps({"text": verse}) + "\n" for verse in verses)
            preprocess([jsonl], tokenizer=DEMO_TOKENIZER, output_prefix=prefix, append_eod=True, workers=0)
    return prefix, DEMO_TOKENIZER
