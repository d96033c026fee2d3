"""Uneven pipeline stages: our split (models.layout.pipeline_split, used before any process
group) against the layers Megatron-Core itself builds on each stage."""

from __future__ import annotations

import itertools

import pytest
import torch

from models.layout import LayoutError, ParallelLayout, pipeline_split

# num_layers, PP, VPP, first, last, embedding, loss
CASES = [  # first / last stage counts
    (n, pp, vpp, first, last, False, False)
    for n in (6, 12) for pp in (2, 3, 4) for vpp in (None, 2)
    for first, last in ((2, None), (None, 2), (4, 2), (3, None), (None, 4))
] + [  # the embedding and / or the loss counted as layers
    (n, pp, vpp, None, None, emb, loss)
    for n in (2, 6, 10, 14) for pp in (2, 3, 4) for vpp in (None, 2)
    for emb, loss in ((True, False), (False, True), (True, True))
] + [(12, 2, None, 2, None, True, False), (12, 2, None, None, 2, False, True)]  # the two kinds mixed


def _megatron_split(n, pp, vpp, first, last, emb, loss) -> list[list[int]] | None:
    """What Megatron-Core builds, or None where its config or its build refuses the split."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        config = TransformerConfig(
            num_layers=n, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
            virtual_pipeline_model_parallel_size=vpp, num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last, account_for_embedding_in_pipeline_split=emb,
            account_for_loss_in_pipeline_split=loss, cuda_graph_modules=[])
        return [[get_num_layers_to_build(config, vp_stage=v if vpp else None, pp_rank=r) for v in range(vpp or 1)]
                for r in range(pp)]
    except (ValueError, AssertionError):
        return None


def test_split_is_megatron_cores():
    for case in CASES:
        _check(case)


def _check(case) -> None:
    n, pp, vpp, first, last, emb, loss = case
    layout = ParallelLayout(pipeline_parallel=pp, virtual_pipeline=vpp, num_layers_in_first_pipeline_stage=first,
                            num_layers_in_last_pipeline_stage=last, account_for_embedding_in_pipeline_split=emb,
                            account_for_loss_in_pipeline_split=loss)
    theirs = _megatron_split(*case)
    try:
        ours = pipeline_split(n, layout)
    except LayoutError as error:
        # Refused where Megatron-Core refuses, and where it would build a chunk with no layer
        # (not run here) or a stage with a negative count.
        assert theirs is None or min(min(stage) for stage in theirs) < 1, (case, theirs, str(error))
        return
    assert ours == theirs, case
    assert sum(map(sum, ours)) == n


def test_the_split_refusals_name_the_fix():
    with pytest.raises(LayoutError, match=r"cannot be split evenly over PP\(3\).*or split unevenly"):
        pipeline_split(4, ParallelLayout(pipeline_parallel=3))
    with pytest.raises(LayoutError, match="need pipeline_parallel > 1"):
        pipeline_split(4, ParallelLayout(num_layers_in_first_pipeline_stage=1))
    with pytest.raises(LayoutError, match="do not mix"):
        pipeline_split(4, ParallelLayout(pipeline_parallel=2, num_layers_in_first_pipeline_stage=1,
                                         account_for_loss_in_pipeline_split=True))
    with pytest.raises(LayoutError, match="leave 0 of num_layers=4 for the 1 other stage"):
        pipeline_split(4, ParallelLayout(pipeline_parallel=2, num_layers_in_first_pipeline_stage=4))
    with pytest.raises(LayoutError, match="without a transformer layer"):
        pipeline_split(2, ParallelLayout(pipeline_parallel=4, account_for_embedding_in_pipeline_split=True,
                                         account_for_loss_in_pipeline_split=True))
    # Llama-3.1 405B at Megatron-Bridge's H100 layout: 126 + 2 = 128 = PP8 x VPP8 x 2.
    split = pipeline_split(126, ParallelLayout(pipeline_parallel=8, virtual_pipeline=8,
                                               account_for_embedding_in_pipeline_split=True,
                                               account_for_loss_in_pipeline_split=True))
    assert split[0][0] == 1 and split[-1][-1] == 1 and split[3] == [2] * 8 and sum(map(sum, split)) == 126
