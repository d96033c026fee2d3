"""Megatron-FSDP's buckets for a candidate: which parameters share a bucket, how each bucket
is padded, and how many elements a rank holds (ZeRO-2/3).

Megatron-FSDP (megatron-core 0.16.1, `megatron/core/distributed/fsdp/src/megatron_fsdp/`)
keeps parameters, gradients and fp32 main weights in flat buckets:
  grouping   `param_and_grad_buffer.py` `_get_parameter_groups`: under ZeRO-3
             (`optim_grads_params`) every TransformerLayer is an FSDP unit with its own
             bucket (dense and expert parameters apart); the other parameters (embedding,
             final norm, output layer) and, under ZeRO-2 (`optim_grads`), all parameters
             form one group per (dense | expert), cut into buckets once a bucket reaches
             `bucket_size` elements (None: one bucket).
  chunk      each bucket gets a chunk_size_factor: the row size (shape[1:] elements) of its
             widest parameter, widened to the least common multiple with any row size that
             does not tile it (Step 3 of `_get_parameter_groups`).
  padding    `build_data_parallel_buffer_index` pads each bucket to a multiple of
             shard ranks x chunk_size_factor, and each rank holds one equal slice of it.
Items are also aligned to the chunk inside a bucket; that gap (< one chunk per parameter)
is not modelled: on the tiny test models it stays under 0.6% of a bucket.

A rank's buffers therefore hold padded / shard elements per bucket. Adam's moments are
DTensors over the parameters' local slices, so they hold the parameter elements of the
rank's slice: slice i of S = padded / shard elements holds min(S, max(0, numel - i S)); the
first rank's slice is all parameter (the padding sits at the end), so the planner sizes
rank 0, the fullest.

Parameter shapes are those Megatron-Core builds (the counts match `models.flops`, which
tests/launch/test_memory.py checks): QKV [(n + 2g) d / t, h], projection [h, n d / t],
fc1 [f (2 if gated) / t, h], fc2 [h, f / t], experts the same with f_e / ETP (one fc1/fc2
per local expert), embedding and output [V / t, h], router [E, h], norms and biases 1-D;
multi-latent attention's weights per spec (launch.planner.layers.mla_weights). Each layer is
listed as its kind (a dense layer among MoE layers has its MLP, no router or experts), the
stage's own layers (launch.planner.layers.stage_layer_kinds), and the last stage adds the
multi-token prediction layers: each one's transformer layer a unit under ZeRO-3, its norms
and eh_proj in the non-unit group. tests/launch/test_memory_measured.py checks tiny-deepseek
(MLA, dense + MoE layers, shared expert, MTP) at ZeRO-2 and ZeRO-3 to the byte.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from launch.planner.candidate import Candidate
from launch.planner.layers import mla_weights, stage_layer_kinds
from models.config import ModelConfig
from models.flops import mtp_layer_is_moe, norm_params, qk_norm_params

# megatron_fsdp.py (MegatronFSDP.__init__): suggested_communication_unit_size =
# max(1_000_000_000, ...) elements unless the DDP config sets it (ours does not): the
# reduce-scatter queue holds that many gradient elements before it frees a bucket, and the
# all-gather prefetch half of it.
COMM_UNIT_ELEMENTS = 1_000_000_000

Param = tuple[int, int]  # (elements, row size = shape[1:] elements; 1 for 1-D)


@dataclasses.dataclass(frozen=True)
class Bucket:
    numel: int
    chunk: int  # Megatron-FSDP's chunk_size_factor
    expert: bool
    unit: bool = False  # a TransformerLayer's bucket under ZeRO-3 (gathered and released per layer)

    def padded(self, shard: int) -> int:
        """Elements after padding to a multiple of shard x chunk."""
        step = shard * self.chunk
        return -(-self.numel // step) * step


@dataclasses.dataclass(frozen=True)
class HeldElements:
    full: float  # every bucket whole (ZeRO-2's parameters)
    shard: float  # one rank's slice of every bucket (padding included)
    real: float  # the parameter elements in that slice (Adam's moments)


def _norm(m: ModelConfig) -> list[Param]:
    """A norm's weight (and LayerNorm's bias)."""
    return [(m.hidden_size, 1)] * (norm_params(m) // m.hidden_size)


def _linear(m: ModelConfig, out: int, inp: int, bias: bool) -> list[Param]:
    """A [out, inp] weight (+ a 1-D bias of out)."""
    return [(out * inp, inp)] + ([(out, 1)] if bias else [])


def _mlp(m: ModelConfig, ffn: int, tp: int) -> list[Param]:
    h, up = m.hidden_size, ffn * (2 if m.gated else 1)
    fc1 = _linear(m, up // tp, h, m.add_bias_linear)
    fc2 = [(h * ffn // tp, ffn // tp)] + ([(h, 1)] if m.add_bias_linear else [])
    return fc1 + fc2


def _attention(m: ModelConfig, tp: int, te: bool) -> list[Param]:
    """GQA's QKV (+ bias) and output projection (+ bias), or MLA's weights
    (launch.planner.layers.mla_weights: which are split over TP depends on the spec)."""
    if m.multi_latent_attention:
        return [(w.numel, w.local_shape[1]) for w in mla_weights(m, tp, te)]
    h, d = m.hidden_size, m.head_dim
    qkv = (m.num_attention_heads + 2 * m.query_groups) * d
    nd = m.num_attention_heads * d
    projection = [(h * nd // tp, nd // tp)] + ([(h, 1)] if m.add_bias_linear else [])
    return _linear(m, qkv // tp, h, m.add_qkv_bias) + projection


def layer_parameters(m: ModelConfig, tp: int, ep: int, etp: int, moe: bool | None = None,
                     te: bool = True) -> tuple[list[Param], list[Param]]:
    """One transformer layer on one rank: (dense, expert) parameters. `moe`: the kind of layer
    (moe_layer_freq leaves some of a MoE model dense; None = MoE for a MoE model); `te`: the
    spec (MLA's down projections are whole on every TP rank on te, split on portable)."""
    h = m.hidden_size
    moe = m.is_moe if moe is None else moe
    dense = _norm(m) + _attention(m, tp, te) + _norm(m)
    dense += [(m.head_dim, 1)] * (qk_norm_params(m) // m.head_dim)  # q/k norms, replicated over TP
    expert: list[Param] = []
    if moe:
        dense += [(m.num_experts * h, h)]  # router
        if m.moe_shared_expert_hidden_size:
            dense += _mlp(m, m.moe_shared_expert_hidden_size, tp)
        for _ in range(m.num_experts // ep):
            expert += _mlp(m, m.expert_ffn_hidden_size, etp)
    else:
        dense += _mlp(m, m.ffn_hidden_size, tp)
    return dense, expert


def mtp_parameters(m: ModelConfig, tp: int) -> tuple[list[Param], list[Param]]:
    """One multi-token prediction layer's own parameters around its transformer layer (shaped
    like the decoder's last; an FSDP unit of its own): (before it: enorm, hnorm, eh_proj
    [h / t, 2h], column-parallel; after it: final_layernorm)."""
    h = m.hidden_size
    return _norm(m) * 2 + [(h * 2 * h // tp, 2 * h)], _norm(m)


def embedding_parameters(m: ModelConfig, tp: int) -> list[Param]:
    """Word embedding [V / t, h] (+ learned positions [s, h])."""
    params = [(m.padded_vocab_size // tp * m.hidden_size, m.hidden_size)]
    if m.position_embedding == "learned_absolute":
        params.append((m.max_seq_length * m.hidden_size, m.hidden_size))
    return params


def output_parameters(m: ModelConfig, tp: int, pp: int) -> list[Param]:
    """Final norm + output layer [V / t, h] (none when tied at PP=1: the embedding serves)."""
    params = _norm(m)
    if not m.tie_embeddings or pp > 1:
        params.append((m.padded_vocab_size // tp * m.hidden_size, m.hidden_size))
    return params


def chunk_size_factor(params: list[Param]) -> int:
    """Step 3 of `_get_parameter_groups`: widest row first; a parameter whose row size
    neither equals the chunk nor tiles it (and is not smaller than one chunk) widens the
    chunk to the least common multiple."""
    ordered = sorted(params, key=lambda p: p[1], reverse=True)
    chunk = ordered[0][1]
    for numel, row in ordered:
        if row == chunk or (chunk % row == 0 and numel % chunk == 0) or numel < chunk:
            continue
        chunk = math.lcm(chunk, row)
    return chunk


def _split(params: list[Param], bucket_size: Optional[int], expert: bool) -> list[Bucket]:
    """A non-unit group cut into buckets: a bucket closes once it holds >= bucket_size."""
    buckets, current = [], []
    for param in params:
        current.append(param)
        if bucket_size and sum(n for n, _ in current) >= bucket_size:
            buckets.append(current)
            current = []
    if current:
        buckets.append(current)
    return [Bucket(sum(n for n, _ in b), chunk_size_factor(b), expert) for b in buckets]


def _buckets(m: ModelConfig, zero: int, tp: int, pp: int, ep: int, etp: int, first: bool, last: bool,
             bucket_size: Optional[int], kinds: tuple[tuple[int, bool | None], ...], te: bool) -> tuple[Bucket, ...]:
    """`kinds`: (layers, moe) of the stage (launch.planner.layers.stage_layer_kinds). The last
    stage also holds the MTP layers (model.mtp_num_layers), between the final norm and the
    output layer, with their own copy of the word embedding at PP > 1."""
    # (count, (dense, expert)) per kind of layer: every layer of a kind has the same parameters.
    layers = [(count, layer_parameters(m, tp, ep, etp, moe, te)) for count, moe in kinds]
    mtp = (m.mtp_num_layers if last else 0, layer_parameters(m, tp, ep, etp, mtp_layer_is_moe(m), te))
    before, after = mtp_parameters(m, tp)
    head = embedding_parameters(m, tp) if first or (mtp[0] and pp > 1) else []
    tail = output_parameters(m, tp, pp) if last else []
    norm, output = tail[:len(_norm(m))], tail[len(_norm(m)):]  # output: [] when tied at PP 1
    if zero == 3:  # one unit per layer (MTP's transformer layers too), the rest in non-unit groups
        units = []
        for count, (dense, expert) in layers + [mtp]:
            units += [Bucket(sum(n for n, _ in part), chunk_size_factor(part), is_expert, unit=True)
                      for part, is_expert in ((dense, False), (expert, True)) if part] * count
        root = head + norm + (before + after) * mtp[0] + output
        return tuple(units + (_split(root, bucket_size, False) if root else []))
    # ZeRO-2: no units; parameters in module order (embedding, layers, final norm, MTP, output).
    all_dense = head + [p for count, (dense, _) in layers for p in dense * count]
    all_dense += norm + (before + mtp[1][0] + after) * mtp[0] + output
    out = _split(all_dense, bucket_size, False)
    expert = [p for count, (_, e) in layers + [mtp] for p in e * count]
    if expert:
        out += _split(expert, bucket_size, True)
    return tuple(out)


def fsdp_buckets(c: Candidate, stage: int = 0) -> tuple[Bucket, ...]:
    """The buckets Megatron-FSDP builds on pipeline rank `stage` of `c` (ZeRO-2/3): the stage's
    own layers, each of its kind (dense or MoE, MLA's weights on the candidate's spec)."""
    args = (c.zero, c.tp, c.pp, c.ep, c.etp, stage == 0, stage == c.pp - 1, c.bucket_size,
            tuple(stage_layer_kinds(c, stage)), c.flash_attention)
    # Cached by the model's identity: a ModelConfig with moe_layer_freq (a list) is not hashable
    # (it is frozen, so its fields cannot change). The entry keeps the model alive, so its id
    # cannot be reused by another one.
    key = (id(c.model),) + args
    cached = _CACHE.get(key)
    if cached is None or cached[0] is not c.model:
        if len(_CACHE) >= 4096:
            _CACHE.clear()
        cached = _CACHE[key] = (c.model, _buckets(c.model, *args))
    return cached[1]


_CACHE: dict[tuple, tuple[ModelConfig, tuple[Bucket, ...]]] = {}


def _shards(c: Candidate) -> tuple[int, int]:
    """(dense, expert) shard group sizes, asked once per call: each question copies the layout
    (Candidate.sharded_layout), and a DeepSeek-size stage has hundreds of buckets."""
    return c.dense_zero_shard, c.expert_zero_shard


def fsdp_held_elements(c: Candidate, stage: int = 0, slices: tuple[int, int] = (0, 0)) -> HeldElements:
    """Elements a rank holds: whole padded buckets (full), its slice of each (shard) and the
    parameter elements in that slice (real). `slices`: the rank's index in its dense and its
    expert shard group; (0, 0), the fullest rank, unless asked."""
    full = shard = real = 0.0
    shards = _shards(c)
    for b in fsdp_buckets(c, stage):
        ranks = shards[b.expert]
        size = b.padded(ranks) / ranks
        index = slices[1] if b.expert else slices[0]
        full += b.padded(ranks)
        shard += size
        real += min(size, max(0.0, b.numel - index * size))
    return HeldElements(full=full, shard=shard, real=real)


def sharding_buffer_bytes(c: Candidate, stage: int = 0) -> float:
    """Megatron-FSDP's temporary buckets at their peak, in bytes (padded bucket sizes; e bytes
    per parameter, 4 per fp32 gradient; Q = COMM_UNIT_ELEMENTS):
    gradients: a bucket's unsharded gradient is allocated at its first gradient and freed
    only once more than Q elements wait in the reduce-scatter queue
    (GradReducePipeline.wait_for_previous_grad_reduce), so at the end of backward
    G = min(all buckets, Q + the two largest buckets: the one filling and the one just queued).
    ZeRO-2 (parameters stay whole): 4 G.
    ZeRO-3: the non-unit buckets R (embedding, output layer) stay gathered through forward and
    backward; a layer's bucket is gathered when used and the next ones prefetched up to Q / 2
    elements: A = R + min(all units, Q / 2 + the largest unit U). The peak is the larger of
    the start of backward, e A + 4 (R + U) (first gradients: output layer, last layer), and
    its end, e R + 4 min(all buckets, Q + R + U) (units released, gradients queued).
    On tiny models (everything below Q) this is exactly what a CPU run allocates."""
    buckets = fsdp_buckets(c, stage)
    shards = _shards(c)
    padded = [b.padded(shards[b.expert]) for b in buckets]
    total = sum(padded)
    if c.zero == 2:
        return 4.0 * min(total, COMM_UNIT_ELEMENTS + sum(sorted(padded, reverse=True)[:2]))
    units = [p for p, b in zip(padded, buckets) if b.unit]
    root = total - sum(units)
    largest = max(units, default=0)
    gathered = root + min(sum(units), COMM_UNIT_ELEMENTS / 2 + largest)
    start = c.param_bytes * gathered + 4.0 * (root + largest)
    end = c.param_bytes * root + 4.0 * min(total, COMM_UNIT_ELEMENTS + root + largest)
    return max(start, end)
