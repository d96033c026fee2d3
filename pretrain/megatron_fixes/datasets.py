"""Megatron-Core's GPT dataset: the cached loss mask of the first sample served.

What upstream does (megatron-core 0.16.1, `datasets/gpt_dataset.py`, `GPTDataset.__getitem__`):
when neither `reset_position_ids`, `reset_attention_mask` nor `eod_mask_loss` is set, the
attention mask, loss mask and position ids do not depend on the tokens, so the dataset computes
them for the first sample it serves and caches them. The first call caches the loss-mask
*tensor itself* (line ~263), then masks it in place where the label is the pad id
(`loss_mask[labels == self._pad_token_id] = 0.0`, line ~272); later calls clone the cache
(line ~268) before masking. So the zeros of the first sample served in a process stay in the
cache and mask the same positions of every later sample that process serves.

Why it matters here: which sample a process serves first depends on the layout. DP rank r
starts at sample r (micro-batch 1) or r x micro_batch, and a resumed run starts at its
consumed-samples count. Mock data (`MockGPTLowLevelDataset`: documents of tokens
1, 2, ... mod vocab_size) contains every id below the vocabulary size, the tokenizer's pad id
among them (the byte tokenizer's 258), so its samples have "padding" labels. Measured on
tiny-llama, mock data, global batch 8, seq 64, step 1: one rank 8.336089 / grad norm 1.86385;
DP2 micro-batch 1 8.336429 / 1.86929 (rank 1 served sample 1 first, whose label 59 is 258:
position 59 was also masked in samples 3, 5 and 7, 507 loss tokens instead of 510); DP4
8.336982 / 1.86816. Real data whose pad id never occurs and whose training samples are never
padded (Megatron drops the partial last one) is not affected, nor are runs with any of the
three document switches (nothing is cached then).

What we do instead: before upstream's `__getitem__` runs for the first time, fill the cache
from upstream's own `_get_ltor_masks_and_position_ids` at the configured sequence length (with
all three switches off, the only case that caches, its result does not depend on the tokens),
so every sample, the first included, takes upstream's clone-then-mask path. Upstream issues
NVIDIA/Megatron-LM#1269 and #1711 (closed) added the clone on the cached path only; the
first-call path is the subject of the open pull request NVIDIA/Megatron-LM#6981. Known for
0.19.2 (written for 0.16.1: 0.19 added `inter_document_masking` and returns one dict at the
end, and still caches the first call's tensor itself, then masks it in place); the guard pins
both functions, so a Megatron-Core that changed either stops start-up.
"""

from __future__ import annotations

import functools

from pretrain.megatron_fixes._guard import expect_sources

_MODULE = "megatron.core.datasets.gpt_dataset"
SOURCES = {
    f"{_MODULE}:GPTDataset.__getitem__": "fc9cde713ea87aed",
    # Called by the fix; its loss mask is all ones, its positions an arange, whatever the tokens,
    # when the three document switches are off.
    f"{_MODULE}:_get_ltor_masks_and_position_ids": "a110cd827539489b",
}


def fill_mask_cache(dataset) -> None:
    """Cache `dataset`'s token-independent masks and positions from its config, not from a
    sample (no-op when they are not cacheable or already cached)."""
    import torch

    from megatron.core.datasets import gpt_dataset

    if not dataset.masks_and_position_ids_are_cacheable or dataset.masks_and_position_ids_are_cached:
        return
    config = dataset.config
    tokens = torch.zeros(config.sequence_length, dtype=torch.long)
    attention_mask, loss_mask, position_ids = gpt_dataset._get_ltor_masks_and_position_ids(
        tokens, config.tokenizer.eod, config.reset_position_ids, config.reset_attention_mask,
        config.eod_mask_loss, config.create_attention_mask)
    dataset.cached_attention_mask = attention_mask
    dataset.cached_loss_mask = loss_mask
    dataset.cached_position_ids = position_ids
    dataset.masks_and_position_ids_are_cached = True


def _getitem(original):
    @functools.wraps(original)
    def __getitem__(self, idx):
        fill_mask_cache(self)
        return original(self, idx)

    __getitem__._fills_mask_cache = True
    return __getitem__


def apply() -> None:
    from megatron.core.datasets.gpt_dataset import GPTDataset

    expect_sources("datasets", SOURCES)
    if not getattr(GPTDataset.__getitem__, "_fills_mask_cache", False):
        GPTDataset.__getitem__ = _getitem(GPTDataset.__getitem__)
