"""Flavors, vocab padding, and the parameter/FLOP formulas against a real built model."""

from __future__ import annotations

import pytest

from models.config import FLAVORS, ModelConfig, get_flavor
from models.flops import (active_params, embedding_params, forward_flops_per_token, mlp_params,
                          non_embedding_params, qk_norm_params, total_params, training_flops_per_token)
from tests.distributed import run_ranks


def test_unknown_flavor_suggests_closest():
    with pytest.raises(ValueError, match="Did you mean 'llama3-8b'"):
        get_flavor("llama3-8")


def test_vocab_padding_is_layout_independent():
    assert get_flavor("tiny-llama").padded_vocab_size == 4096
    assert get_flavor("llama3-8b").padded_vocab_size == 128256
    assert get_flavor("gpt3-175b").padded_vocab_size == 50304


@pytest.mark.parametrize("name, billions", [
    ("llama2-7b", 6.74), ("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3.1-405b", 405.85),
    ("gpt3-175b", 174.6), ("mixtral-8x7b", 46.7),
    # Qwen3-8B's model card: "Number of Parameters: 8.2B" (untied: 2 x 151936 x 4096 embedding/head).
    ("qwen3-8b", 8.19),
    # Qwen3-30B-A3B's model card: "30.5B in total".
    ("qwen3-30b-a3b", 30.53),
])
def test_published_sizes(name, billions):
    assert total_params(FLAVORS[name]) / 1e9 == pytest.approx(billions, rel=0.01)


def test_forward_flops_hand_computed():
    m = ModelConfig(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                    num_query_groups=1, vocab_size=128, max_seq_length=16)
    # per layer: qkv 2*8*(2*4+2*1*4)=256, attention 2*2*16*2*4*0.5=256, proj 2*8*8=128,
    # swiglu mlp 2*8*16*3=768 -> 1408; x2 layers + logits 2*8*128=2048 -> 4864.
    assert forward_flops_per_token(m, 16) == 4864
    assert training_flops_per_token(m, 16) == 3 * 4864


def test_qwen3_8b_non_embedding_params_match_its_model_card():
    """Qwen3-8B's model card: "Number of Paramaters (Non-Embedding): 6.95B". Layers (q/k norms
    of 128 each included) + the final norm; 36 x 2 x 128 = 9216 of them are q/k norm weights."""
    m = FLAVORS["qwen3-8b"]
    non_embedding = total_params(m) - embedding_params(m) - m.padded_vocab_size * m.hidden_size
    assert non_embedding / 1e9 == pytest.approx(6.95, abs=0.005) and non_embedding_params(m) == non_embedding
    assert qk_norm_params(m) == 2 * 128 and qk_norm_params(FLAVORS["llama3-8b"]) == 0


def test_qwen3_30b_a3b_matches_its_model_card():
    """Qwen3-30B-A3B's model card: 30.5B in total, 3.3B activated, 29.9B non-embedding; 48 layers of
    128 experts (768 wide, SwiGLU: 3 x 2048 x 768 each), 8 of them active per token."""
    m = FLAVORS["qwen3-30b-a3b"]
    non_embedding = total_params(m) - 2 * m.padded_vocab_size * m.hidden_size
    assert non_embedding / 1e9 == pytest.approx(29.9, abs=0.05) and non_embedding_params(m) == non_embedding
    assert active_params(m) / 1e9 == pytest.approx(3.3, abs=0.06)
    # Independent count of what a token skips: 120 experts x 3 matrices x 2048 x 768 per layer.
    assert total_params(m) - active_params(m) == 48 * 120 * 3 * 2048 * 768
    assert active_params(FLAVORS["qwen3-8b"]) == total_params(FLAVORS["qwen3-8b"])


def test_forward_flops_hand_computed_for_fine_grained_experts():
    """8 experts of 4 (moe_ffn_hidden_size, not ffn_hidden_size), top-2, q/k norms, head_dim 6."""
    m = ModelConfig(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                    num_query_groups=1, kv_channels=6, qk_layernorm=True, vocab_size=128, max_seq_length=16,
                    num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=4)
    # per layer: attention as below 384+384+192 = 960; experts 2 x 2*8*4*3 = 384; router 2*8*8 = 128
    # -> 1472; x2 layers + logits 2048 -> 4992.
    assert forward_flops_per_token(m, 16) == 4992
    # per layer: norms 16 + q/k norms 12 + qkv 192 + proj 96 + router 64 + 8 experts x 96 = 1148
    assert total_params(m) == 2 * 1148 + 2 * 128 * 8 + 8
    assert active_params(m) == total_params(m) - 2 * 6 * 96 and mlp_params(m, 4) == 96


def test_forward_flops_hand_computed_with_decoupled_head_dim():
    """head_dim 6 with hidden 8 and 2 heads (attention 12 wide), as Qwen3 allows; q/k norms add
    parameters (2 x 6 per layer) but no counted FLOPs."""
    m = ModelConfig(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                    num_query_groups=1, kv_channels=6, qk_layernorm=True, vocab_size=128, max_seq_length=16)
    # per layer: qkv 2*8*(2*6+2*1*6)=384, attention 2*2*16*2*6*0.5=384, proj 2*12*8=192,
    # swiglu mlp 2*8*16*3=768 -> 1728; x2 layers + logits 2*8*128=2048 -> 5504.
    assert forward_flops_per_token(m, 16) == 5504
    # per layer: norms 2*8 + q/k norms 2*6 + qkv 8*24 + proj 12*8 + mlp 3*8*16 = 700; x2 + 2*128*8 + 8
    assert total_params(m) == 2 * 700 + 2 * 128 * 8 + 8


def test_invalid_model_config_messages():
    with pytest.raises(ValueError, match="num_query_groups=3 must divide num_attention_heads=8"):
        get_flavor("tiny-llama").model_copy(update={}).model_validate(
            {**get_flavor("tiny-llama").model_dump(), "num_query_groups": 3})


def count_built_params(flavor: str) -> dict:
    from models.build import build_model_chunks
    from models.runtime import RuntimeOptions
    from models.layout import ParallelLayout
    from pretrain.runtime import init_distributed, shutdown

    layout = ParallelLayout()
    init_distributed(layout, seed=0)
    chunks = build_model_chunks(get_flavor(flavor), layout, RuntimeOptions(seed=0, spec="portable"))
    count = sum(p.numel() for c in chunks for p in c.parameters())
    # Kaplan's N: all but the word/position embeddings and the (untied) output projection.
    body = sum(p.numel() for c in chunks for name, p in c.named_parameters()
               if "embedding" not in name and not name.endswith("output_layer.weight"))
    shutdown()
    return {"params": count, "non_embedding": body}


@pytest.mark.distributed
@pytest.mark.parametrize("flavor", ["tiny-llama", "tiny-gpt", "tiny-llama-tied", "tiny-moe", "tiny-qwen3",
                                    "tiny-qwen3-moe"])
def test_param_formula_matches_built_model(flavor):
    (result,) = run_ranks(1, "tests.models.test_config_flops:count_built_params", flavor=flavor)
    assert result["params"] == total_params(get_flavor(flavor))
    assert result["non_embedding"] == non_embedding_params(get_flavor(flavor))
