"""MLA / DeepSeek-V3 config fields: validation messages, the published size, and the
parameter and FLOP formulas by hand (issue 45). The built tiny-deepseek's real parameter count
is checked in tests/pretrain/test_deepseek_parity.py (from its reference run)."""

from __future__ import annotations

import pytest

from models.config import FLAVORS, ModelConfig, get_flavor
from models.flops import (active_params, attention_params, forward_flops_per_token, layer_params, main_params,
                          mtp_params, total_params)
from models.layout import LayoutError, ParallelLayout, validate_layout

TINY_MLA = dict(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, vocab_size=128,
                max_seq_length=16, multi_latent_attention=True, q_lora_rank=4, kv_lora_rank=4, qk_head_dim=2,
                qk_pos_emb_head_dim=2, v_head_dim=3)


@pytest.mark.parametrize("name", sorted(FLAVORS))
def test_every_flavor_passes_validation(name):
    """Flavors are built with model_copy, which skips validators: validate each one again."""
    ModelConfig.model_validate(FLAVORS[name].model_dump())


def test_deepseek_v3_counts_671b_total_37b_active():
    """DeepSeek-V3's report: 671B total parameters (MTP module excluded), 37B activated per token;
    685B with the MTP module ("14B", the rounded difference). Ours: one MoE layer like the last,
    the 2h -> h projection and three norms = 11.6B; the released checkpoint's MTP layer also holds
    its own copies of the embedding and output head (2 x 129280 x 7168 = 1.85B), which ours shares:
    with them 13.5B, 684.5B in all."""
    m = FLAVORS["deepseek-v3"]
    assert m.mtp_num_layers == 1
    assert main_params(m) / 1e9 == pytest.approx(671, abs=0.5)
    h = 7168
    assert mtp_params(m) == 3 * h + 2 * h * h + layer_params(m, True)
    assert (mtp_params(m) + 2 * 129280 * h) / 1e9 == pytest.approx(13.5, abs=0.05)
    assert total_params(m) == main_params(m) + mtp_params(m)
    assert (total_params(m) + 2 * 129280 * h) / 1e9 == pytest.approx(685, abs=0.6)
    assert active_params(m) / 1e9 == pytest.approx(37, abs=0.6)
    # One MLA layer by hand: q 7168x1536 + 1536x(128 x 192), kv 7168x(512+64) + 512x(128 x 256),
    # output 128*128 x 7168, latent norms 1536 + 512.
    assert attention_params(m) == 11_010_048 + 37_748_736 + 4_128_768 + 16_777_216 + 117_440_512 + 2048
    # A token skips 248 of 256 routed experts (3 x 7168 x 2048 each) in 58 MoE layers.
    assert main_params(m) - active_params(m) == 58 * 248 * 3 * 7168 * 2048
    assert m.moe_layer_pattern[:4] == [0, 0, 0, 1] and m.num_moe_layers == 58


def test_mla_flops_and_params_by_hand():
    m = ModelConfig(**TINY_MLA)
    # matrices: q 8*4 + 4*(2 heads x (2+2)) = 64; kv 8*(4+2) + 4*(2 x (2+3)) = 88; out 2*3*8 = 48 -> 200.
    # forward: 2*200 + scores/values 2*16*2*((2+2)+3)*0.5 = 224 -> 624; swiglu 2*8*16*3 = 768;
    # logits 2*8*128 = 2048 -> 3440.
    assert forward_flops_per_token(m, 16) == 3440
    # layer: norms 16 + attention 200 + latent norms 8 + mlp 384 = 608; embedding 1024, output 1024 + 8.
    assert total_params(m) == 608 + 1024 + 1032


def test_mtp_flops_and_params_by_hand():
    """One MTP layer on TINY_MLA: its 2h -> h projection, a layer like the last (dense here) and the
    logits again; parameters: three norms, the projection and the layer (embedding/output shared)."""
    m = ModelConfig(**TINY_MLA, mtp_num_layers=1)
    # 2 x 16 x 8 = 256 projection + 624 attention + 768 SwiGLU + 2048 logits on top of 3440.
    assert forward_flops_per_token(m, 16) == 3440 + 256 + 624 + 768 + 2048
    # norms 3 x 8 + projection 16 x 8 + layer 608.
    assert mtp_params(m) == 24 + 128 + 608 and total_params(m) == 2664 + 760 == main_params(m) + 760
    assert active_params(m) == main_params(m) == 2664  # the model card's counts exclude MTP


@pytest.mark.parametrize("update, message", [
    (dict(v_head_dim=None), "multi_latent_attention=true needs v_head_dim"),
    (dict(multi_latent_attention=False), "q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim "
                                          "need(s) multi_latent_attention=true"),
    (dict(num_query_groups=1), "does not combine with num_query_groups"),
    (dict(qk_layernorm=True), "does not combine with qk_layernorm"),
    (dict(rope_scaling=True), "does not combine with rope_scaling"),
    (dict(qk_pos_emb_head_dim=3), "qk_pos_emb_head_dim=3 must be even"),
    (dict(multi_latent_attention=False, q_lora_rank=None, kv_lora_rank=None, qk_head_dim=None, qk_pos_emb_head_dim=None,
          v_head_dim=None, yarn_scaling_factor=40.0), "yarn_scaling_factor need(s) multi_latent_attention=true"),
    (dict(yarn_scaling_factor=4.0, yarn_beta_slow=32.0), "yarn_beta_slow=32 must be below yarn_beta_fast=32"),
    (dict(yarn_scaling_factor=1.0), "greater than 1"),
    (dict(num_experts=8, moe_router_num_groups=4), "needs both moe_router_num_groups and moe_router_group_topk"),
    (dict(num_experts=8, moe_router_num_groups=3, moe_router_group_topk=1), "moe_router_num_groups=3 does not "
                                                                             "divide num_experts=8"),
    (dict(num_experts=8, moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=1),
     "at most group_topk x experts per group = 2"),
    (dict(num_experts=8, moe_layer_freq=[0, 1]), "needs num_layers=1 entries"),
    (dict(moe_layer_freq=2), "moe_layer_freq need(s) a MoE model"),
    (dict(moe_router_topk_scaling_factor=2.5), "need(s) a MoE model"),
])
def test_invalid_mla_and_routing_configs_name_the_problem(update, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**{**TINY_MLA, **update})


def test_tp_must_divide_the_column_parallel_latents():
    m = ModelConfig(**{**TINY_MLA, "kv_lora_rank": 5})  # 5 + 2 RoPE channels
    with pytest.raises(LayoutError, match=r"TP=2 does not divide kv_lora_rank \+ qk_pos_emb_head_dim=7"):
        validate_layout(m, ParallelLayout(tensor_parallel=2), 2)
    validate_layout(get_flavor("tiny-deepseek"), ParallelLayout(tensor_parallel=2, sequence_parallel=True), 2)
