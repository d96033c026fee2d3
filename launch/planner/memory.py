"""Memory per GPU for a candidate (model x layout x batch x precision x recompute).

Every term is a named function whose docstring holds its formula. Notation: L layers,
h hidden, f FFN hidden, n heads, g query groups, d head dim, V padded vocab, E experts,
k router top-k, f_e expert FFN hidden, s sequence, b micro batch; t TP, p PP, v VPP,
c CP, EP/ETP expert parallel / expert TP, P parameters held by a rank.

Static terms mirror what `pretrain.wrap.wrap_for_training` allocates (Megatron DDP with
grad_reduce_in_fp32=True and Megatron's mixed-precision / distributed optimizer for ZeRO-0/1,
Megatron-FSDP for ZeRO-2/3, Adam); tests/launch/test_memory_measured.py checks them against
the bytes actually allocated on every rank.
Activation terms follow Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), generalised to GQA, SwiGLU, flash attention and MoE; with
their assumptions (MHA, f=4h, GeLU, dropout, no flash) they reduce to the paper's
34sbh + 5as^2b per layer (tests check this).

Parameter counts come from `models.flops` (the one place for them); this module only
decides which of those parameters a rank holds.
"""

from __future__ import annotations

import dataclasses

from launch.planner.candidate import Candidate
from launch.planner import muon as _muon
from launch.planner.fsdp_buckets import fsdp_held_elements
from launch.planner.fsdp_buckets import sharding_buffer_bytes as _fsdp_sharding_buffer_bytes
from launch.planner.layers import mixed_layers, stage_layer_kinds
from models.config import ModelConfig
from models.flops import (embedding_params, layer_params, mlp_params, mtp_layer_is_moe, norm_params, output_params,
                          qk_norm_params)

GIB = 2**30
# The gradient buffer's element size is Candidate.grad_bytes: pretrain/wrap.py builds DDP with
# grad_reduce_in_fp32=True (fp32 whatever the parameter dtype); published recipes may not.
MAIN_PARAM_BYTES = 4  # fp32 master weights of 16-bit parameters
ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq, fp32 each


# --------------------------------------------------------------------------------------
# Which parameters a rank holds


def tp_replicated_layer_params(m: ModelConfig, moe: bool | None = None, te: bool = True) -> int:
    """Per-layer dense parameters every TP rank holds whole (not split by TP):
    2 norms (2 x norm_params) and the q/k norms + the row-parallel output biases (attention
    proj h, dense fc2 h, shared-expert fc2 h, when add_bias_linear) + the MoE router (h x E)
    + MLA's replicated part (mla_replicated_params; `te`: the spec).
    `moe`: which kind of layer (moe_layer_freq leaves some dense); None = MoE for a MoE model."""
    h = m.hidden_size
    moe = m.is_moe if moe is None else moe
    count = 2 * norm_params(m) + qk_norm_params(m) + mla_replicated_params(m, te)
    bias = h if m.add_bias_linear else 0
    count += bias  # attention output projection bias
    if moe:
        count += h * m.num_experts
        if m.moe_shared_expert_hidden_size:
            count += bias
    else:
        count += bias  # fc2 bias
    return count


def expert_layer_params(m: ModelConfig) -> int:
    """Per-layer expert parameters of the whole model: E x mlp_params(f_e); 0 for dense."""
    return m.num_experts * mlp_params(m, m.expert_ffn_hidden_size) if m.is_moe else 0


def mla_replicated_params(m: ModelConfig, te: bool = True) -> int:
    """Multi-latent attention's parameters every TP rank holds whole (0 without MLA). Both
    specs keep the latent norms whole (per_norm x (q_lora + kv_lora); Transformer Engine fuses
    them into the up projections' LayerNormColumnParallelLinear). The te spec builds the down
    projections as TELinear, parallel_mode='duplicated' (multi_latent_attention.py,
    MLASelfAttention.__init__): h x q_lora + h x (kv_lora + dr) on every rank too. The portable
    (local) spec builds them column-parallel, split over TP like the up projections and the
    output projection, which every spec splits."""
    if not m.multi_latent_attention:
        return 0
    per_norm = 2 if m.normalization == "LayerNorm" else 1
    count = per_norm * (m.kv_lora_rank + (m.q_lora_rank or 0))
    if te:
        count += m.hidden_size * (m.kv_lora_rank + m.qk_pos_emb_head_dim + (m.q_lora_rank or 0))
    return count


