"""Document-masked packed samples: attention within each document, RoPE restarting at each.

    from models.documents import DocumentGPTModel   # built by models.build.build_model_chunks
    loss = chunk(tokens, position_ids, None, labels=labels, document_ids=document_ids)

Pretraining packs documents end to end into fixed-length samples. With Megatron-LM's
`reset_attention_mask` a token attends only to earlier tokens of its own document; with
`reset_position_ids` positions restart at 0 after each EOD. The data side carries the
boundaries cheaply: `position_ids` (restarting, from Megatron's GPTDataset) and
`document_ids` [b, s] (data_pipeline.datasets.document_ids: the number of EODs before each
token). Megatron's dataset could instead ship an s x s mask per sample (4096^2 bytes as
bool, built through an fp32 tril of 64 MiB: docs/benchmarks.md, "Document masking on CPU", has the numbers);
we keep that off and build what the attention needs here, once per forward of a chunk:

- `portable` spec, CP 1: a [b, 1, s, s] bool mask (True = hidden: other document or a later
  token) for Megatron-Core's local DotProductAttention, shared by every layer of the chunk.
- `portable` spec, CP > 1: each rank holds two of 2 x CP sequence chunks; the key side of
  its attention is the whole sequence (models.context_parallel all-gathers K/V), so the
  document ids are all-gathered over the CP group too (an int32 [b, s], no gradient) and
  the mask is [b, 1, s_local, s] (queries here, keys everywhere); ContextParallelAttention
  adds its causal part.
- `te` spec: no mask at all. The micro-batch becomes one packed (THD) sequence of b x s
  tokens with `cu_seqlens` at every document and sample start, passed through
  Megatron-Core's `PackedSeqParams`, so Transformer Engine's fused attention runs each
  document as its own causal sequence, and RoPE restarts at each one (Megatron applies
  RoPE per packed sequence). So `te` resets attention and positions together.

RoPE and `position_ids` (the one place we change it): Megatron-Core's GPTModel (0.16.1-0.19.2)
ignores `position_ids` for RoPE (`_preprocess` builds the table for 0..s-1 and slices it
for CP; position_ids reach only learned absolute embeddings). `DocumentGPTModel._preprocess`
with `reset_position_ids` replaces that table by upstream's own table indexed with the
batch's position ids ([s, b, 1, d]; under CP the ids are already this rank's chunks, as
`get_batch_on_this_cp_rank` slices them). Learned absolute embeddings already use them.
Multi-latent attention: upstream builds no table in GPTModel (each MLA layer makes its own for
0..s-1), so the slot carries a table at MLA's RoPE head size to models.mla's
PositionedMLASelfAttention (portable spec).

Multi-token prediction (mtp_num_layers = k >= 1): MTP depth d's prediction at position i
joins token i's state with the embeddings of tokens i+1..i+d and predicts token i+d+1, across
document boundaries as Megatron-Core shifts the whole sample. `mtp_depth_loss_masks` gives
each depth its own loss mask from `label_document_ids` (pretrain.data's collate): depth d drops,
per document, the predictions at its last d+1 tokens (the target lies in the next document).
Megatron-Core rolls one mask for every depth, which cannot express two depths' masks, so the
masks reach its MTP loss through pretrain/megatron_fixes/mtp.py. Every MTP layer's attention
gets the same document mask and RoPE table as the decoder's (MultiTokenPredictionBlock hands
each depth the decoder's attention_mask and rotary_pos_emb; position i keeps token i's position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams

from models.context_parallel import natural_order
from models.mla import mla_rotary


def rope_at_positions(rotary: torch.nn.Module, position_ids: Tensor) -> Tensor:
    """RoPE angles for explicit positions: [b, s] ids -> [s, b, 1, dim].

    Upstream's own table (`RotaryEmbedding.get_emb`: interpolation, interleaving and the
    Llama-3 scaled `inv_freq` included) for 0..max(position), gathered per token; the
    unfused `apply_rotary_pos_emb` broadcasts [s, b, 1, d] over the heads."""
    table = rotary.get_emb(int(position_ids.max()) + 1)  # [P, 1, 1, d]
    if isinstance(table, tuple):  # YaRN: (angles, cos/sin factor); MLA's own RoPE module applies the factor
        table = table[0]
    return table[:, 0][position_ids.t().to(table.device)]  # [s, b, 1, d]


def local_document_mask(document_ids: Tensor) -> Tensor:
    """[b, s] document ids -> [b, 1, s, s] bool, True where a query must not see a key
    (another document, or a later token): the mask Megatron's local attention applies."""
    s = document_ids.shape[-1]
    later = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).triu(diagonal=1)
    other = document_ids[:, None, :, None] != document_ids[:, None, None, :]
    return other | later


