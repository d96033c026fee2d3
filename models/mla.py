"""Multi-latent attention (DeepSeek-V2/V3) in the `portable` spec: Megatron-Core's own
`MLASelfAttention` with a core attention and latent norms that run on CPU.

Megatron-Core 0.19.2's local spec builds MLA with the local `DotProductAttention`, which fails
at construction (`TypeError: ... unexpected keyword argument 'k_channels'`): MLA gives its core
attention separate query/key and value head sizes (q/k: qk_head_dim + qk_pos_emb_head_dim,
v: v_head_dim), which only Transformer Engine's attention accepts. `MLACoreAttention` is
`DotProductAttention` with those two sizes: the scores Q K^T already work for any q/k head
size, the softmax scale is the one MLA computes (1/sqrt(q/k head dim), times mscale^2 with
YaRN), and only the output width changes (heads x v_head_dim instead of heads x kv_channels).
It also completes one gradient upstream's local path leaves partial at TP > 1 (below).
Masks are DotProductAttention's: causal, or the [b, 1, s, s] document mask of
models.documents. Packed (THD) sequences and context parallelism stay TE's (the `te` spec);
pretrain.config.validation refuses CP > 1 with MLA on the portable spec.

The shared RoPE key at TP > 1. MLA has one RoPE key (qk_pos_emb_head_dim channels) for all
heads. With the local spec's column-parallel kv down projection, MLASelfAttention all-gathers
the projection's output (`gather_from_tensor_model_parallel_region`), so every TP rank holds
the whole RoPE key and appends it to each of its own heads' keys. Its gradient on a rank is
then the sum over that rank's heads only, and the gather's backward (a split of the last
dimension) assumes a gradient already equal on every rank: the other ranks' heads' share is
lost. Measured on tiny-deepseek at TP2 + SP: the step-1 grad norm 1.7e-5 off one rank's,
losses 3e-4 (relative) apart at step 4. `MLACoreAttention` sums the gradient of the keys' RoPE
channels over TP before it reaches the expand (an autograd identity forward), which makes it
the whole-model gradient on every rank, as the split expects. (Megatron-Core's `te` spec
replicates the down projections instead (TELinear, duplicated): a path this does not touch.)

`LatentNorm`: the q and kv latent norms (DeepSeek's q_a_layernorm / kv_a_layernorm). The local
spec's down projections are column-parallel and gather their output, so without sequence
parallelism every TP rank normalises the same full latent and already holds the whole weight
gradient. Megatron-Core's finalize_model_grads (0.19.2, `_allreduce_non_tensor_model_parallel_grads`)
sums the gradient of every parameter named `*q_layernorm*` over TP when `qk_layernorm` is on
(right for per-head q/k norms, whose TP ranks see different heads), which would double MLA's
latent q norm at TP > 1. Marking the weights `average_gradients_across_tp_domain` (checked
first there; upstream's DSA indexer does the same) averages identical gradients instead: a
no-op. With sequence parallelism each rank normalises its own tokens, so the weights carry
the `sequence_parallel` mark (PortableNorm) and are summed, as every SP norm.

RoPE at per-token positions (data.reset_position_ids). Megatron-Core's MLASelfAttention
(0.19.2) builds its RoPE table for positions 0..s-1 inside `get_query_key_value_tensors`
(`self.rotary_pos_emb(rotary_seq_len)`), takes no position ids (TransformerLayer passes none)
and asserts that no `rotary_pos_emb` is passed in; so packed documents never restarted MLA's
RoPE. `PositionedMLASelfAttention` accepts the `rotary_pos_emb` slot that TransformerLayer
hands every attention: when models.documents.DocumentGPTModel puts there the table at the
batch's position ids ([s, b, 1, qk_pos_emb_head_dim], built by `mla_rotary` below with
upstream's own `get_emb`), the layer's RoPE module (upstream's, wrapped) returns that table
instead of 0..s-1 for this call, with YaRN also upstream's cos/sin factor, and upstream applies
them to q and to the shared RoPE key unchanged (its unfused `apply_rotary_pos_emb` broadcasts
[s, b, 1, d] over the heads). Without a table (every run without reset_position_ids) the slot
is None and the forward is upstream's, bit for bit. A tensor in the slot (not a flag on the
module) survives activation recompute, which re-runs the layer with its arguments. Plain RoPE
and YaRN, CP 1, unfused RoPE; a guard fails at construction if upstream's MLA RoPE is no
longer the one `mla_rotary` builds.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from models.portable import PortableNorm


class _SumRopeKeyGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces (sums) the last `rope_dim` channels of the key
    gradient over the TP group (see the module docstring)."""

    @staticmethod
    def forward(ctx, key, rope_dim: int, group):
        ctx.rope_dim, ctx.group = rope_dim, group
        return key

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        rope = grad[..., -ctx.rope_dim:].contiguous()
        torch.distributed.all_reduce(rope, group=ctx.group)
        grad[..., -ctx.rope_dim:] = rope
        return grad, None, None


