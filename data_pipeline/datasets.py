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
import fcntl
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


def check_blend(blend: list[tuple[float, str]], tokenizer: Tokenizer) -> None:
    """Every prefix exists, weights are positive, and each dataset fits the tokenizer."""
    import numpy as np

    from data_pipeline.indexed_writer import read_manifest
    from megatron.core.datasets.indexed_dataset import IndexedDataset, _IndexReader

    if not blend:
        raise DatasetConfigError("blend is empty; give [(weight, prefix), ...] or use mock data")
    for entry in blend:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise DatasetConfigError(f"blend entry {entry!r} is not (weight, prefix)")
        weight, prefix = entry
        if not isinstance(weight, (int, float)) or weight <= 0:
            raise DatasetConfigError(f"blend weight {weight!r} for {prefix!r} must be a number > 0")
        if not IndexedDataset.exists(prefix):
            raise DatasetConfigError(f"no dataset at prefix {prefix!r} ({prefix}.bin/.idx not "
                                     "found); create it with python -m data_pipeline.preprocess")
        stored = _IndexReader(prefix + ".idx", multimodal=False).dtype
        if tokenizer.vocab_size - 1 > np.iinfo(stored).max:
            raise DatasetConfigError(f"{prefix} stores {stored.__name__} tokens but the tokenizer "
                                     f"has {tokenizer.vocab_size} ids; re-run preprocess with it")
        manifest = read_manifest(prefix)
        made_with = (manifest or {}).get("request", {}).get("tokenizer", {}).get("sha256")
        if made_with and made_with != tokenizer.unique_identifiers["sha256"]:
            raise DatasetConfigError(
                f"{prefix} was tokenised with {manifest.get('tokenizer_spec')!r}, not "
                f"the training tokenizer {tokenizer.spec!r}; re-run preprocess or fix the config")


def build_gpt_datasets(*, blend: list[tuple[float, str]] | None, split: str, seq_length: int,
                       seed: int, num_samples: tuple[int, int, int], tokenizer: Tokenizer,
                       cache_dir: str | None, mock: bool = False):
    """(train, valid, test) Megatron-Core GPT datasets (None for a split weighted 0).

    Items are dicts of torch tensors: tokens, labels, loss_mask, position_ids.
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
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # the model builds its causal mask itself
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
