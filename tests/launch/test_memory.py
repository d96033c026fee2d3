"""Each memory term against values computed by hand for small configs, and the activation
terms against the formulas of Korthikanti et al. (2022) under the paper's assumptions."""

from __future__ import annotations

import dataclasses

import pytest

from launch.planner.candidate import Candidate
from launch.planner.fsdp_buckets import (
    COMM_UNIT_ELEMENTS,
    chunk_size_factor,
    embedding_parameters,
    fsdp_buckets,
    layer_parameters,
    output_parameters,
)
from launch.planner.memory import (
    MemoryOptions,
    activation_bytes,
    attention_activation_bytes,
    dense_layer_params_on_rank,
    embedding_params_on_rank,
    expert_layer_params_on_rank,
    full_layer_activation_bytes,
    grad_bytes,
    host_bytes,
    inflight_chunks,
    layer_activation_bytes,
    main_param_bytes,
    memory_on_stage,
    mlp_activation_bytes,
    moe_activation_bytes,
    norm_activation_bytes,
    optimizer_state_bytes,
    output_activation_bytes,
    output_params_on_rank,
    overhead_bytes,
    param_bytes,
    params_on_rank,
    peak_memory,
    recompute_working_bytes,
    score_activation_bytes,
    sharding_buffer_bytes,
    tp_replicated_layer_params,
)
from models.config import ModelConfig
from models.layout import ParallelLayout
from pretrain.recipes import get_recipe

# h=8, 2 heads of d=4, 1 KV group, SwiGLU f=16, V=128: per layer attention 8*(8+8) + 8*8 =
# 192, MLP 8*32 + 16*8 = 384, norms 2*8 -> 592.
LLAMA = ModelConfig(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                    num_query_groups=1, vocab_size=128, max_seq_length=16)
# GPT style: biases, LayerNorm (weight + bias), GeLU f=32, learned positions, tied.
GPT = ModelConfig(num_layers=2, hidden_size=8, ffn_hidden_size=32, num_attention_heads=2, vocab_size=128,
                  max_seq_length=16, normalization="LayerNorm", activation="gelu",
                  position_embedding="learned_absolute", add_bias_linear=True, add_qkv_bias=True,
                  tie_embeddings=True)
# 4 SwiGLU experts of f_e=8 (8*16 + 8*8 = 192 each), router 8*4 = 32.
MOE = LLAMA.model_copy(update=dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8))


def cand(model=LLAMA, *, world=1, mbs=2, gbs=None, seq=16, dtype="bf16", zero=1, recompute="none",
         flash=False, dropout=False, hsdp=1, offload=False, **layout) -> Candidate:
    lay = ParallelLayout(**layout)
    return Candidate(model=model, layout=lay, world_size=world, micro_batch=mbs,
                     global_batch=gbs or mbs * lay.data_parallel(world), seq_length=seq, dtype=dtype,
                     recompute=recompute, zero=zero, hsdp_replicas=hsdp, offload=offload,
                     flash_attention=flash, dropout=dropout)


def test_parameters_per_rank_dense():
    assert tp_replicated_layer_params(LLAMA) == 16
    assert dense_layer_params_on_rank(LLAMA, 1) == 592
    assert dense_layer_params_on_rank(LLAMA, 2) == 16 + 576 // 2
    assert embedding_params_on_rank(LLAMA, 2) == 128 * 8 // 2
    assert output_params_on_rank(LLAMA, 2, 1) == 8 + 1024 // 2
    c = cand(world=8, tensor_parallel=2, pipeline_parallel=2)
    assert params_on_rank(c, 0).total == 304 + 512  # one layer + embedding
    assert params_on_rank(c, 1).total == 304 + 520  # one layer + final norm + output layer


