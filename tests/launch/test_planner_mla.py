"""The planner for DeepSeek-V3-style models: multi-latent attention, dense layers among MoE
layers (moe_layer_freq), shared experts. The static terms are checked against Megatron-Core's
allocations in test_memory_measured.py (tiny-deepseek, TP2 / PP2 / EP2); here: the per-rank
counts by hand, their sums against models.flops (the one source of parameter counts and FLOPs),
the tensors Megatron-FSDP's bucket model and Muon's model list, and plans that our training's
validation accepts (ZeRO-2/3, Muon and Lion included)."""

from __future__ import annotations

import dataclasses

import pytest

from launch.planner.candidate import Candidate
from launch.planner import muon
from launch.planner.devices import get_device
from launch.planner.fsdp_buckets import fsdp_buckets, layer_parameters
from launch.planner.layers import mla_weights, moe_layers_on_stage
from launch.planner.memory import (
    dense_layer_params_on_rank,
    edge_stages,
    expert_layer_params_on_rank,
    mla_activation_bytes,
    memory_on_stage,
    mla_replicated_params,
    params_on_rank,
    peak_memory,
)
from launch.planner.search import SearchSpace, plan
from launch.planner.throughput import ThroughputOptions, stage_compute_s
from models.config import get_flavor
from models.flops import mla_attention_params, mtp_params, total_params, training_flops_per_token
from models.layout import ParallelLayout
from pretrain.config import validate_for_world
from pretrain.recipes import get_recipe

H100 = get_device("h100-80gb")
TINY = get_flavor("tiny-deepseek")  # h 128, 8 heads, q_lora 64, kv_lora 32, dq 16 + dr 8, dv 16
V3 = get_flavor("deepseek-v3")


def _cand(model, world: int, te: bool = True, **layout) -> Candidate:
    return Candidate(model=model, layout=ParallelLayout(**layout), world_size=world, micro_batch=1,
                     global_batch=world * 4, seq_length=4096, flash_attention=te)


def test_mla_tp_split_follows_the_spec():
    """te: the down projections (TELinear, duplicated) and the latent norms are whole on every
    TP rank; portable: only the latent norms (its down projections are column-parallel)."""
    # q_down 128 x 64 + kv_down 128 x (32 + 8) + norms 64 + 32
    assert mla_replicated_params(TINY, te=True) == 8192 + 5120 + 96
    assert mla_replicated_params(TINY, te=False) == 96
    # MoE layer at TP2: replicated = 2 norms 256 + MLA's + router 128 x 8; split: the rest of MLA
    # (q_up 64 x 8 x 24, kv_up 32 x 8 x 32, out 8 x 16 x 128) + the shared expert 3 x 128 x 64.
    assert dense_layer_params_on_rank(TINY, 2, moe=True, te=True) == 256 + 13408 + 1024 + (36864 + 24576) // 2
    assert dense_layer_params_on_rank(TINY, 2, moe=True, te=False) == 256 + 96 + 1024 + (50176 + 24576) // 2
    # The dense layer: no router, its 256-wide MLP (3 x 128 x 256) instead of the shared expert.
    assert dense_layer_params_on_rank(TINY, 2, moe=False, te=True) == 256 + 13408 + (36864 + 98304) // 2
    assert expert_layer_params_on_rank(TINY, 2, 1) == 4 * 3 * 128 * 32


