"""Muon (optimizer.name=muon) in the planner: its optimizer state, the FLOPs of Newton-Schulz
and the tensor-parallel all-gathers, as Megatron-Core 0.19.2 runs them.

What runs (pretrain/muon.py, pretrain/wrap.py): Megatron-Core's TensorParallelMuon
(optimizer/emerging_optimizers.py) steps the 2-D hidden matrices (QKV, attention output, MLP
fc1/fc2, experts) and keeps one fp32 `momentum_buffer` per matrix (zeros_like the fp32 main
weight); AdamW steps the rest (embeddings, output layer, norms, biases, router) with its two
fp32 moments. So the state is 4 bytes per Muon element + 8 per AdamW element, not 8 per element.

Sharding (ZeRO-1 at DP x CP > 1): not Megatron's flat distributed optimizer but its
LayerWiseDistributedOptimizer over a plain DDP (grads all-reduced). Our DDP has no
`full_param_layout`, so it takes the "ping-pong by numel" path (`_shard_params_ping_pong`):
every parameter of both optimizers, sorted by numel, dealt whole to ranks 0..d-1, d-1..0, 0..;
a rank keeps main weights and state of its own parameters only (`layer_wise_shard`), and
all-gathers the updated parameters after the step. Expert parameters are dealt over expert-DP.

Newton-Schulz (emerging_optimizers muon_utils.newton_schulz_step) on X (m x n, m <= n after
its transpose) per iteration: A = X X^T (2 m^2 n), B = b A + c A A (2 m^3), X' = a X + B X
(2 m^2 n): 4 m^2 n + 2 m^3 FLOPs, `num_ns_steps` times per matrix per step (element-wise
terms and the normalisation are left out). With split_qkv the Q, K and V blocks are
orthogonalized apart. TP modes (`tp_mode`):
  duplicated   all-gather the fp32 momentum shard over TP, every TP rank runs NS on the
               whole matrix: all-gather (t-1)/t x 4 rows cols bytes, full-matrix FLOPs;
  distributed  NS on the shard along the un-split dimension m, A all-reduced each iteration:
               4 m^2 n/t + 2 m^3 FLOPs, 2 (t-1)/t x e m^2 bytes per iteration (e = 2 in bf16);
  blockwise    NS on the local shard alone: shard FLOPs, no communication.
Under the layer-wise optimizer each DP rank orthogonalizes only the matrices dealt to it.

Lion (optimizer.name=lion) runs the same way (pretrain/megatron_fixes/lion.py: emerging_optimizers'
Lion on every parameter, DDP, the layer-wise optimizer at ZeRO-1): one fp32 momentum (`exp_avg`)
per element of every parameter, no Newton-Schulz: `lion_state_bytes`.
"""

from __future__ import annotations

import dataclasses

from launch.planner.candidate import Candidate
from launch.planner.layers import mla_weights, stage_layer_kinds
from models.flops import mtp_layer_is_moe

