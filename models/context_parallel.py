"""Causal core attention for context parallelism in the `portable` spec (CP > 1).

Megatron-Core's local `DotProductAttention` refuses CP > 1 (only TE's attention does CP).
This module takes the layout Megatron-Core's CP data path produces: the sequence is cut
into 2 x CP chunks and CP rank r holds chunks r and 2CP-1-r (`get_batch_on_this_cp_rank`;
RoPE is sliced the same way by `get_pos_emb_on_this_cp_rank`), so causal work is balanced.

Each rank all-gathers K and V of the whole sequence over the CP group with Megatron's
autograd collective (`gather_from_sequence_parallel_region`: all-gather forward,
reduce-scatter backward, so each rank's K/V gradient sums the contributions of every rank
that attended to its tokens), puts the chunks back in sequence order, and attends each of
its two query chunks to the key prefix it can see. Keys after a chunk's last position
are never computed, so rank work is c^2 (2CP+1) score entries for chunk length c; only
the diagonal block needs a mask. The backward is autograd's: no hand-written gradient.
With document masking (models.documents) an `attention_mask` [b, 1, s_local, s] marks the
keys of other documents, wherever they live; it is added to the causal part.

This is the "all-gather" flavour of CP (as TE's cp_comm_type=all_gather): simple and
exact, with activations of the full sequence's K/V per rank; the ring (p2p) flavour that
overlaps communication is TE's, in the `te` spec.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


def load_balanced_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two global chunk indices (of 2 x CP) held by a CP rank, in its local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def natural_order(cp_size: int) -> list[int]:
    """Positions, in the all-gathered chunk list, of global chunks 0 .. 2CP-1.

    The all-gather concatenates ranks in order, each contributing its two chunks, so the
    gathered list is [0, 2CP-1, 1, 2CP-2, ...]; this returns its inverse permutation.
    """
    gathered = [g for rank in range(cp_size) for g in load_balanced_chunks(cp_size, rank)]
    return [gathered.index(g) for g in range(2 * cp_size)]


def causal_prefix_mask(chunk: int, length: int, device) -> Tensor:
    """Mask (True = hidden) of query chunk `chunk` over the keys of chunks 0..chunk.

    Earlier chunks are fully visible; inside its own chunk a query sees keys up to itself.
    """
    earlier = torch.zeros(length, chunk * length, dtype=torch.bool, device=device)
    own = torch.ones(length, length, dtype=torch.bool, device=device).triu(diagonal=1)
    return torch.cat([earlier, own], dim=1)


class ContextParallelAttention(MegatronModule):
    """Drop-in `core_attention` for the local spec when context_parallel_size > 1.

    Same constructor and forward signature as Megatron-Core's `DotProductAttention`;
    inputs are [s_local, b, heads, head_dim] with s_local = 2 chunks of this CP rank.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"ContextParallelAttention supports causal masks only, got {attn_mask_type}")
        if config.apply_query_key_layer_scaling or config.softmax_type != "vanilla":
            raise ValueError("ContextParallelAttention supports plain softmax attention only "
                             "(no query-key layer scaling or softmax offsets)")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = pg_collection.cp
        tp_size = pg_collection.tp.size()
        self.heads = divide(config.num_attention_heads, tp_size)
        self.groups = divide(config.num_query_groups, tp_size)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("ContextParallelAttention computes the causal mask itself; attention "
                             "bias and packed sequences are not supported")
        cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
        local_len = query.shape[0]
        if local_len % 2:
            raise ValueError(f"local sequence length {local_len} must hold two equal CP chunks")
        chunk = local_len // 2
        if attention_mask is not None and attention_mask.shape[-2:] != (local_len, 2 * cp_size * chunk):
            raise ValueError(f"attention_mask must be [b, 1, local queries {local_len}, all keys "
                             f"{2 * cp_size * chunk}] (models.documents), got {tuple(attention_mask.shape)}")
        keys, values = self._gather_kv(key, value, cp_size, chunk)
        outputs = []
        for i, g in enumerate(load_balanced_chunks(cp_size, cp_rank)):
            q = query[i * chunk:(i + 1) * chunk]
            end = (g + 1) * chunk  # keys after this chunk are masked for every query in it
            mask = causal_prefix_mask(g, chunk, q.device)
            if attention_mask is not None:  # document masking: keys of other documents, any rank
                mask = mask | attention_mask[:, :, i * chunk:(i + 1) * chunk, :end]
            outputs.append(self._attend(q, keys[:end], values[:end], mask))
        context = torch.cat(outputs, dim=0)  # [s_local, b, heads, head_dim]
        return context.reshape(local_len, context.shape[1], self.heads * self.head_dim)

    def _gather_kv(self, key: Tensor, value: Tensor, cp_size: int, chunk: int) -> tuple[Tensor, Tensor]:
        """K and V of the whole sequence in natural order, GQA groups expanded to heads."""
        kv = torch.cat([key, value], dim=-1)  # one collective instead of two
        kv = gather_from_sequence_parallel_region(kv, tensor_parallel_output_grad=True, group=self.cp_group)
        kv = kv.view(2 * cp_size, chunk, *kv.shape[1:])
        order = torch.tensor(natural_order(cp_size), device=kv.device)
        kv = kv.index_select(0, order).flatten(0, 1)
        keys, values = kv.split([key.shape[-1], value.shape[-1]], dim=-1)
        if self.heads > self.groups:
            keys = keys.repeat_interleave(self.heads // self.groups, dim=2)
            values = values.repeat_interleave(self.heads // self.groups, dim=2)
        return keys, values

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        """softmax(q k^T * scale, masked) v for [s, b, heads, d] inputs; softmax in fp32."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        scores = scores.float().masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        if self.training and self.dropout_p > 0:
            # Same RNG rule as DotProductAttention: TP ranks hold different heads, so draw
            # from the model-parallel stream unless sequence parallel already splits tokens.
            if self.config.sequence_parallel:
                probs = torch.nn.functional.dropout(probs, self.dropout_p)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = torch.nn.functional.dropout(probs, self.dropout_p)
        return torch.matmul(probs, v).permute(2, 0, 1, 3)  # [s, b, heads, d]
