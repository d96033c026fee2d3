"""Parameter counts and FLOPs: the one place both training metrics and the planner use.

Notation: L layers, h hidden, f FFN hidden, n heads, g query groups, d head dim,
V padded vocab, s sequence length, k router top-k, E experts.
A matmul of (m x k) by (k x n) costs 2mkn FLOPs. Training = forward + backward
= 3 x forward (backward computes input and weight gradients, 2 x forward).
Activation recompute is not counted (these are *model* FLOPs, as MFU is defined
in PaLM, Appendix B, and Megatron-LM's `num_floating_point_operations`).
"""

from __future__ import annotations

from models.config import ModelConfig


def attention_params(m: ModelConfig) -> int:
    """QKV projection h x (n d + 2 g d), output projection n d x h, plus biases (MLA:
    `mla_attention_params`)."""
    if m.multi_latent_attention:
        return mla_attention_params(m)
    d, n, g, h = m.head_dim, m.num_attention_heads, m.query_groups, m.hidden_size
    qkv_out = n * d + 2 * g * d
    count = h * qkv_out + n * d * h
    if m.add_qkv_bias:
        count += qkv_out
    if m.add_bias_linear:
        count += h
    return count


def mla_attention_matrices(m: ModelConfig) -> int:
    """Multi-latent attention's weight matrices (no biases; Megatron-Core's MLASelfAttention):
      queries   h x q_lora + q_lora x n (dq + dr)   (h x n (dq + dr) when q_lora_rank is None)
      keys/vals h x (kv_lora + dr) + kv_lora x n (dq + dv)   (one RoPE key of dr for all heads)
      output    n dv x h
    with dq = qk_head_dim, dr = qk_pos_emb_head_dim, dv = v_head_dim."""
    h, n, qh, dv = m.hidden_size, m.num_attention_heads, m.q_head_dim, m.v_head_dim
    q = h * n * qh if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank * n * qh
    kv = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank * n * (m.qk_head_dim + dv)
    return q + kv + n * dv * h


def mla_attention_params(m: ModelConfig) -> int:
    """`mla_attention_matrices` plus the q and kv latent norms (q only with q_lora_rank)."""
    per_norm = 2 if m.normalization == "LayerNorm" else 1
    norms = m.kv_lora_rank + (m.q_lora_rank or 0)
    return mla_attention_matrices(m) + per_norm * norms


def mlp_params(m: ModelConfig, ffn: int) -> int:
    """fc1 h x f (x2 for the gate of SwiGLU), fc2 f x h, plus biases."""
    h = m.hidden_size
    fc1_out = ffn * (2 if m.gated else 1)
    count = h * fc1_out + ffn * h
    if m.add_bias_linear:
        count += fc1_out + h
    return count


def norm_params(m: ModelConfig) -> int:
    """RMSNorm has a weight; LayerNorm a weight and a bias."""
    return m.hidden_size * (2 if m.normalization == "LayerNorm" else 1)


def qk_norm_params(m: ModelConfig) -> int:
    """q and k norms (qk_layernorm): one head_dim-sized weight each (+ bias for LayerNorm),
    shared by all heads; 0 without them."""
    if not m.qk_layernorm:
        return 0
    return 2 * m.head_dim * (2 if m.normalization == "LayerNorm" else 1)


def layer_params(m: ModelConfig, moe: bool | None = None) -> int:
    """One transformer layer: two norms (+ q/k norms), attention, MLP (or router + experts).
    `moe`: which kind of layer (a MoE model's moe_layer_freq leaves some dense); None = MoE
    for a MoE model."""
    count = 2 * norm_params(m) + qk_norm_params(m) + attention_params(m)
    if m.is_moe if moe is None else moe:
        count += m.hidden_size * m.num_experts  # router
        count += m.num_experts * mlp_params(m, m.expert_ffn_hidden_size)
        if m.moe_shared_expert_hidden_size:
            count += mlp_params(m, m.moe_shared_expert_hidden_size)
    else:
        count += mlp_params(m, m.ffn_hidden_size)
    return count