def dense_layer_params_on_rank(m: ModelConfig, tp: int, moe: bool | None = None, te: bool = True) -> int:
    """One layer's non-expert parameters on one rank:
    R + (layer_params - experts - R) / t, with R = tp_replicated_layer_params.
    `moe`: the kind of layer (None = MoE for a MoE model); `te`: the spec (MLA only)."""
    moe = m.is_moe if moe is None else moe
    replicated = tp_replicated_layer_params(m, moe, te)
    experts = expert_layer_params(m) if moe else 0
    return replicated + (layer_params(m, moe) - experts - replicated) // tp


def expert_layer_params_on_rank(m: ModelConfig, ep: int, etp: int) -> int:
    """One layer's expert parameters on one rank: (E / EP) x [(mlp_params(f_e) - B) / ETP + B],
    with B = h the fc2 bias (replicated over expert TP) when add_bias_linear."""
    if not m.is_moe:
        return 0
    bias = m.hidden_size if m.add_bias_linear else 0
    per_expert = (mlp_params(m, m.expert_ffn_hidden_size) - bias) // etp + bias
    return (m.num_experts // ep) * per_expert


def embedding_params_on_rank(m: ModelConfig, tp: int) -> int:
    """First pipeline stage: word embedding V x h split over TP (vocab-parallel) + learned
    position embedding max_seq x h (replicated)."""
    words = m.padded_vocab_size * m.hidden_size
    positions = embedding_params(m) - words
    return words // tp + positions


def output_params_on_rank(m: ModelConfig, tp: int, pp: int) -> int:
    """Last pipeline stage: final norm (replicated) + output projection h x V / t.
    Tied embeddings: at PP=1 the embedding serves as output layer (nothing extra); at PP>1
    the last stage keeps its own copy (Megatron's shared_embedding, kept equal by an
    all-reduce of its gradient with the first stage), so h x V / t is held again."""
    words = m.padded_vocab_size * m.hidden_size
    norm = output_params(m) - (0 if m.tie_embeddings else words)
    if m.tie_embeddings and pp == 1:
        return norm
    return norm + words // tp


@dataclasses.dataclass(frozen=True)
class RankParams:
    dense: int  # sharded by the distributed optimizer over DP x CP
    expert: int  # sharded over expert-DP

    @property
    def total(self) -> int:
        return self.dense + self.expert


def params_on_rank(c: Candidate, stage: int) -> RankParams:
    """Parameters on pipeline rank `stage` (0..p-1), all its virtual chunks together:
    dense = (L/p) x dense_layer + [stage 0] embedding + [stage p-1] output,
    expert = (L/p) x expert_layer.
    With dense layers among MoE ones (moe_layer_freq) each kind counts its own layers
    (stage_layer_kinds); only the MoE layers hold experts.
    MLA's TP split depends on the spec: flash_attention (te) or not (portable)."""
    m, te = c.model, c.flash_attention
    dense = expert = 0
    for layers, moe in stage_layer_kinds(c, stage):
        dense += layers * dense_layer_params_on_rank(m, c.tp, moe, te)
        if moe is not False:
            expert += layers * expert_layer_params_on_rank(m, c.ep, c.etp)
    if stage == 0:
        dense += embedding_params_on_rank(m, c.tp)
    if stage == c.pp - 1:
        dense += output_params_on_rank(m, c.tp, c.pp)
        if m.mtp_num_layers:
            mtp_dense, mtp_expert = mtp_params_on_rank(c)
            dense, expert = dense + mtp_dense, expert + mtp_expert
    return RankParams(dense=dense, expert=expert)


def mtp_params_on_rank(c: Candidate) -> tuple[int, int]:
    """(dense, expert) parameters of the multi-token prediction layers, which Megatron-Core 0.19
    puts on the last pipeline stage: per layer its three norms (replicated), the 2h -> h
    projection (column-parallel, h x 2h / t) and one transformer layer shaped like the
    decoder's last; at PP > 1 the stage also builds its own copy of the word embedding
    (GPTModel: `pre_process or mtp_process`), kept in sync like a tied output layer."""
    m, te = c.model, c.flash_attention
    moe = mtp_layer_is_moe(m)
    h = m.hidden_size
    dense = 3 * norm_params(m) + 2 * h * h // c.tp + dense_layer_params_on_rank(m, c.tp, moe, te)
    expert = expert_layer_params_on_rank(m, c.ep, c.etp) if moe else 0
    copy = embedding_params_on_rank(m, c.tp) if c.pp > 1 else 0
    return m.mtp_num_layers * dense + copy, m.mtp_num_layers * expert


# --------------------------------------------------------------------------------------
# Static memory: parameters, gradients, optimizer state
#
# ZeRO-0/1 run on Megatron's DDP (one fp32 gradient buffer over all parameters) and, for
# ZeRO-1, its distributed optimizer (fp32 main weights and Adam moments sharded over DP x CP,
# expert ones over expert-DP). ZeRO-2/3 run on Megatron-FSDP, which keeps every buffer in
# padded buckets (launch.planner.fsdp_buckets) sharded over the same groups, divided by the
# HSDP replicas. With optimizer CPU offload the main weights and moments live on the host.


def _sharded(c: Candidate, p: RankParams, bytes_per: int, sharded: bool) -> float:
    if not sharded:
        return p.total * bytes_per
    return (p.dense / c.dense_shard + p.expert / c.expert_shard) * bytes_per


def param_bytes(c: Candidate, stage: int) -> float:
    """Model parameters, e = bytes(dtype) (2 for bf16/fp16, 4 for fp32):
    ZeRO-0/1: e x P. ZeRO-2: e x B (every padded bucket whole: the forward reads them
    unsharded). ZeRO-3: e x B / shard (the rank's shard; fsdp_held_elements)."""
    if c.fsdp:
        held = fsdp_held_elements(c)
        return c.param_bytes * (held.full if c.zero == 2 else held.shard)
    return _sharded(c, params_on_rank(c, stage), c.param_bytes, False)


def grad_bytes(c: Candidate, stage: int) -> float:
    """Gradient buffer, g = 4 bytes with grad_reduce_in_fp32 (ours), else the dtype's:
    ZeRO-0/1: g P on every DP rank (the distributed optimizer reduce-scatters into the full
    buffer); ZeRO-2/3: g B / shard."""
    if c.fsdp:
        return c.grad_bytes * fsdp_held_elements(c).shard
    return _sharded(c, params_on_rank(c, stage), c.grad_bytes, False)


def main_param_bytes(c: Candidate, stage: int) -> float:
    """fp32 master weights of 16-bit parameters: ZeRO-0: 4 P; ZeRO-1: 4 (P_dense / (DP x CP)
    + P_expert / expert-DP); ZeRO-2/3: 4 B / shard (Megatron-FSDP's main_weight_buffer,
    megatron_fsdp_main_params_dtype=fp32). fp32 parameters need none (the optimizer updates
    them in place; training wraps ZeRO-2/3 with megatron_fsdp_main_params_dtype=None). 0 on the
    GPU with CPU offload (host_bytes). Muon: launch.planner.muon.main_param_bytes (its
    layer-wise optimizer deals whole parameters to DP ranks), and Lion's, which runs the same way."""
    if c.muon or c.lion:
        return _muon.main_param_bytes(c, stage)
    if c.param_bytes == 4 or c.offload:
        return 0.0
    if c.fsdp:
        return MAIN_PARAM_BYTES * fsdp_held_elements(c).shard
    return _sharded(c, params_on_rank(c, stage), MAIN_PARAM_BYTES, c.zero >= 1)


def optimizer_state_bytes(c: Candidate, stage: int, slices: tuple[int, int] = (0, 0)) -> float:
    """Adam moments exp_avg and exp_avg_sq in fp32: ZeRO-0: 8 P; ZeRO-1: 8 (P_dense / (DP x CP)
    + P_expert / expert-DP); ZeRO-2/3: 8 x the parameter elements in the rank's slices (the
    moments are DTensors over the parameters, not the padding; `slices`: the rank's index in
    its dense / expert shard group, default the fullest). 0 on the GPU with CPU offload.
    Muon: 4 bytes (momentum) per Muon element + 8 per AdamW element; Lion: 4 bytes per element
    (launch.planner.muon)."""
    if c.muon:
        return _muon.optimizer_state_bytes(c, stage)
    if c.lion:
        return _muon.lion_state_bytes(c, stage)
    if c.offload:
        return 0.0
    if c.fsdp:
        return ADAM_STATE_BYTES * fsdp_held_elements(c, stage, slices).real
    return _sharded(c, params_on_rank(c, stage), ADAM_STATE_BYTES, c.zero >= 1)


def host_bytes(c: Candidate, stage: int) -> float:
    """Host memory per GPU with optimizer CPU offload (Megatron's HybridDeviceOptimizer): fp32
    main weights, fp32 gradients (copied down for the CPU step) and Adam moments of the
    parameters this rank's optimizer updates, 16 bytes each: all P under ZeRO-0, the rank's
    shard otherwise; 0 without offload."""
    if not c.offload:
        return 0.0
    if c.fsdp:
        return 16 * fsdp_held_elements(c).real
    return _sharded(c, params_on_rank(c, stage), 16, c.zero >= 1)


def linear_layer_params_on_rank(c: Candidate, moe: bool | None = None) -> int:
    """Per-layer parameters of the linear layers whose GEMMs run in FP8 (QKV, projection,
    MLP or experts), on one rank: a layer's parameters less its norms and router (`moe`: the
    kind of layer, None = the model's; MLA's down projections count, its latent norms not)."""
    m = c.model
    mla_down = mla_replicated_params(m, True) - mla_replicated_params(m, False)
    dense = dense_layer_params_on_rank(m, c.tp, moe) - tp_replicated_layer_params(m, moe) + mla_down
    return dense + (expert_layer_params_on_rank(m, c.ep, c.etp) if moe is not False else 0)


# Transformer Engine's delayed scaling keeps an amax history per FP8 tensor: 3 per linear
# (input, weight, grad output), fp32, 1024 long by default (runtime.fp8_amax_history_len).
AMAX_HISTORY = 1024
LINEARS_PER_LAYER = 4  # QKV, projection, fc1, fc2


def fp8_buffer_bytes(c: Candidate, stage: int) -> float:
    """FP8 weight copies that Transformer Engine caches across the microbatches of a step
    (Megatron passes is_first_microbatch, so the cast weight is reused): on Hopper a rowwise
    and a columnwise (transposed, for the backward's dgrad) byte per linear parameter,
    2 x linear_params x layers; + delayed scaling's amax histories, 3 x 4 x 1024 bytes per
    linear. 0 without FP8 (nothing of this exists)."""
    if not c.fp8:
        return 0.0
    amax = 3 * 4 * AMAX_HISTORY * LINEARS_PER_LAYER if c.fp8_recipe in (None, "delayed") else 0
    return sum(layers * (2 * linear_layer_params_on_rank(c, moe) + amax) for layers, moe in stage_layer_kinds(c, stage))


# --------------------------------------------------------------------------------------
# Activations (bytes per layer per microbatch unless said otherwise)
#
# T = s b / c tokens per rank (CP splits the sequence); z = t with sequence parallelism
# (the tensors TP would replicate are split along the sequence), else 1; e = bytes per
# activation element (2 for bf16/fp16, 4 for fp32); masks are 1 byte per element.


def _tokens(c: Candidate) -> float:
    return c.seq_length * c.micro_batch / c.cp


def _sp(c: Candidate) -> int:
    return c.tp if c.layout.sequence_parallel else 1


def _linear_input_bytes(c: Candidate) -> int:
    """Bytes per element of a linear layer's saved input: with FP8, Transformer Engine keeps
    the quantized FP8 copy it ran the GEMM on (1 byte) for the weight gradient; else e."""
    return 1 if c.fp8 else c.act_bytes


def norm_activation_bytes(c: Candidate) -> float:
    """Inputs of the two norms: 2 e T h / z (paper: 4sbh)."""
    return 2 * c.act_bytes * _tokens(c) * c.model.hidden_size / _sp(c)


def attention_activation_bytes(c: Candidate) -> float:
    """Attention except the s x s scores: QKV input q T h / z + Q, K, V e T (n d + 2 g d) / t
    + output-projection input q T n d / t + dropout mask T h / z (if dropout); q = e, or 1
    for the FP8 copies TE keeps of linear inputs (_linear_input_bytes).
    Paper (MHA, e=2): 2sbh + 6sbh/t + 2sbh/t + sbh = 11sbh at t=1."""
    m, e, T, q = c.model, c.act_bytes, _tokens(c), _linear_input_bytes(c)
    if m.multi_latent_attention:
        return mla_activation_bytes(c)
    nd, gd = m.num_attention_heads * m.head_dim, m.query_groups * m.head_dim
    count = q * T * m.hidden_size / _sp(c) + e * T * (nd + 2 * gd) / c.tp + q * T * nd / c.tp
    if c.dropout:
        count += T * m.hidden_size / _sp(c)
    return count


def mla_activation_bytes(c: Candidate) -> float:
    """Multi-latent attention except the scores, as Megatron-Core's MLASelfAttention on the te
    spec saves it: the down projections' shared input q T h / z; per latent (q: q_lora, only with
    q_lora_rank; kv: kv_lora) its norm's input e T r / z and the up projection's input q T r / z
    (TE's LayerNormColumnParallelLinear keeps both, the local shard under SP); after the up
    projections and RoPE the core attention's Q and K, e T n (dq + dr) / t each (the shared RoPE
    key expanded to every head), and V, e T n dv / t; the output projection's input q T n dv / t
    (the attention output); dropout mask T h / z (if dropout). RoPE's backward needs only its
    cos / sin tables, so the pre-RoPE q / k and the kv down projection's output are not kept."""
    m, e, T, q, z = c.model, c.act_bytes, _tokens(c), _linear_input_bytes(c), _sp(c)
    n = m.num_attention_heads
    latents = m.kv_lora_rank + (m.q_lora_rank or 0)
    count = q * T * m.hidden_size / z + (e + q) * T * latents / z
    count += e * T * n * (2 * m.q_head_dim + m.v_head_dim) / c.tp + q * T * n * m.v_head_dim / c.tp
    if c.dropout:
        count += T * m.hidden_size / z
    return count


def score_activation_bytes(c: Candidate) -> float:
    """Core attention. Unfused: softmax output e b (n/t) (s/c) s, plus with dropout its
    mask b (n/t) (s/c) s and output e b (n/t) (s/c) s (paper: 5as^2b/t).
    Flash attention keeps no s x s matrix, only the fp32 log-sum-exp 4 b (n/t) (s/c).
    (Selective recompute drops this term: see layer_activation_bytes.)"""
    rows = c.micro_batch * (c.model.num_attention_heads / c.tp) * (c.seq_length / c.cp)
    if c.flash_attention:
        return 4 * rows
    per = c.act_bytes + (1 + c.act_bytes if c.dropout else 0)
    return per * rows * c.seq_length


def _mlp_inputs_bytes(c: Candidate, ffn: int, split: int) -> float:
    """Activation-function input e T f (2 if gated else 1) / split + fc2 input q T f / split
    (q: _linear_input_bytes)."""
    act = c.act_bytes * (2 if c.model.gated else 1) + _linear_input_bytes(c)
    return _tokens(c) * ffn * act / split


def mlp_activation_bytes(c: Candidate) -> float:
    """Dense MLP: fc1 input q T h / z + activation input e T f (2 if gated else 1) / t + fc2
    input q T f / t + dropout mask T h / z (q: _linear_input_bytes).
    Paper (f=4h, GeLU, e=2): 2sbh + 16sbh/t + sbh = 19sbh."""
    m, T = c.model, _tokens(c)
    count = _linear_input_bytes(c) * T * m.hidden_size / _sp(c) + _mlp_inputs_bytes(c, m.ffn_hidden_size, c.tp)
    if c.dropout:
        count += T * m.hidden_size / _sp(c)
    return count


def moe_activation_bytes(c: Candidate) -> float:
    """MoE MLP (dropless, balanced routing): router input e T h / z + fp32 router logits
    4 T E / z; each rank then processes k T / z routed tokens on average, each storing its
    permuted fc1 input q h, activation input e f_e (2 if gated else 1) / ETP, fc2 input
    q f_e / ETP and its fp32 routing probability (4 bytes); q = 1 under FP8 (TE's GroupedLinear
    keeps the FP8 inputs it ran on, as Linear does: _linear_input_bytes) else e
    + shared expert e T f_s (3 if gated else 2) / t + dropout mask T h / z.
    No expert output is kept: Megatron-Core 0.19 multiplies the probabilities in inside the
    experts' activation (experts.py, bias_act_func / weighted_bias_swiglu_impl with
    permuted_probs) and the all-to-all dispatcher's unpermute gets no probs (token_dispatcher.py,
    MoEAlltoAllTokenDispatcher.token_unpermutation), so the combine is a plain scatter-add."""
    m, e, T, z = c.model, c.act_bytes, _tokens(c), _sp(c)
    h, fe, q = m.hidden_size, m.expert_ffn_hidden_size, _linear_input_bytes(c)
    routed = m.moe_router_topk * T / z
    count = e * T * h / z + 4 * T * m.num_experts / z
    count += routed * (q * h + (e * (2 if m.gated else 1) + q) * fe / c.etp + 4)
    if m.moe_shared_expert_hidden_size:
        count += _mlp_inputs_bytes(c, m.moe_shared_expert_hidden_size, c.tp)
    if c.dropout:
        count += T * h / z
    return count


def full_layer_activation_bytes(c: Candidate, moe: bool | None = None) -> float:
    """One layer, nothing recomputed: norms + attention + scores + (MoE) MLP (`moe`: the kind
    of layer, None = the model's).
    Paper: sbh (34 + 5as/h) without TP; sbh (10 + 24/t + 5as/(ht)) with TP;
    sbh/t (34 + 5as/h) with TP + SP."""
    moe = c.model.is_moe if moe is None else moe
    mlp = moe_activation_bytes(c) if moe else mlp_activation_bytes(c)
    return (norm_activation_bytes(c) + attention_activation_bytes(c)
            + score_activation_bytes(c) + mlp)


def layer_activation_bytes(c: Candidate, moe: bool | None = None) -> float:
    """What one layer keeps per in-flight microbatch (`moe`: the kind of layer):
    none: full_layer_activation_bytes; selective: the same without the score term
    (paper: 34sbh/t with SP); full: only the layer input e T h / z (paper: 2sbh/t)."""
    if c.recompute == "full":
        return c.act_bytes * _tokens(c) * c.model.hidden_size / _sp(c)
    full = full_layer_activation_bytes(c, moe)
    if c.recompute == "selective":
        return full - score_activation_bytes(c)
    return full


def recompute_working_bytes(c: Candidate) -> float:
    """Full recompute re-runs one layer's forward inside its backward, so one layer's
    full activations (full_layer_activation_bytes) exist at a time; 0 otherwise."""
    if c.recompute != "full":
        return 0.0
    if mixed_layers(c.model):  # the larger kind of layer
        return max(full_layer_activation_bytes(c, False), full_layer_activation_bytes(c, True))
    return full_layer_activation_bytes(c)


def embedding_activation_bytes(c: Candidate) -> float:
    """First stage: the embedding's dropout mask T h / z per microbatch (0 without dropout;
    its output is the first layer's norm input, counted there)."""
    return _tokens(c) * c.model.hidden_size / _sp(c) if c.dropout else 0.0


def output_activation_bytes(c: Candidate) -> float:
    """Last stage, one microbatch (its backward starts right after its forward): final norm
    input e T h / z + output-layer input e T h / z + fp32 logits in the vocab-parallel
    cross entropy 4 T V / t. Paper (e=2, SP): 4sbh/t (1 + V/h)."""
    m, e, T = c.model, c.act_bytes, _tokens(c)
    return 2 * e * T * m.hidden_size / _sp(c) + 4 * T * m.padded_vocab_size / c.tp


def inflight_chunks(c: Candidate, stage: int) -> int:
    """(microbatch, model chunk) pairs whose activations pipeline rank `stage` holds at the
    peak; each chunk is L/(p v) layers.
      no pipeline (p=1): 1 (gradient accumulation runs one microbatch at a time);
      1F1B: min(p - stage, M) - stage 0 holds p microbatches of L/p layers = L layers;
      interleaved 1F1B: min(2 (p - stage - 1) + (v - 1) p + 1, M v) (Megatron's warmup
      count + 1) - stage 0 holds L (1 + (p - 1)/(p v)) layers, as in the paper."""
    p, v, m = c.pp, c.vpp, c.num_microbatches
    if p == 1:
        return 1
    if v == 1:
        return min(p - stage, m)
    return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)