MUON_STATE_BYTES = 4  # momentum_buffer, fp32
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32 each


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter tensor as a rank holds it: local element count, which optimizer steps it,
    and whether it is an expert parameter (dealt over expert-DP)."""

    numel: int
    muon: bool
    expert: bool = False
    # Muon matrices only: the whole matrix's shape and its TP split (partition dim, ranks).
    rows: int = 0
    cols: int = 0
    partition_dim: int | None = None
    split: int = 1
    # Row counts orthogonalized apart (split_qkv's Q, K, V of the fused QKV weight); () = one.
    blocks: tuple[int, ...] = ()

    def matrices(self) -> list[tuple[int, int]]:
        """The whole (gathered) matrices Newton-Schulz sees: (rows, cols) per block."""
        return [(rows, self.cols) for rows in (self.blocks or (self.rows,))]


def _matrix(rows: int, cols: int, partition_dim: int | None, split: int, expert: bool = False) -> Param:
    return Param(numel=rows * cols // split, muon=True, expert=expert, rows=rows, cols=cols,
                 partition_dim=partition_dim if split > 1 else None, split=split)


def _norm(c: Candidate, size: int) -> list[Param]:
    return [Param(size, False)] * (2 if c.model.normalization == "LayerNorm" else 1)


def _mlp(c: Candidate, ffn: int, split: int, expert: bool) -> list[Param]:
    """fc1 (column parallel: rows split) and fc2 (row parallel: columns split), with biases."""
    m = c.model
    fc1_out = ffn * (2 if m.gated else 1)
    params = [_matrix(fc1_out, m.hidden_size, 0, split, expert), _matrix(m.hidden_size, ffn, 1, split, expert)]
    if m.add_bias_linear:
        params += [Param(fc1_out // split, False, expert), Param(m.hidden_size, False, expert)]
    return params


def _qkv(c: Candidate) -> Param:
    """The fused QKV weight: Newton-Schulz sees Q, K, V apart with split_qkv (TensorParallelMuon
    splits the gradient per query group), else the one matrix."""
    m, t = c.model, c.tp
    d, h = m.head_dim, m.hidden_size
    blocks = (m.num_attention_heads * d, m.query_groups * d, m.query_groups * d)
    fused = _matrix(sum(blocks), h, 0, t)
    return dataclasses.replace(fused, blocks=blocks) if c.muon is not None and c.muon.split_qkv else fused


def _attention(c: Candidate) -> list[Param]:
    """GQA's fused QKV and output projection (+ biases), or multi-latent attention's weights
    (launch.planner.layers.mla_weights: its down projections split over TP on the portable spec,
    whole on te; the latent norms on AdamW)."""
    m, t = c.model, c.tp
    if m.multi_latent_attention:
        return [_matrix(w.rows, w.cols, w.partition_dim, w.split) if w.matrix else Param(w.numel, False)
                for w in mla_weights(m, t, c.flash_attention)]
    h, nd = m.hidden_size, m.num_attention_heads * m.head_dim
    params = [_qkv(c), _matrix(h, nd, 1, t)]
    if m.add_qkv_bias:
        params.append(Param((nd + 2 * m.query_groups * m.head_dim) // t, False))
    if m.add_bias_linear:
        params.append(Param(h, False))
    return params


def layer_params_list(c: Candidate, moe: bool | None = None) -> list[Param]:
    """One transformer layer's parameters on a rank. `moe`: the kind of layer (moe_layer_freq
    leaves some of a MoE model's layers dense); None = MoE for a MoE model."""
    m, t = c.model, c.tp
    h = m.hidden_size
    moe = m.is_moe if moe is None else moe
    params = _norm(c, h) * 2 + (_norm(c, m.head_dim) * 2 if m.qk_layernorm else []) + _attention(c)
    if moe:
        params.append(Param(m.num_experts * h, False))  # router: AdamW (pretrain/muon.py)
        for _ in range(m.num_experts // c.ep):
            params += _mlp(c, m.expert_ffn_hidden_size, c.etp, expert=True)
        if m.moe_shared_expert_hidden_size:
            params += _mlp(c, m.moe_shared_expert_hidden_size, t, expert=False)
    else:
        params += _mlp(c, m.ffn_hidden_size, t, expert=False)
    return params


def mtp_params_list(c: Candidate) -> list[Param]:
    """The multi-token prediction layers on the last stage (launch.planner.memory.mtp_params_on_rank):
    per layer enorm, hnorm, eh_proj [h, 2h] (column-parallel: a Muon matrix), a transformer layer
    like the decoder's last, final_layernorm; at PP > 1 the stage's own copy of the word embedding."""
    m = c.model
    h = m.hidden_size
    per_layer = (_norm(c, h) * 2 + [_matrix(h, 2 * h, 0, c.tp)] + layer_params_list(c, mtp_layer_is_moe(m))
                 + _norm(c, h))
    copy = [Param(m.padded_vocab_size * h // c.tp, False)] if c.pp > 1 else []
    return per_layer * m.mtp_num_layers + copy


def params_list(c: Candidate, stage: int) -> list[Param]:
    """Every parameter on pipeline rank `stage` (all its virtual chunks): its layers, each of its
    kind (launch.planner.layers.stage_layer_kinds), the embedding on stage 0, the final norm,
    the MTP layers and the output layer on the last (embedding, norms, output: AdamW)."""
    m = c.model
    params = [p for layers, moe in stage_layer_kinds(c, stage) for p in layer_params_list(c, moe) * layers]
    words = m.padded_vocab_size * m.hidden_size // c.tp
    if stage == 0:
        params.append(Param(words, False))
        if m.position_embedding == "learned_absolute":
            params.append(Param(m.max_seq_length * m.hidden_size, False))
    if stage == c.pp - 1:
        params += _norm(c, m.hidden_size)
        if m.mtp_num_layers:
            params += mtp_params_list(c)
        if not m.tie_embeddings or c.pp > 1:
            params.append(Param(words, False))
    return params


@dataclasses.dataclass(frozen=True)
class RankShare:
    """Elements this rank's optimizer steps: by Muon and by AdamW (dense + expert together)."""

    muon: float
    adamw: float

    @property
    def total(self) -> float:
        return self.muon + self.adamw


def ping_pong(numels: list[tuple[int, bool]], ranks: int) -> list[RankShare]:
    """Megatron-Core 0.19's `_shard_params_ping_pong`: (numel, is_muon) sorted by numel (stable),
    dealt to ranks 0, 1, .., d-1, d-1, .., 0, 0, 1, ..; each rank's Muon and AdamW elements."""
    loop = list(range(ranks)) + list(range(ranks))[::-1]
    muon, adamw = [0] * ranks, [0] * ranks
    for index, (numel, is_muon) in enumerate(sorted(numels, key=lambda x: x[0])):
        rank = loop[index % len(loop)]
        if is_muon:
            muon[rank] += numel
        else:
            adamw[rank] += numel
    return [RankShare(a, b) for a, b in zip(muon, adamw, strict=True)]


def layer_wise(c: Candidate) -> bool:
    """Megatron-Core's LayerWiseDistributedOptimizer is on (pretrain/wrap.py): ZeRO-1 and more
    than one DP x CP rank."""
    return c.zero >= 1 and c.dense_shard > 1


def rank_shares(c: Candidate, stage: int) -> list[RankShare]:
    """What each rank of the stage's DP x CP group steps (one entry when nothing is sharded).
    Expert parameters are dealt over expert-DP; rank i of both groups is taken together,
    which is exact when one of the two has nothing to deal (dense models; expert-DP 1)."""
    params = params_list(c, stage)
    dense = [(p.numel, p.muon) for p in params if not p.expert]
    expert = [(p.numel, p.muon) for p in params if p.expert]
    if not layer_wise(c):
        return [RankShare(sum(n for n, mu in dense + expert if mu), sum(n for n, mu in dense + expert if not mu))]
    dense_shares = ping_pong(dense, c.dense_shard)
    expert_shares = ping_pong(expert, c.expert_shard) if expert else [RankShare(0, 0)]
    ranks = max(len(dense_shares), len(expert_shares))
    return [RankShare(dense_shares[i % len(dense_shares)].muon + expert_shares[i % len(expert_shares)].muon,
                      dense_shares[i % len(dense_shares)].adamw + expert_shares[i % len(expert_shares)].adamw)
            for i in range(ranks)]


def main_param_bytes(c: Candidate, stage: int) -> float:
    """fp32 main weights of bf16 parameters, of the parameters the fullest rank steps:
    4 x max over ranks of its (Muon + AdamW) elements; 0 for fp32 parameters."""
    if c.param_bytes == 4:
        return 0.0
    return 4 * max(s.total for s in rank_shares(c, stage))


def optimizer_state_bytes(c: Candidate, stage: int) -> float:
    """Muon's momentum + AdamW's moments on the fullest rank: max over ranks of
    4 x Muon elements + 8 x AdamW elements."""
    return max(MUON_STATE_BYTES * s.muon + ADAM_STATE_BYTES * s.adamw for s in rank_shares(c, stage))


def lion_state_bytes(c: Candidate, stage: int) -> float:
    """Lion's momentum on the fullest rank: 4 bytes x every element that rank steps (whole
    parameters dealt as for Muon under the layer-wise optimizer, all of them otherwise)."""
    return max(MUON_STATE_BYTES * s.total for s in rank_shares(c, stage))


# --------------------------------------------------------------------------------------
# Time: Newton-Schulz FLOPs and the TP communication they need


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of `steps` Newton-Schulz iterations on a rows x cols matrix (m = min, n = max):
    steps x (4 m^2 n + 2 m^3)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def _block_flops(c: Candidate, p: Param, rows: int, cols: int) -> float:
    """NS FLOPs one TP rank runs for one whole rows x cols block of `p` (see the module docstring)."""
    steps, mode, t = c.muon.num_ns_steps, c.muon.tp_mode, p.split
    if t == 1 or mode == "duplicated":
        return ns_flops(rows, cols, steps)
    if mode == "blockwise":
        return ns_flops(rows // t, cols, steps) if p.partition_dim == 0 else ns_flops(rows, cols // t, steps)
    # distributed: iterates along the un-split dimension m, whichever is smaller.
    m, n = (cols, rows) if p.partition_dim == 0 else (rows, cols)
    return steps * (4 * m * m * n / t + 2 * m ** 3)


def _stepped_fraction(c: Candidate, expert: bool) -> float:
    """Share of the stage's matrices a rank orthogonalizes: all of them, or 1/d under the
    layer-wise optimizer (dealt by numel; NS FLOPs taken as evenly spread)."""
    if not layer_wise(c):
        return 1.0
    return 1 / (c.expert_shard if expert else c.dense_shard)


def ns_flops_per_step(c: Candidate, stage: int) -> float:
    """Newton-Schulz FLOPs one rank of `stage` runs per optimizer step."""
    return sum(_block_flops(c, p, rows, cols) * _stepped_fraction(c, p.expert)
               for p in params_list(c, stage) if p.muon for rows, cols in p.matrices())


def ns_comm_bytes_per_step(c: Candidate, stage: int) -> float:
    """Bytes one rank of `stage` moves over its TP (expert-TP) group per step for Newton-Schulz:
    duplicated: all-gather (t-1)/t x 4 rows cols (fp32 momentum); distributed: all-reduce of A,
    steps x 2 (t-1)/t x e m^2; blockwise: 0."""
    mode = c.muon.tp_mode
    total = 0.0
    for p in params_list(c, stage):
        if not p.muon or p.split == 1 or mode == "blockwise":
            continue
        frac = (p.split - 1) / p.split * _stepped_fraction(c, p.expert)
        for rows, cols in p.matrices():
            if mode == "duplicated":
                total += frac * 4 * rows * cols
            else:
                m = cols if p.partition_dim == 0 else rows
                e = 2 if c.muon.fp32_matmul_prec == "medium" else 4
                total += c.muon.num_ns_steps * 2 * frac * e * m * m
    return total


def ns_peak_dtype(c: Candidate) -> str:
    """The dtype Newton-Schulz's GEMMs run in: bf16 at fp32_matmul_prec=medium (it casts X to
    bf16), fp32 otherwise (high = TF32 on a GPU, counted at the fp32 peak: conservative)."""
    return "bf16" if c.muon.fp32_matmul_prec == "medium" else "fp32"