def embedding_params(m: ModelConfig) -> int:
    """Word embeddings V x h (+ learned positions s x h)."""
    count = m.padded_vocab_size * m.hidden_size
    if m.position_embedding == "learned_absolute":
        count += m.max_seq_length * m.hidden_size
    return count


def output_params(m: ModelConfig) -> int:
    """Final norm, plus the output projection h x V unless tied to the embedding."""
    count = norm_params(m)
    if not m.tie_embeddings:
        count += m.padded_vocab_size * m.hidden_size
    return count


def main_params(m: ModelConfig) -> int:
    """The model without its MTP layers: what serves, what HF exports, what model cards call
    the size (DeepSeek-V3's 671B)."""
    moe_layers = m.num_moe_layers
    layers = (m.num_layers - moe_layers) * layer_params(m, False)
    if moe_layers:
        layers += moe_layers * layer_params(m, True)
    return embedding_params(m) + layers + output_params(m)


def mtp_layer_is_moe(m: ModelConfig) -> bool:
    """Megatron-Core builds each MTP layer's transformer layer from the decoder's last layer spec."""
    return bool(m.moe_layer_pattern and m.moe_layer_pattern[-1])


def mtp_params(m: ModelConfig) -> int:
    """Multi-token prediction layers (training only; 0 without them). Per layer: two input
    norms (hidden, embedding), the 2h -> h projection, one transformer layer shaped like the
    decoder's last, and a final norm. The embedding and output layer are the model's own
    (shared; a PP > 1 last stage holds a synchronised copy of the embedding, not counted)."""
    h = m.hidden_size
    per_layer = 3 * norm_params(m) + 2 * h * h + layer_params(m, mtp_layer_is_moe(m))
    return m.mtp_num_layers * per_layer


def total_params(m: ModelConfig) -> int:
    """Every parameter training builds: `main_params` + `mtp_params`. DeepSeek-V3: 671B + 11.6B;
    DeepSeek's 685B also counts the MTP module's own copies of the embedding and output head."""
    return main_params(m) + mtp_params(m)


def non_embedding_params(m: ModelConfig) -> int:
    """total_params less the word (and position) embeddings and the untied output projection:
    Kaplan et al. 2020's N. At tiny widths the V x h matrices are most of the model (tiny-llama
    at h64: 0.52M of 0.57M) and barely change with depth, so a ladder spread in total params
    is hardly spread in the part that scaling laws are about."""
    untied = 0 if m.tie_embeddings else m.padded_vocab_size * m.hidden_size
    return total_params(m) - embedding_params(m) - untied


def active_params(m: ModelConfig) -> int:
    """Parameters one token goes through in the main model: main_params less the routed
    experts it skips (E - k per layer); the "activated" count of MoE model cards (MTP layers
    excluded, as there). The router, shared expert, embedding and output layer all count.
    Equals main_params for a dense model."""
    if not m.is_moe:
        return main_params(m)
    skipped = m.num_experts - m.moe_router_topk
    return main_params(m) - m.num_moe_layers * skipped * mlp_params(m, m.expert_ffn_hidden_size)


def document_attention_fraction(document_lengths, seq_length: int) -> float:
    """The share of a sample's causal attention work (scores and weighted values) that runs
    when attention stays inside each document (data.reset_attention_mask): a document of L
    tokens costs L (L + 1) / 2 query-key pairs, the whole sample s (s + 1) / 2. 1.0 for one
    document; about mean document length / s for many short ones."""
    pairs = sum(length * (length + 1) for length in document_lengths)
    return pairs / (seq_length * (seq_length + 1))


def packed_attention_fraction(document_length: int, seq_length: int) -> float:
    """`document_attention_fraction` of a sample packed with documents of `document_length`
    tokens (the last one cut at the sample's end): the planner's estimate for a corpus whose
    documents average that length."""
    full, rest = divmod(seq_length, document_length)
    return document_attention_fraction([document_length] * full + ([rest] if rest else []), seq_length)


