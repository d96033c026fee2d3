"""Batches for the schedules: datasets from `data_pipeline`, a deterministic DP sampler,
and per-chunk iterators that resume at a given number of consumed samples.

Every global step consumes samples [consumed, consumed + global_batch) in every layout;
DP rank r takes micro-batch slice r of each (micro_batch x DP) block, as Megatron-LM's
pretraining sampler does. So the set of samples in a step does not depend on DP, which
is what makes DP runs comparable with the single-rank run.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Iterator, Optional

import torch

from megatron.core import parallel_state

from pretrain.config import ExperimentConfig, demo_prefix, sample_counts


@dataclasses.dataclass
class Datasets:
    train: object
    valid: Optional[object]
    tokenizer: object
    heldout: Optional[object] = None  # schedule.final_eval_steps' validation samples


def heldout_samples(config: ExperimentConfig) -> int:
    """Samples of the final held-out evaluation (schedule.final_eval_steps batches)."""
    return config.schedule.final_eval_steps * config.schedule.global_batch_size


def document_masking(config: ExperimentConfig):
    """The data config's three Megatron switches as data_pipeline's `DocumentMasking`."""
    from data_pipeline.datasets import DocumentMasking

    data = config.data
    return DocumentMasking(reset_attention_mask=data.reset_attention_mask,
                           reset_position_ids=data.reset_position_ids, eod_mask_loss=data.eod_mask_loss)


def build_datasets(config: ExperimentConfig, world_size: int) -> Datasets:
    """Build train/valid datasets on every rank (cached index files are shared). The inputs
    were checked by pretrain.config.validate_data, before any process group."""
    from data_pipeline.datasets import build_gpt_datasets, ensure_demo_dataset
    from data_pipeline.tokenizers import load_tokenizer

    data, sched = config.data, config.schedule
    blend = [tuple(item) for item in data.blend] if data.blend else None
    tokenizer_spec = data.tokenizer
    cache_dir = data.cache_dir or f"{config.logging.run_dir}/data_cache"
    if data.demo:
        prefix, tokenizer_spec = ensure_demo_dataset(os.path.dirname(demo_prefix(config)))
        blend = [(1.0, prefix)]
    tokenizer = load_tokenizer(tokenizer_spec or "byte")
    common = dict(blend=blend, split=data.split, seq_length=sched.seq_length, seed=config.runtime.seed,
                  tokenizer=tokenizer, cache_dir=cache_dir, mock=data.mock, documents=document_masking(config))
    train, valid, _ = build_gpt_datasets(num_samples=sample_counts(config), **common)
    heldout = None
    if sched.final_eval_steps:
        # Its own build, asked for exactly its samples: Megatron's document and sample shuffles
        # depend on the number of epochs a request needs, so the periodic evaluations' dataset
        # (sized by train_steps / eval_interval) could order the documents differently from one
        # run to the next. This one depends only on the data, seed, seq_length and batch.
        heldout = build_gpt_datasets(num_samples=(0, heldout_samples(config), 0), **common)[1]
    return Datasets(train=train, valid=valid, tokenizer=tokenizer, heldout=heldout)


def _sample_indices(consumed: int, total: int, micro_batch: int, dp_size: int, dp_rank: int) -> Iterator[list[int]]:
    """Yield this DP rank's micro-batches of sample indices, starting after `consumed`."""
    block = micro_batch * dp_size
    start = consumed
    while start + block <= total:
        first = start + dp_rank * micro_batch
        yield list(range(first, first + micro_batch))
        start += block


def _collate(samples: list[dict], eod: Optional[int]) -> dict:
    """Stack the samples; with `eod` (reset_attention_mask), add each token's document
    index [b, s] int32: the model builds the attention it needs from it (data_pipeline's
    `document_ids`: O(s) per sample, where Megatron's dense mask is O(s^2)); and each label's
    (`label_document_ids`, the document of token i+1), which multi-token prediction needs."""
    from data_pipeline.datasets import document_ids

    keys = ("tokens", "labels", "loss_mask", "position_ids")
    batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in keys}
    if eod is not None:
        batch["document_ids"] = document_ids(batch["tokens"], eod)
        # The document of each label (token i+1): MTP's cross-document predictions are dropped with it
        # (models.documents.mtp_depth_loss_masks).
        batch["label_document_ids"] = batch["document_ids"] + (batch["tokens"] == eod).to(torch.int32)
    return batch


class BatchStream:
    """Iterator of collated micro-batches over a dataset for this DP rank; `eod` (the EOD id
    when attention is reset at document boundaries, else None) adds `document_ids`."""

    def __init__(self, dataset, *, consumed: int, total: int, micro_batch: int, eod: Optional[int] = None):
        dp_size = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        self._dataset = dataset
        self._eod = eod
        self._indices = _sample_indices(consumed, min(total, len(dataset)), micro_batch, dp_size, dp_rank)
        # Seconds spent producing batches since the last `take_fetch_time()`: data loading
        # happens inside the schedule's forward step, so the loop subtracts it from compute.
        self._fetch_time = 0.0
        # Document masking: each sample's share of dense causal attention work, since the
        # last `take_attention_fractions()` (models.flops.document_attention_fraction).
        self._fractions: list[float] = []

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        start = time.perf_counter()
        indices = next(self._indices)
        batch = _collate([self._dataset[i] for i in indices], self._eod)
        if "document_ids" in batch:
            self._fractions += _attention_fractions(batch["document_ids"])
        self._fetch_time += time.perf_counter() - start
        return batch

    def take_fetch_time(self) -> float:
        value, self._fetch_time = self._fetch_time, 0.0
        return value

    def take_attention_fractions(self) -> list[float]:
        value, self._fractions = self._fractions, []
        return value


def _attention_fractions(document_ids: torch.Tensor) -> list[float]:
    from models.flops import document_attention_fraction

    seq = document_ids.shape[-1]
    return [document_attention_fraction(torch.bincount(row).tolist(), seq) for row in document_ids]


def chunk_iterators(dataset, config: ExperimentConfig, consumed: int, total: int) -> list[Optional[BatchStream]]:
    """One stream per model chunk; chunks that neither embed nor compute the loss get None,
    unless documents reset attention or positions: every chunk's attention then needs the
    micro-batch's document ids and positions."""
    data = config.data
    every_chunk = data.reset_attention_mask or data.reset_position_ids
    # The EOD id the dataset was built with (Megatron's GPT and blended datasets keep their
    # GPTDatasetConfig, tokenizer included).
    eod = dataset.config.tokenizer.eod if data.reset_attention_mask else None
    streams = []
    for vp_stage in range(config.parallel.vpp):
        vp = vp_stage if config.parallel.virtual_pipeline else None
        needs = every_chunk or parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp) or \
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        streams.append(
            BatchStream(dataset, consumed=consumed, total=total, micro_batch=config.schedule.micro_batch_size,
                        eod=eod)
            if needs else None
        )
    return streams
