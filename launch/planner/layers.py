"""Which transformer layers a pipeline stage holds, and the weight tensors of multi-latent
attention as Megatron-Core 0.19.2 builds them: one place for the memory model
(launch.planner.memory), Megatron-FSDP's bucket model (launch.planner.fsdp_buckets) and
Muon's / Lion's per-parameter model (launch.planner.muon), so the three count the same layers.

The counts match `models.flops` (`mla_attention_params`) and `launch.planner.memory`
(`mla_replicated_params`): tests/launch/test_planner_mla.py checks it.
"""

from __future__ import annotations

import dataclasses

from launch.planner.candidate import Candidate
from models.config import ModelConfig


def mixed_layers(m: ModelConfig) -> bool:
    """A MoE model with dense layers among its MoE layers (moe_layer_freq)."""
    return m.is_moe and 0 in m.moe_layer_pattern


def moe_layers_on_stage(c: Candidate, stage: int) -> int:
    """MoE layers on pipeline rank `stage` (moe_layer_freq's pattern read over the layers its
    chunks hold: chunk v of rank r follows every chunk of an earlier virtual stage and rank r'
    < r's chunk v, Megatron-Core's get_transformer_layer_offset); 0 for a dense model."""
    pattern = c.model.moe_layer_pattern
    if not pattern:
        return 0
    split = c.stage_split
    count = offset = 0
    for v in range(c.vpp):
        for rank in range(c.pp):
            if rank == stage:
                count += sum(pattern[offset:offset + split[rank][v]])
            offset += split[rank][v]
    return count


def stage_layer_kinds(c: Candidate, stage: int) -> list[tuple[int, bool | None]]:
    """(layers, moe) per kind of layer on `stage`: [(L_stage, None)] for a dense or an all-MoE
    model (moe=None: the model's one kind), else the dense and the MoE layers' counts (dense
    first, DeepSeek's order: its dense layers lead)."""
    layers = c.layers_on_stage(stage)
    if not mixed_layers(c.model):
        return [(layers, None)]
    moe = moe_layers_on_stage(c, stage)
    return [(layers - moe, False), (moe, True)]


@dataclasses.dataclass(frozen=True)
class Weight:
    """One parameter tensor of a layer: its whole shape (1-D: cols = 1), how TP splits it
    (`split` ranks along `partition_dim`, 0 = rows; split 1 = whole on every rank) and whether
    it is a hidden matrix (2-D, what Muon steps; norms are not)."""

    rows: int
    cols: int
    split: int = 1
    partition_dim: int = 0

    @property
    def matrix(self) -> bool:
        return self.cols > 1

    @property
    def local_shape(self) -> tuple[int, int]:
        """(rows, cols) on one TP rank."""
        if self.split == 1:
            return self.rows, self.cols
        if self.partition_dim == 0:
            return self.rows // self.split, self.cols
        return self.rows, self.cols // self.split

    @property
    def numel(self) -> int:
        rows, cols = self.local_shape
        return rows * cols


def mla_weights(m: ModelConfig, tp: int, te: bool) -> list[Weight]:
    """MLASelfAttention's parameters (multi_latent_attention.py), in the portable spec's
    named_parameters order: linear_proj [h, n dv] (row-parallel), the q path (linear_q_down_proj
    [q_lora, h] + linear_q_up_proj [n (dq + dr), q_lora], or linear_q_proj [n (dq + dr), h]
    without q_lora_rank), linear_kv_down_proj [kv_lora + dr, h], linear_kv_up_proj
    [n (dq + dv), kv_lora], then the latent norms (q_layernorm [q_lora], kv_layernorm [kv_lora];
    + a bias each for LayerNorm). Up projections and linear_q_proj are column-parallel on both
    specs; the down projections are column-parallel on the portable spec and whole on every TP
    rank on `te` (TELinear, parallel_mode='duplicated'), where the latent norms are fused into
    the up projections' LayerNormColumnParallelLinear (whole too)."""
    h, n = m.hidden_size, m.num_attention_heads
    down = 1 if te else tp
    weights = [Weight(h, n * m.v_head_dim, tp, 1)]
    if m.q_lora_rank is None:
        weights.append(Weight(n * m.q_head_dim, h, tp))
    else:
        weights += [Weight(m.q_lora_rank, h, down), Weight(n * m.q_head_dim, m.q_lora_rank, tp)]
    weights += [Weight(m.kv_lora_rank + m.qk_pos_emb_head_dim, h, down),
                Weight(n * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank, tp)]
    per_norm = 2 if m.normalization == "LayerNorm" else 1
    for latent in ([m.q_lora_rank] if m.q_lora_rank else []) + [m.kv_lora_rank]:
        weights += [Weight(latent, 1)] * per_norm
    return weights