def forward_flops_per_token(m: ModelConfig, seq_length: int, causal: bool = True,
                            attention_fraction: float = 1.0) -> float:
    """Forward FLOPs for one token (summing every layer and the logits).

    Per layer:
      QKV projection       2 h (n d + 2 g d)          (GQA: g KV heads, not n)
      scores Q K^T         2 s n d   x 1/2 if causal  (only the lower triangle is computed)
      weighted values A V  2 s n d   x 1/2 if causal
      output projection    2 n d h
      MLP                  2 h f (3 if SwiGLU: gate, up, down; else 2), per active expert
                           (MoE: k experts per token, + 2 h E for the router; the dense
                           layers of moe_layer_freq use f = ffn_hidden_size)
    MLA replaces the projections by 2 x its weight matrices and uses its head sizes
    (`mla_attention_matrices`).
    Logits: 2 h V.
    MTP layers (model.mtp_num_layers, training only): each adds its 2h -> h projection
    (2 x 2h x h), one layer like the decoder's last, and the logits again.
    d is the head size (kv_channels), which need not be h / n (Qwen3-0.6B: h 1024, n d 2048).
    Norms (q/k norms too) are elementwise, O(h) per token, and not counted, as in Megatron-LM.
    `attention_fraction` scales the two attention terms: the share of the causal work that
    document masking leaves (`document_attention_fraction`); 1.0 = the dense formula, which
    MFU is reported against (the convention of PaLM and Megatron-LM, comparable across data).
    """
    attention, dense, moe = _layer_flops(m, seq_length, (0.5 if causal else 1.0) * attention_fraction)
    moe_layers = m.num_moe_layers
    mlp = (m.num_layers - moe_layers) * dense + moe_layers * moe
    logits = 2 * m.hidden_size * m.padded_vocab_size
    main = m.num_layers * attention + mlp + logits
    # MTP (training only), per layer: the 2h -> h projection, one layer like the decoder's last,
    # and the shared output layer's logits again.
    mtp = 2 * 2 * m.hidden_size ** 2 + attention + (moe if mtp_layer_is_moe(m) else dense) + logits
    return main + m.mtp_num_layers * mtp


def _layer_flops(m: ModelConfig, seq_length: int, attn_factor: float) -> tuple[float, float, float]:
    """(attention, dense MLP, MoE MLP) forward FLOPs per token of one layer (see above)."""
    h, n, g, d = m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim
    if m.multi_latent_attention:
        # Every projection once per token (2 x its weights); scores over q/k heads of
        # qk_head_dim + qk_pos_emb_head_dim, weighted values over v_head_dim.
        attention = 2 * mla_attention_matrices(m) + 2 * seq_length * n * (m.q_head_dim + m.v_head_dim) * attn_factor
    else:
        attention = 2 * h * (n * d + 2 * g * d) + 2 * 2 * seq_length * n * d * attn_factor + 2 * n * d * h
    mats = 3 if m.gated else 2
    dense = 2 * h * m.ffn_hidden_size * mats
    moe = 0.0
    if m.is_moe:
        moe = m.moe_router_topk * 2 * h * m.expert_ffn_hidden_size * mats + 2 * h * m.num_experts
        if m.moe_shared_expert_hidden_size:
            moe += 2 * h * m.moe_shared_expert_hidden_size * mats
    return attention, dense, moe


def training_flops_per_token(m: ModelConfig, seq_length: int, attention_fraction: float = 1.0) -> float:
    """Forward + backward = 3 x forward."""
    return 3.0 * forward_flops_per_token(m, seq_length, attention_fraction=attention_fraction)


def training_flops_per_step(m: ModelConfig, seq_length: int, global_batch_size: int) -> float:
    return training_flops_per_token(m, seq_length) * seq_length * global_batch_size