class MLACoreAttention(DotProductAttention):
    """DotProductAttention with MLA's head sizes: q/k `k_channels`, v `v_channels`."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        attention_dropout: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        # Megatron-Core's Attention base class first builds a core attention without MLA's sizes,
        # then MultiLatentAttention replaces it by one with k/v_channels and its softmax_scale:
        # the first falls back to DotProductAttention's sizes and is discarded.
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if k_channels is None or v_channels is None:
            return
        heads = self.num_attention_heads_per_partition
        self.hidden_size_per_attention_head = k_channels
        self.hidden_size_per_attention_head_v = v_channels
        # The parent reshapes its output [sq, b, heads, v] to this width.
        self.hidden_size_per_partition = heads * v_channels
        # MLA's key and value have one head per query head (no GQA).
        self.num_query_groups_per_partition = heads
        self.rope_dim = config.qk_pos_emb_head_dim

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if self.tp_group.size() > 1 and key.requires_grad:
            key = _SumRopeKeyGrad.apply(key, self.rope_dim, self.tp_group)
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias, packed_seq_params=packed_seq_params)


class LatentNorm(PortableNorm):
    """PortableNorm for MLA's q/kv latents; see the module docstring for the TP gradient rule."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__(config, hidden_size, eps, **kwargs)
        if not config.sequence_parallel:
            for p in self.parameters():
                p.average_gradients_across_tp_domain = True


def mla_rotary(config: TransformerConfig) -> RotaryEmbedding:
    """The RoPE module MLASelfAttention builds for its rope_type (0.19.2's arguments): its
    `get_emb` gives the angles (and YaRN's cos/sin factor) that `rope_at_positions` gathers."""
    if config.rope_type == "yarn":
        return YarnRotaryEmbedding(
            config.qk_pos_emb_head_dim, rotary_base=config.rotary_base, scaling_factor=config.rotary_scaling_factor,
            original_max_position_embeddings=config.original_max_position_embeddings, beta_fast=config.beta_fast,
            beta_slow=config.beta_slow, mscale=config.mscale, mscale_all_dim=config.mscale_all_dim)
    return RotaryEmbedding(config.qk_pos_emb_head_dim, rotary_percent=config.rotary_percent,
                           rotary_base=config.rotary_base)


def _yarn_factor(rotary: YarnRotaryEmbedding) -> float:
    """YaRN's cos/sin factor, the second item of upstream's forward (constant in the length)."""
    return rotary(1)[1]


class _GivenTableRotary(torch.nn.Module):
    """Upstream's MLA RoPE module (`inner`, plain or YaRN), returning `table` (RoPE at per-token
    positions) instead of its 0..s-1 table while one is set; with YaRN, with upstream's own
    cos/sin factor, as its forward returns them."""

    table: Optional[torch.Tensor] = None

    def __init__(self, inner: RotaryEmbedding):
        super().__init__()
        self.inner = inner  # no parameters, and YaRN's cos/sin caches are not persistent: same checkpoints

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def get_cached_cos_sin(self, *args, **kwargs):
        if self.table is not None:  # the fused path reads upstream's 0..s-1 cache: wrong positions
            raise RuntimeError("reset_position_ids with MLA's fused YaRN RoPE is not supported; set "
                               "runtime.fused_rope=false")
        return self.inner.get_cached_cos_sin(*args, **kwargs)

    def forward(self, max_seq_len: int, *args, **kwargs):
        if self.table is None:
            return self.inner(max_seq_len, *args, **kwargs)
        if isinstance(self.inner, YarnRotaryEmbedding):
            return self.table, _yarn_factor(self.inner)
        return self.table


class PositionedMLASelfAttention(MLASelfAttention):
    """MLASelfAttention whose RoPE follows a given [s, b, 1, d] table (see the module docstring)."""

    def __init__(self, config: TransformerConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        upstream, ours = self.rotary_pos_emb, mla_rotary(config)
        expected = YarnRotaryEmbedding if config.rope_type == "yarn" else RotaryEmbedding
        same = type(upstream) is expected and all(
            torch.equal(getattr(upstream, name).cpu(), getattr(ours, name).cpu())
            for name in (("inv_freq_extra", "inv_freq_inter") if expected is YarnRotaryEmbedding else ("inv_freq",)))
        if not same or (expected is YarnRotaryEmbedding and _yarn_factor(upstream) != _yarn_factor(ours)):
            raise RuntimeError(
                "models/mla.py: MLASelfAttention's RoPE is no longer the module that models.mla.mla_rotary "
                f"builds (got {type(upstream).__name__}, rope_type={config.rope_type}); PositionedMLASelfAttention "
                "was written for megatron-core 0.19.2: re-check it against the new upstream")
        self.rotary_pos_emb = _GivenTableRotary(upstream)

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        if rotary_pos_emb is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        self.rotary_pos_emb.table = rotary_pos_emb
        try:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        finally:
            self.rotary_pos_emb.table = None


def mla_self_attention(local_attention: ModuleSpec) -> ModuleSpec:
    """The local spec's MLA self-attention with our core attention and latent norms, taking
    RoPE at per-token positions when given (PositionedMLASelfAttention)."""
    if local_attention.module is not MLASelfAttention:
        raise RuntimeError(f"models/mla.py: the local spec's MLA attention is {local_attention.module.__name__}, "
                           "not MLASelfAttention (megatron-core 0.19.2); re-check PositionedMLASelfAttention")
    return dataclasses.replace(local_attention, module=PositionedMLASelfAttention, submodules=dataclasses.replace(
        local_attention.submodules, core_attention=MLACoreAttention,
        q_layernorm=LatentNorm, kv_layernorm=LatentNorm,
    ))

