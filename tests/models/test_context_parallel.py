"""The portable CP attention against full causal attention: outputs and q/k/v gradients.

Each CP rank holds chunks r and 2CP-1-r of the sequence; the module must produce exactly
the rows of full causal attention for those positions, and (through the all-gather's
reduce-scatter backward) the gradients of its own K/V rows summed over every query rank.
"""

from __future__ import annotations

import pytest

from models.context_parallel import causal_prefix_mask, load_balanced_chunks, natural_order
from tests.distributed import run_ranks


def test_chunk_bookkeeping():
    assert [load_balanced_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    # gathered [0, 7, 1, 6, 2, 5, 3, 4] -> where is chunk 0, 1, ...
    assert natural_order(4) == [0, 2, 4, 6, 7, 5, 3, 1]
    mask = causal_prefix_mask(1, 2, "cpu").tolist()
    assert mask == [[False, False, False, True], [False, False, False, False]]


def compare_with_full_attention(seq: int, heads: int, groups: int) -> dict:
    """On each rank: local CP attention vs the same rows of full attention (fwd + bwd)."""
    import torch

    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import get_batch_on_this_cp_rank

    from models.context_parallel import ContextParallelAttention
    from models.layout import ParallelLayout
    from pretrain.runtime import init_distributed, read_dist_env, shutdown

    cp = read_dist_env().world_size
    init_distributed(ParallelLayout(context_parallel=cp), seed=0)
    try:
        d, b = 8, 2
        gen = torch.Generator().manual_seed(7)
        q = torch.randn(seq, b, heads, d, generator=gen)
        k = torch.randn(seq, b, groups, d, generator=gen)
        v = torch.randn(seq, b, groups, d, generator=gen)
        upstream = torch.randn(seq, b, heads * d, generator=gen)
        ref_out, ref_grads = _full_attention(q, k, v, upstream, heads // groups)

        config = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                                   num_query_groups=groups, kv_channels=d, context_parallel_size=cp,
                                   attention_dropout=0.0)
        module = ContextParallelAttention(config, 1, AttnMaskType.causal, "self")

        def local(t):  # this rank's chunks, as the data path splits them (sequence is dim 1 there)
            return get_batch_on_this_cp_rank({"x": t.transpose(0, 1)}, is_hybrid_cp=False,
                                             cp_group=parallel_state.get_context_parallel_group(),
                                             )["x"].transpose(0, 1).contiguous()

        lq, lk, lv = (local(t).requires_grad_() for t in (q, k, v))
        out = module(lq, lk, lv, None)
        out.backward(local(upstream))
        errors = {"out": (out - local(ref_out)).abs().max().item()}
        for name, got, want in zip("qkv", (lq.grad, lk.grad, lv.grad), ref_grads, strict=True):
            errors[f"d{name}"] = (got - local(want)).abs().max().item()
        errors["scale"] = ref_out.abs().max().item()
        assert parallel_state.get_context_parallel_world_size() == cp
        return errors
    finally:
        shutdown()


def _full_attention(q, k, v, upstream, repeat):
    """Plain causal softmax attention on the whole sequence; returns output and q/k/v grads."""
    import math

    import torch

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    seq = q.shape[0]
    kk, vv = (t.repeat_interleave(repeat, dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vv).reshape(seq, q.shape[1], -1)
    out.backward(upstream)
    return out.detach(), (q.grad, k.grad, v.grad)


@pytest.mark.distributed
@pytest.mark.parametrize("cp, heads, groups", [(2, 4, 2), (4, 4, 1)])
def test_cp_attention_matches_full_attention(cp, heads, groups):
    for rank, errors in enumerate(run_ranks(cp, "tests.models.test_context_parallel:compare_with_full_attention",
                                            seq=8 * cp, heads=heads, groups=groups)):
        assert errors["scale"] > 0.1
        for name in ("out", "dq", "dk", "dv"):
            assert errors[name] < 1e-5, f"CP{cp} rank {rank}: {name} differs by {errors[name]}"