def test_parameters_per_rank_biases_positions_tied():
    # attention 8*24 + 8*8 + 24 + 8 = 288, MLP 8*32 + 32*8 + 32 + 8 = 552, LayerNorms 2*16 -> 872;
    # replicated: LayerNorms 32 + proj bias 8 + fc2 bias 8 = 48.
    assert tp_replicated_layer_params(GPT) == 48
    assert dense_layer_params_on_rank(GPT, 2) == 48 + (872 - 48) // 2
    assert embedding_params_on_rank(GPT, 2) == 1024 // 2 + 16 * 8  # positions are not split
    assert output_params_on_rank(GPT, 2, 1) == 16  # tied, PP=1: just the final LayerNorm
    assert output_params_on_rank(GPT, 2, 2) == 16 + 512  # tied, PP>1: the last stage's copy


def test_parameters_per_rank_moe():
    assert expert_layer_params_on_rank(MOE, 2, 1) == 2 * 192
    assert expert_layer_params_on_rank(MOE, 2, 2) == 2 * 96
    # dense part: norms 16 + router 32 replicated; attention 192 split.
    assert dense_layer_params_on_rank(MOE, 2) == 48 + 192 // 2
    c = cand(MOE, world=8, tensor_parallel=2, expert_parallel=2)
    p = params_on_rank(c, 0)
    assert (p.dense, p.expert) == (2 * 144 + 512 + 520, 2 * 192)
    assert (c.dense_shard, c.expert_shard) == (4, 2)
    # Adam moments: 8 bytes x (dense / 4 + expert / 2).
    assert optimizer_state_bytes(c, 0) == 8 * (1320 / 4 + 384 / 2)


def test_static_bytes_zero0_and_zero1():
    c = cand(world=8, tensor_parallel=2, pipeline_parallel=2)  # DP=2, bf16
    P = 816
    assert param_bytes(c, 0) == 2 * P
    assert grad_bytes(c, 0) == 4 * P  # fp32 grad buffer, not sharded under ZeRO-1
    assert main_param_bytes(c, 0) == 4 * P / 2
    assert optimizer_state_bytes(c, 0) == 8 * P / 2
    zero0 = dataclasses.replace(c, zero=0)
    assert main_param_bytes(zero0, 0) == 4 * P
    assert optimizer_state_bytes(zero0, 0) == 8 * P
    fp32 = cand(world=8, tensor_parallel=2, pipeline_parallel=2, dtype="fp32")
    assert param_bytes(fp32, 0) == 4 * P
    assert main_param_bytes(fp32, 0) == 0  # fp32 params are their own master copy
    assert memory_on_stage(zero0, 0).optimizer_states == 8 * P
    assert memory_on_stage(cand(world=8, tensor_parallel=2, pipeline_parallel=2, zero=0), 0).main_params == 4 * P


# Korthikanti et al. assume MHA, f = 4h, GeLU, 16-bit activations, dropout, no flash
# attention: per layer sbh (34 + 5as/h); TP: sbh (10 + 24/t + 5as/(ht)); TP+SP: sbh/t (34 +
# 5as/h); selective (+SP): 34 sbh/t; full: 2 sbh (/t with SP).
PAPER = ModelConfig(num_layers=4, hidden_size=8, ffn_hidden_size=32, num_attention_heads=2, vocab_size=128,
                    max_seq_length=16, activation="gelu", normalization="LayerNorm")
S, B, H, A = 16, 2, 8, 2
SBH = S * B * H


def paper(**kw) -> Candidate:
    return cand(PAPER, mbs=B, seq=S, dropout=True, flash=False, **kw)


def test_activation_per_layer_matches_paper_without_parallelism():
    c = paper()
    assert norm_activation_bytes(c) == 4 * SBH
    assert attention_activation_bytes(c) == 11 * SBH
    assert score_activation_bytes(c) == 5 * A * S * S * B
    assert mlp_activation_bytes(c) == 19 * SBH
    assert full_layer_activation_bytes(c) == SBH * (34 + 5 * A * S / H)