def test_moe_layers_per_stage_follow_megatrons_layer_order():
    """tiny-deepseek is dense, MoE, MoE, MoE. PP2: stage 0 holds layers 0-1. PP2 x VPP2: chunk v
    of rank r holds layer 2v + r, so stage 0 holds layers 0 and 2."""
    pp2 = _cand(TINY, 2, pipeline_parallel=2)
    assert [moe_layers_on_stage(pp2, s) for s in range(2)] == [1, 2]
    vpp = _cand(TINY, 2, pipeline_parallel=2, virtual_pipeline=2)
    assert [moe_layers_on_stage(vpp, s) for s in range(2)] == [1, 2]
    recipe = Candidate.from_config(get_recipe("deepseek-v3"), 1024)  # PP16: 3 dense | 14 x 4 | 2
    assert [moe_layers_on_stage(recipe, s) for s in (0, 1, 15)] == [0, 4, 2]
    # A dense-first stage 0 is not the fullest, so stage 1 is evaluated; stages 2-14 hold the same
    # layers as stage 1 with fewer microbatches in flight, so they are not: the peak over all
    # 16 stages is the peak over those three.
    assert edge_stages(recipe) == (0, 1, 15)
    every = max((memory_on_stage(recipe, s) for s in range(16)), key=lambda b: b.total)
    assert peak_memory(recipe) == every and every.stage == 1
    compute = [stage_compute_s(recipe, s, H100, ThroughputOptions()) for s in range(16)]
    assert max(compute) == max(compute[s] for s in edge_stages(recipe))


@pytest.mark.parametrize("te", [True, False])
def test_ranks_hold_models_flops_total(te):
    """Every stage's parameters together, with experts over EP, are models.flops.total_params
    (DeepSeek-V3: 671.0B + its MTP layer), whatever the spec, plus the word-embedding copy
    Megatron-Core builds on the last stage for MTP at PP > 1."""
    c = Candidate.from_config(get_recipe("deepseek-v3"), 1024, flash_attention=te)  # TP1 PP16 EP64
    held = [params_on_rank(c, s) for s in range(c.pp)]
    copy = V3.padded_vocab_size * V3.hidden_size
    assert sum(p.dense for p in held) + c.ep * sum(p.expert for p in held) == total_params(V3) + copy
    assert total_params(V3) - mtp_params(V3) == 671_026_404_352


def test_stage_flops_sum_to_models_flops():
    """With one efficiency and no recompute, the stages' compute times add up to
    models.flops.training_flops_per_token: each layer kind priced once, the logits once."""
    for model, layout in ((TINY, dict(pipeline_parallel=2)), (TINY, dict(pipeline_parallel=4)),
                          (V3, dict(pipeline_parallel=16, num_layers_in_first_pipeline_stage=3,
                                    num_layers_in_last_pipeline_stage=2))):
        c = _cand(model, 64, **layout)
        opts = ThroughputOptions(efficiency=1.0)
        seconds = sum(stage_compute_s(c, s, H100, opts) for s in range(c.pp))
        assert seconds * H100.peak("bf16") / c.seq_length == pytest.approx(
            training_flops_per_token(model, c.seq_length), rel=1e-12)


def test_mla_activations_by_hand():
    """DeepSeek-V3 at s 4096, bf16, TP1: down-projection input 2 T h + latent norm inputs and
    up-projection inputs 4 T (q_lora + kv_lora) + Q, K 2 T n (dq + dr) each + V 2 T n dv + the
    output projection's input 2 T n dv; TP2 + SP halves every term."""
    T, h, n = 4096, 7168, 128
    want = 2 * T * h + 4 * T * (1536 + 512) + 2 * T * n * (2 * 192 + 128) + 2 * T * n * 128
    assert mla_activation_bytes(_cand(V3, 8)) == want
    sp = _cand(V3, 8, tensor_parallel=2, sequence_parallel=True)
    assert mla_activation_bytes(sp) == want / 2


def test_deepseek_v3_plan_validates():
    """`launch.plan --recipe deepseek-v3 --gpus 1024` (a narrowed space): a plan, and its top
    layouts are ones our training accepts; ZeRO-2/3 (Megatron-FSDP) are searched too."""
    recipe = get_recipe("deepseek-v3")
    space = SearchSpace(micro_batch=(1,), recompute=("selective",), offload=(False,))
    p = plan(recipe, world_size=1024, device=H100, space=space)
    assert p.ranked and {e.candidate.zero for e in p.ranked + p.dropped} >= {2, 3}
    for e in p.ranked[:5]:
        validate_for_world(e.candidate.apply_to(recipe), 1024)
        assert e.memory.total <= H100.memory_bytes