def gathered_document_ids(document_ids: Tensor, cp_group) -> Tensor:
    """This CP rank's [b, s_local] document ids -> the whole sequence's [b, s] in natural
    order (the ranks' two chunks each, put back as models.context_parallel does for K/V)."""
    cp = cp_group.size()
    parts = [torch.empty_like(document_ids) for _ in range(cp)]
    dist.all_gather(parts, document_ids.contiguous(), group=cp_group)
    b, local = document_ids.shape
    chunks = torch.stack(parts, dim=1).view(b, 2 * cp, local // 2)  # gathered chunk order
    order = torch.tensor(natural_order(cp), device=document_ids.device)
    return chunks.index_select(1, order).reshape(b, cp * local)


def cross_rank_document_mask(document_ids: Tensor, cp_group) -> Tensor:
    """CP > 1: [b, 1, s_local, s] bool, True where a local query and a key of the whole
    sequence are in different documents (causality is ContextParallelAttention's part)."""
    keys = gathered_document_ids(document_ids, cp_group)
    return document_ids[:, None, :, None] != keys[:, None, None, :]


def packed_sequence_params(document_ids: Tensor) -> PackedSeqParams:
    """THD parameters for a [b, s] micro-batch flattened to one sequence of b x s tokens:
    a sequence starts at every sample start and wherever the document id changes."""
    b, s = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    offsets = torch.nonzero(starts.flatten()).flatten()
    total = torch.tensor([b * s], device=offsets.device)
    cu_seqlens = torch.cat([offsets, total]).to(torch.int32)
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max_len, max_seqlen_kv=max_len)


@dataclass(frozen=True)
class MTPDepthMasks:
    """The `loss_mask` DocumentGPTModel hands GPTModel for document-masked MTP: one mask per depth,
    read by pretrain/megatron_fixes/mtp.py (upstream's process_mtp_loss takes one mask and would
    fail on this object, not mask wrongly)."""

    masks: Tensor  # [depths, b, s] float: masks[d - 1][:, i] counts depth d's prediction at position i
    num_tokens: Tensor  # the micro-batch's token count, MTP's per-token weight numerator (upstream: mask sum)


def mtp_depth_loss_masks(document_ids: Tensor, label_document_ids: Tensor, depths: int,
                         loss_mask: Optional[Tensor] = None) -> MTPDepthMasks:
    """Per-depth MTP loss masks that count only predictions inside one document.

    Depth d (1-based) at position i predicts token i+d+1 = labels[i+d] (Megatron-Core rolls the
    labels left once per depth). It counts when that token lies in the document of token i:
    document_ids[i] == label_document_ids[i+d] (the document of labels[j], i.e. of token j+1, is
    label_document_ids[j]; documents only grow along a sample, so the tokens between lie in it
    too), times the given `loss_mask` of that label (loss_mask[i+d], as upstream's roll applies
    it). Positions i >= s-d have no label and count 0 (upstream's roll fills them with 0). So each
    document loses the predictions at its last d+1 tokens at depth d. Depth 1 is the rolled
    single mask used for mtp_num_layers=1 before (bit for bit).

    `num_tokens`: b x s without `loss_mask`, else its sum: with per-token loss upstream weighs
    each depth by the unrolled mask's sum over the depth's count, the micro-batch's token count
    (the single mask before kept that sum at b x s through its first column; with a given
    loss_mask it was that mask times the document mask, summed). The masks reach only MTP's loss:
    GPTModel's main loss ignores loss_mask, and training passes none (pretrain.step masks the main
    loss itself)."""
    b, s = document_ids.shape
    masks = torch.zeros((depths, b, s), dtype=torch.float32, device=document_ids.device)
    for depth in range(1, depths + 1):
        keep = (document_ids[:, :s - depth] == label_document_ids[:, depth:]).float()
        if loss_mask is not None:
            keep = keep * loss_mask[:, depth:]
        masks[depth - 1, :, :s - depth] = keep
    counted = torch.ones_like(masks[0]) if loss_mask is None else loss_mask.float()
    return MTPDepthMasks(masks=masks, num_tokens=counted.sum())