@pytest.mark.parametrize("t", [2, 4])
def test_activation_per_layer_matches_paper_with_tp(t):
    world = t
    assert layer_activation_bytes(paper(world=world, tensor_parallel=t)) == pytest.approx(
        SBH * (10 + 24 / t + 5 * A * S / (H * t)))
    sp = dict(world=world, tensor_parallel=t, sequence_parallel=True)
    assert layer_activation_bytes(paper(**sp)) == pytest.approx(SBH / t * (34 + 5 * A * S / H))
    assert layer_activation_bytes(paper(recompute="selective", **sp)) == pytest.approx(34 * SBH / t)
    assert layer_activation_bytes(paper(recompute="full", **sp)) == pytest.approx(2 * SBH / t)
    assert layer_activation_bytes(paper(recompute="full", world=world, tensor_parallel=t)) == 2 * SBH


def test_activation_gqa_swiglu_flash_and_cp():
    # LLAMA: n d = 8, g d = 4, f = 16 (SwiGLU: activation input 2f), bf16, no dropout, flash.
    c = cand(LLAMA, mbs=2, seq=16, flash=True)
    T = 32
    assert attention_activation_bytes(c) == 2 * T * (8 + (8 + 8) + 8)
    assert mlp_activation_bytes(c) == 2 * T * (8 + 32 + 16)
    assert score_activation_bytes(c) == 4 * 2 * 2 * 16  # fp32 log-sum-exp per (batch, head, query)
    cp = cand(LLAMA, world=2, mbs=2, seq=16, flash=True, context_parallel=2)
    assert layer_activation_bytes(cp) == pytest.approx(layer_activation_bytes(c) / 2)


def test_moe_activation_hand_computed():
    c = cand(MOE, mbs=1, seq=16, flash=True)
    T, e, h, k, fe = 16, 2, 8, 2, 8
    # per routed token: fc1 input e h, SwiGLU input 2 e f_e, fc2 input e f_e, fp32 probability
    expected = e * T * h + 4 * T * 4 + k * T * (e * h + e * fe * 3 + 4)
    assert moe_activation_bytes(c) == expected
    # FP8: TE's GroupedLinear keeps the FP8 inputs of fc1 and fc2 (1 byte each)
    fp8 = dataclasses.replace(c, fp8=True, fp8_recipe="tensorwise")
    assert moe_activation_bytes(fp8) == e * T * h + 4 * T * 4 + k * T * (h + 2 * e * fe + fe + 4)


def test_output_and_recompute_working_set():
    c = cand(LLAMA, mbs=2, seq=16, world=2, tensor_parallel=2, sequence_parallel=True)
    T = 32
    assert output_activation_bytes(c) == 2 * 2 * T * 8 / 2 + 4 * T * 128 / 2
    full = cand(LLAMA, mbs=2, seq=16, recompute="full")
    assert recompute_working_bytes(full) == full_layer_activation_bytes(full)
    assert recompute_working_bytes(cand(LLAMA)) == 0


def test_inflight_microbatches_1f1b_and_interleaved():
    deep = LLAMA.model_copy(update=dict(num_layers=8))
    one_f_one_b = cand(deep, world=4, gbs=16, mbs=2, pipeline_parallel=4)  # M = 8
    assert [inflight_chunks(one_f_one_b, s) for s in range(4)] == [4, 3, 2, 1]
    few = cand(deep, world=4, gbs=4, mbs=2, pipeline_parallel=4)  # M = 2 < p
    assert inflight_chunks(few, 0) == 2
    inter = cand(deep, world=4, gbs=16, mbs=2, pipeline_parallel=4, virtual_pipeline=2)
    # stage 0: 2(p-1) + (v-1)p + 1 = 11 chunks of L/(pv) = 1 layer = L (1 + (p-1)/(pv)) layers.
    assert inflight_chunks(inter, 0) == 11
    assert inflight_chunks(inter, 0) * 1 == pytest.approx(8 * (1 + 3 / 8))
    assert inflight_chunks(cand(deep, gbs=16, mbs=2), 0) == 1  # no pipeline: one at a time