def test_tiny_deepseek_plans_zero3_muon_and_lion():
    """ZeRO-2/3 and Muon / Lion are planned for MLA + dense-first MoE + MTP (their static terms:
    test_memory_measured.py); every top layout is one our training accepts."""
    recipe = get_recipe("tiny-deepseek").model_copy(update={"model": TINY.model_copy(update={"mtp_num_layers": 1})})
    fsdp = plan(recipe, world_size=8, device=H100, space=SearchSpace(zero=(2, 3), micro_batch=(1,), offload=(False,)))
    assert {e.candidate.zero for e in fsdp.ranked} == {2, 3}
    for e in fsdp.ranked[:3]:
        validate_for_world(e.candidate.apply_to(recipe), 8)
    for name in ("muon", "lion"):
        chosen = recipe.model_copy(update={"optimizer": recipe.optimizer.model_copy(update={"name": name})})
        p = plan(chosen, world_size=8, device=H100, space=SearchSpace(micro_batch=(1,), offload=(False,)))
        assert p.ranked and all(e.candidate.optimizer_name == name for e in p.ranked)
        for e in p.ranked[:3]:
            validate_for_world(e.candidate.apply_to(chosen), 8)


@pytest.mark.parametrize("te", [True, False])
def test_mla_weights_hold_models_flops_counts(te):
    """launch.planner.layers.mla_weights (the tensors the FSDP and Muon models list) adds up to
    models.flops' MLA count whole and, on one TP rank, to memory's replicated + split share;
    its TP-whole tensors are memory.mla_replicated_params."""
    for model in (TINY, V3, TINY.model_copy(update={"q_lora_rank": None})):
        weights = mla_weights(model, 2, te)
        assert sum(w.rows * w.cols for w in weights) == mla_attention_params(model)
        assert sum(w.numel for w in weights if w.split == 1) == mla_replicated_params(model, te)
        assert sum(w.numel for w in weights) == mla_replicated_params(model, te) + (
            mla_attention_params(model) - mla_replicated_params(model, te)) // 2


def test_fsdp_buckets_and_muon_list_each_layer_kind():
    """tiny-deepseek + 1 MTP layer at ZeRO-3: one unit per layer, the dense layer's (its 256-wide
    MLP, no router) apart from the MoE ones, the MTP layer's like the last (MoE); every listed
    element adds up to memory.params_on_rank, and Muon's list holds the same elements."""
    model = TINY.model_copy(update={"mtp_num_layers": 1})
    for te in (True, False):
        c = dataclasses.replace(_cand(model, 2, tensor_parallel=2), zero=3, flash_attention=te)
        units = [b for b in fsdp_buckets(c) if b.unit and not b.expert]
        dense, moe = (sum(n for n, _ in layer_parameters(model, 2, 1, 2, kind, te)[0]) for kind in (False, True))
        assert [b.numel for b in units] == [dense, moe, moe, moe, moe]
        held = params_on_rank(c, 0).total
        assert sum(b.numel for b in fsdp_buckets(c)) == held == sum(p.numel for p in muon.params_list(c, 0))
def test_published_deepseek_layout_is_over_by_activations():
    """DeepSeek's PP16 x EP64 (no TP, ZeRO-1) on 2048 80 GB GPUs does not fit our model: stage 1
    keeps 15 microbatches x 4 MoE layers of activations (routed-token copies and MLA's per-head
    q/k/v), far above every static term (launch.planner.deepseek_layouts)."""
    c = Candidate.from_config(get_recipe("deepseek-v3"), 2048)
    peak = peak_memory(c)
    assert peak.total > H100.memory_bytes
    assert peak.activations > 10 * max(peak.params, peak.grads, peak.main_params, peak.optimizer_states)