class DocumentGPTModel(GPTModel):
    """Megatron-Core's GPTModel with document masking (see the module docstring).

    `reset_position_ids`: RoPE at the batch's position ids. `packed`: the `te` spec's THD
    path (`document_ids` become cu_seqlens); otherwise `document_ids` become a bool mask for
    the portable spec's attention. Without `document_ids` and with neither flag it is
    GPTModel, bit for bit (same modules, same parameter names, same checkpoints).
    """

    def __init__(self, *args, reset_position_ids: bool = False, packed: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.reset_position_ids = reset_position_ids
        self.packed = packed
        if reset_position_ids and self.config.multi_latent_attention and not packed:
            # No parameters or buffers (inv_freq is a plain attribute): checkpoints are unchanged.
            self.mla_rotary_pos_emb = mla_rotary(self.config)

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Optional[Tensor],
                *args, document_ids: Optional[Tensor] = None, label_document_ids: Optional[Tensor] = None,
                **kwargs) -> Tensor:
        if document_ids is None:
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        if attention_mask is not None or args or kwargs.get("packed_seq_params") is not None:
            raise ValueError("document_ids replace attention_mask and packed_seq_params; pass them by "
                             "keyword (labels=...) and not together")
        if self.config.mtp_num_layers:
            if self.packed or label_document_ids is None:
                raise ValueError("document masking with MTP needs the portable spec and label_document_ids "
                                 "(pretrain.data's collate makes them)")
            _check_depth_masks_taken()
            kwargs["loss_mask"] = mtp_depth_loss_masks(document_ids, label_document_ids, self.config.mtp_num_layers,
                                                       kwargs.get("loss_mask"))
        if self.packed:
            return self._packed_forward(input_ids, position_ids, document_ids, **kwargs)
        cp_group = parallel_state.get_context_parallel_group() if self.config.context_parallel_size > 1 else None
        mask = (local_document_mask(document_ids) if cp_group is None
                else cross_rank_document_mask(document_ids, cp_group))
        return super().forward(input_ids, position_ids, mask, **kwargs)

    def _packed_forward(self, input_ids: Tensor, position_ids: Tensor, document_ids: Tensor, *,
                        labels: Optional[Tensor] = None, **kwargs) -> Tensor:
        """`te` spec: [b, s] -> one THD sequence [1, b s]; per-token losses back to [b, s]."""
        b, s = document_ids.shape
        flat = (lambda t: None if t is None else t.reshape(1, b * s))  # noqa: E731
        output = super().forward(flat(input_ids), flat(position_ids), None, labels=flat(labels),
                                 packed_seq_params=packed_sequence_params(document_ids), **kwargs)
        return output.reshape(b, s) if labels is not None and self.post_process else output

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        out = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        if not (self.reset_position_ids and not self.packed and position_ids is not None
                and self.position_embedding_type == "rope"):
            return out
        if self.config.multi_latent_attention:
            # Upstream builds no table for MLA (each MLA layer makes its own for 0..s-1); the slot
            # carries ours to models.mla.PositionedMLASelfAttention, at MLA's RoPE head size.
            _check_mla_rotary_slot(out)
            return (out[0], rope_at_positions(self.mla_rotary_pos_emb, position_ids), *out[2:])
        if out[1] is not None:
            _check_rotary_slot(out, position_ids)
            out = (out[0], rope_at_positions(self.rotary_pos_emb, position_ids), *out[2:])
        return out


def _check_mla_rotary_slot(out) -> None:
    """Guard for the MLA branch above (megatron-core 0.19.2): GPTModel._preprocess builds no RoPE
    table with multi_latent_attention and leaves the second item None. If upstream starts filling
    it, our table would replace something we have not read: fail instead."""
    if not (isinstance(out, tuple) and len(out) > 1 and out[1] is None):
        raise RuntimeError(
            "models/documents.py: GPTModel._preprocess now returns a RoPE table for multi_latent_attention "
            f"(got {type(out[1] if isinstance(out, tuple) and len(out) > 1 else out).__name__}); MLA's "
            "reset_position_ids was written for megatron-core 0.19.2: re-check DocumentGPTModel._preprocess")


def _check_rotary_slot(out, position_ids: Tensor) -> None:
    """Guard for the override above, written against megatron-core 0.16.1 (holds in 0.19.2): GPTModel._preprocess
    returns a tuple whose second item is the RoPE table [s_local, 1, 1, d] of 0..s-1. If upstream
    moves or reshapes it, replacing that item would train with wrong positions: fail instead."""
    table = out[1] if isinstance(out, tuple) and len(out) > 1 else None
    if not (isinstance(table, Tensor) and table.dim() == 4 and table.shape[0] == position_ids.shape[1]
            and table.shape[1:3] == (1, 1)):
        raise RuntimeError(
            "models/documents.py: GPTModel._preprocess no longer returns the RoPE table [s, 1, 1, d] as its "
            f"second item (got {type(table).__name__} {getattr(table, 'shape', '')}); reset_position_ids was "
            "written for megatron-core 0.16.1-0.19.2: re-check DocumentGPTModel._preprocess against the new upstream")


def _check_depth_masks_taken() -> None:
    """Per-depth MTP masks need pretrain.megatron_fixes.mtp (models/ cannot import pretrain;
    pretrain.runtime.init_distributed applies the fixes). Without it upstream would fail on the
    MTPDepthMasks object: say why instead."""
    from megatron.core.models.gpt import gpt_model

    if not getattr(gpt_model.process_mtp_loss, "takes_depth_masks", False):
        raise RuntimeError("document masking with MTP needs pretrain.megatron_fixes.apply() first (per-depth MTP "
                           "loss masks: pretrain/megatron_fixes/mtp.py); pretrain.runtime.init_distributed calls it")