def test_stage_activations_and_peak():
    deep = LLAMA.model_copy(update=dict(num_layers=8))
    c = cand(deep, world=4, gbs=16, mbs=2, pipeline_parallel=4, flash=True)
    per_layer = layer_activation_bytes(c)
    assert activation_bytes(c, 0) == 4 * 2 * per_layer  # 4 microbatches x 2 layers
    assert activation_bytes(c, 3) == 1 * 2 * per_layer + output_activation_bytes(c)
    peak = peak_memory(c, MemoryOptions(framework_gib=0, fragmentation=0))
    stages = [memory_on_stage(c, s, MemoryOptions(framework_gib=0, fragmentation=0)).total for s in range(4)]
    assert peak.total == max(stages)


def test_overhead():
    opts = MemoryOptions(framework_gib=2.0, fragmentation=0.25)
    assert overhead_bytes(4e9, opts) == 2 * 2**30 + 1e9


# --------------------------------------------------------------------------------------
# ZeRO-2/3 (Megatron-FSDP buckets), HSDP, offload


@pytest.mark.parametrize("model", [LLAMA, GPT, MOE], ids=["llama", "gpt", "moe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_fsdp_parameter_shapes_add_up_to_the_flops_counts(model, tp):
    dense, expert = layer_parameters(model, tp, ep=2 if model.is_moe else 1, etp=tp)
    assert sum(n for n, _ in dense) == dense_layer_params_on_rank(model, tp)
    assert sum(n for n, _ in expert) == expert_layer_params_on_rank(model, 2 if model.is_moe else 1, tp)
    assert sum(n for n, _ in embedding_parameters(model, tp)) == embedding_params_on_rank(model, tp)
    for pp in (1, 2):
        assert sum(n for n, _ in output_parameters(model, tp, pp)) == output_params_on_rank(model, tp, pp)


def test_chunk_size_factor_follows_megatron_fsdp():
    # tiny-llama's layer (h=128, f=352): fc2 rows of 352 do not tile the 128-wide rows -> lcm 1408.
    tiny = ModelConfig(num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                       num_query_groups=2, vocab_size=4096, max_seq_length=256)
    assert chunk_size_factor(layer_parameters(tiny, 1, 1, 1)[0]) == 1408
    # LLAMA: fc2 rows of 16 come first; 8-wide rows tile 16 when their size is a multiple of it.
    assert chunk_size_factor(layer_parameters(LLAMA, 1, 1, 1)[0]) == 16
    assert chunk_size_factor([(24, 8), (8, 1)]) == 8  # 1-D parameters never widen the chunk
    assert chunk_size_factor([(64, 16), (24, 12)]) == 48  # 12 neither equals nor tiles 16


def test_zero2_zero3_static_bytes_hand_computed():
    """LLAMA, bf16, DP4. Layer bucket: 592 elements, chunk 16 -> padded to a multiple of 4 x 16:
    640; the rest (embedding 1024 + final norm 8 + output 1024 = 2056, chunk 8) -> 2080.
    ZeRO-3: each rank holds (2 x 640 + 2080) / 4 = 840 elements of every buffer. ZeRO-2: one
    bucket of 3240, chunk 16 -> 3264 whole for the weights, 816 per rank for the rest."""
    z3 = cand(world=4, zero=3)
    assert [(b.numel, b.chunk, b.padded(4)) for b in fsdp_buckets(z3)] == [(592, 16, 640)] * 2 + [(2056, 8, 2080)]
    assert (param_bytes(z3, 0), grad_bytes(z3, 0), main_param_bytes(z3, 0), optimizer_state_bytes(z3, 0)) == (
        2 * 840, 4 * 840, 4 * 840, 8 * 840)
    z2 = cand(world=4, zero=2)
    assert [(b.numel, b.chunk, b.padded(4)) for b in fsdp_buckets(z2)] == [(3240, 16, 3264)]
    assert (param_bytes(z2, 0), grad_bytes(z2, 0), main_param_bytes(z2, 0), optimizer_state_bytes(z2, 0)) == (
        2 * 3264, 4 * 816, 4 * 816, 8 * 816)
    # fp32 parameters: no separate main weights (megatron_fsdp_main_params_dtype=None).
    assert main_param_bytes(cand(world=4, zero=3, dtype="fp32"), 0) == 0
    # Adam's moments cover parameters, not padding: the last rank's slices hold 592 - 3 x 160
    # of each layer bucket and 2056 - 3 x 520 of the rest.
    assert optimizer_state_bytes(z3, 0, slices=(3, 0)) == 8 * (2 * 112 + 496)


def test_zero3_is_the_textbook_math_at_scale():
    """llama3-8b on 8 GPUs, ZeRO-3, bf16: 2 bytes of weights, 4 of fp32 gradients, 4 of fp32
    main weights and 8 of Adam moments per parameter, all divided by 8; padding adds < 0.02%."""
    params = 8_030_261_248
    c = dataclasses.replace(Candidate.from_config(get_recipe("llama3-8b"), 8), layout=ParallelLayout(), zero=3)
    b = memory_on_stage(c, 0)
    assert b.static == pytest.approx(18 * params / 8, rel=2e-4)
    assert (b.params, b.grads, b.main_params, b.optimizer_states) == pytest.approx(
        (2 * params / 8, 4 * params / 8, 4 * params / 8, 8 * params / 8), rel=2e-4)


def test_hsdp_shards_over_the_replica_group_only():
    hsdp = cand(world=8, zero=3, hsdp=2)  # shard groups of 4, 2 replicas
    assert (hsdp.dense_zero_shard, hsdp.dp) == (4, 8)
    a, b = memory_on_stage(hsdp, 0), memory_on_stage(cand(world=4, zero=3), 0)
    assert (a.params, a.grads, a.main_params, a.optimizer_states) == (b.params, b.grads, b.main_params,
                                                                      b.optimizer_states)


def test_offload_moves_main_weights_and_moments_to_the_host():
    on, off = cand(world=4, zero=1, offload=True), cand(world=4, zero=1)
    assert (main_param_bytes(on, 0), optimizer_state_bytes(on, 0)) == (0, 0)
    assert (param_bytes(on, 0), grad_bytes(on, 0)) == (param_bytes(off, 0), grad_bytes(off, 0))
    P = 3240
    assert host_bytes(on, 0) == 16 * P / 4  # main weights, gradients, two moments: fp32 each
    assert host_bytes(cand(world=4, zero=0, offload=True), 0) == 16 * P  # ZeRO-0: every rank steps all
    assert host_bytes(cand(world=4, zero=3, offload=True), 0) == 16 * 840
    assert memory_on_stage(on, 0).host == host_bytes(on, 0)
    assert memory_on_stage(on, 0).total < memory_on_stage(off, 0).total


def test_sharding_buffers():
    """Megatron-FSDP's temporary buckets. Small models (every bucket below the 1e9-element
    communication unit): every unsharded fp32 gradient bucket waits in the reduce-scatter
    queue (ZeRO-2: 4 bytes x all buckets); under ZeRO-3 the peak is at the start of backward
    (all parameters gathered, the root and last layer's gradients allocated) or at its end
    (layers released, every gradient queued). Large: the cap plus the largest buckets."""
    z3 = cand(world=4, zero=3)  # padded buckets: layers 640, 640; embedding + output 2080
    start = 2 * (2080 + 640 + 640) + 4 * (2080 + 640)
    end = 2 * 2080 + 4 * 3360
    assert sharding_buffer_bytes(z3) == max(start, end) == 17600
    assert sharding_buffer_bytes(cand(world=4, zero=2)) == 4 * 3264
    assert sharding_buffer_bytes(cand(world=4, zero=1)) == 0
    big = dataclasses.replace(Candidate.from_config(get_recipe("llama3-8b"), 8), layout=ParallelLayout(), zero=3)
    buckets = fsdp_buckets(big)
    assert len(buckets) == 33  # 32 layers + embedding and output together
    unit = max(b.padded(8) for b in buckets if b.unit)
    root = sum(b.padded(8) for b in buckets if not b.unit)
    gathered = root + COMM_UNIT_ELEMENTS / 2 + unit  # the cap binds: 32 layers exceed it
    assert sharding_buffer_bytes(big) == max(2 * gathered + 4 * (root + unit),
                                             2 * root + 4 * (COMM_UNIT_ELEMENTS + root + unit))