def activation_bytes(c: Candidate, stage: int) -> float:
    """Activations on pipeline rank `stage` at its peak:
    inflight_chunks x L/(p v) x layer_activation_bytes + recompute_working_bytes
    + [stage 0] ceil(inflight / v) x embedding_activation_bytes
    + [stage p-1] output_activation_bytes."""
    chunks = inflight_chunks(c, stage)
    # With embedding_loss_in_split the edge stages' chunks average slightly fewer layers; with
    # dense layers among MoE ones (moe_layer_freq) a chunk holds the stage's average layer.
    layers_per_chunk = c.layers_on_stage(stage) / c.vpp
    per_layer = layer_activation_bytes(c)
    if mixed_layers(c.model):
        kinds = stage_layer_kinds(c, stage)
        per_layer = sum(n * layer_activation_bytes(c, moe) for n, moe in kinds) / sum(n for n, _ in kinds)
    total = chunks * layers_per_chunk * per_layer + recompute_working_bytes(c)
    if stage == 0:
        total += -(-chunks // c.vpp) * embedding_activation_bytes(c)
    if stage == c.pp - 1:
        total += output_activation_bytes(c) + mtp_activation_bytes(c)
    return total


def mtp_activation_bytes(c: Candidate) -> float:
    """Last stage, one microbatch: per multi-token prediction layer its two norms' inputs and
    the projection's 2h input (e T h / z each, 4 in all), one layer like the decoder's last,
    and the output layer and loss again (output_activation_bytes). An estimate: the 1% check
    against Megatron-Core covers static memory, not activations."""
    m = c.model
    if not m.mtp_num_layers:
        return 0.0
    per_layer = (4 * c.act_bytes * _tokens(c) * m.hidden_size / _sp(c)
                 + layer_activation_bytes(c, mtp_layer_is_moe(m)) + output_activation_bytes(c))
    return m.mtp_num_layers * per_layer


# --------------------------------------------------------------------------------------
# Overhead and the total


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryOptions:
    # CUDA context, NCCL communicators and their buffers, cuBLAS / Transformer Engine
    # workspaces: not tensors the model allocates, but they take device memory.
    framework_gib: float = 3.0
    # Caching-allocator fragmentation and short-lived temporaries (SP all-gathers,
    # cross-entropy scratch), as a fraction of the activation memory.
    fragmentation: float = 0.10

    def __post_init__(self) -> None:
        if not (self.framework_gib >= 0 and self.fragmentation >= 0):  # also refuses NaN
            raise ValueError(f"framework_gib={self.framework_gib:g} and fragmentation={self.fragmentation:g} "
                             "must be >= 0")


def overhead_bytes(activations: float, options: MemoryOptions) -> float:
    """framework_gib x 2^30 + fragmentation x activations."""
    return options.framework_gib * GIB + options.fragmentation * activations


def sharding_buffer_bytes(c: Candidate) -> float:
    """Megatron-FSDP's temporary all-gather / reduce-scatter buckets at their peak under
    ZeRO-2/3 (formula: launch.planner.fsdp_buckets.sharding_buffer_bytes); 0 otherwise."""
    return _fsdp_sharding_buffer_bytes(c) if c.fsdp else 0.0


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    stage: int  # pipeline rank this breakdown is for
    params: float
    grads: float
    main_params: float
    optimizer_states: float
    activations: float
    overhead: float  # framework allowance + fragmentation
    sharding_buffers: float = 0.0  # Megatron-FSDP's temporary gather / reduce-scatter buckets
    fp8_buffers: float = 0.0  # Transformer Engine's cached FP8 weights and amax histories
    host: float = 0.0  # host memory per GPU (CPU offload); not part of total

    @property
    def static(self) -> float:
        return self.params + self.grads + self.main_params + self.optimizer_states

    @property
    def total(self) -> float:
        """GPU memory: static + activations + overhead + sharding buffers + FP8 weight copies."""
        return self.static + self.activations + self.overhead + self.sharding_buffers + self.fp8_buffers

    def terms(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "main params": self.main_params,
                "optimizer": self.optimizer_states, "activations": self.activations,
                "overhead": self.overhead, "FSDP buffers": self.sharding_buffers,
                "FP8 weights": self.fp8_buffers}

    def describe(self) -> str:
        """'params 14.9 + grads 29.9 + ... = 81.2 GiB (stage 0)'."""
        parts = " + ".join(f"{k} {v / GIB:.1f}" for k, v in self.terms().items() if v)
        host = f", host {self.host / GIB:.1f} GiB" if self.host else ""
        return f"{parts} = {self.total / GIB:.1f} GiB (pipeline stage {self.stage}){host}"


def memory_on_stage(c: Candidate, stage: int, options: MemoryOptions = MemoryOptions(),
                    slices: tuple[int, int] = (0, 0)) -> MemoryBreakdown:
    """Every term for pipeline rank `stage` (and, under ZeRO-2/3, the rank whose index in its
    dense / expert shard group is `slices`; default the fullest)."""
    acts = activation_bytes(c, stage)
    return MemoryBreakdown(
        stage=stage,
        params=param_bytes(c, stage),
        grads=grad_bytes(c, stage),
        main_params=main_param_bytes(c, stage),
        optimizer_states=optimizer_state_bytes(c, stage, slices),
        activations=acts,
        overhead=overhead_bytes(acts, options),
        sharding_buffers=sharding_buffer_bytes(c),
        fp8_buffers=fp8_buffer_bytes(c, stage),
        host=host_bytes(c, stage),
    )


def peak_memory(c: Candidate, options: MemoryOptions = MemoryOptions()) -> MemoryBreakdown:
    """The pipeline rank that needs the most memory (usually stage 0: most microbatches in
    flight; sometimes the last: output layer and logits)."""
    return max((memory_on_stage(c, s, options) for s in edge_stages(c)), key=lambda b: b.total)


def edge_stages(c: Candidate) -> tuple[int, ...]:
    """Stages that can be the largest: a middle stage holds no more parameters than stage 0
    (which adds the embedding) and no more microbatches in flight, so only the first and
    the last stage need evaluating. With uneven stages (the embedding and loss counted, or the
    first/last stage's own count) a middle stage can hold more layers than either edge, so
    stage 1 (every middle stage holds the same) is evaluated too."""
    if c.pp == 1:
        return (0,)
    if mixed_layers(c.model):
        # Dense layers (moe_layer_freq) make the stages that hold them lighter: any stage can be
        # the fullest. Of the middle stages holding the same layer kinds, the earliest holds as
        # many parameters, does as much work and keeps the most microbatches in flight, so only
        # it is evaluated (PP16 of DeepSeek-V3: 3 stages, not 16).
        kinds = [tuple(stage_layer_kinds(c, s)) for s in range(c.pp)]
        return tuple(s for s in range(c.pp) if s in (0, c.pp - 1) or kinds[s] not in kinds[1:s])
    if c.layout.uneven_pipeline and c.pp > 2:
        return (0, 1, c.pp - 1)
    return (0, c.pp - 1)
