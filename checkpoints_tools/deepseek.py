"""DeepSeek-V3 (multi-latent attention + DeepSeek MoE) <-> transformers' DeepseekV3ForCausalLM:
names, shapes and config.json, as data. mapping.py / hf_format.py dispatch here for MLA models.

Facts behind the mapping (each checked by logits against transformers,
tests/checkpoints_tools/test_deepseek_hf.py):
  - MLA names (Megatron-Core's portable spec): linear_q_down_proj = q_a_proj, q_layernorm =
    q_a_layernorm, linear_q_up_proj = q_b_proj,
    linear_kv_down_proj = kv_a_proj_with_mqa ([kv latent; the one shared RoPE key]), kv_layernorm
    = kv_a_layernorm, linear_kv_up_proj = kv_b_proj (per head [no-RoPE key; value]), linear_proj =
    o_proj. Row orders are the same on both sides: no transform. Without a query latent
    (q_lora_rank None) Megatron-Core's MLA (latent norms on = its qk_layernorm) normalises the
    query input once more, fused into linear_q_proj, where DeepSeek's q_proj has no norm (and the
    0.19.2 local spec cannot build it): refused both ways.
  - RoPE layout: Megatron-Core's MLA always rotates interleaved pairs (x0, x1), (x2, x3), ...
    (rope_utils: mla_rotary_interleaved=True de-interleaves before rotating), which is HF's
    rope_interleave=true (apply_rotary_pos_emb_interleave, and what the released weights hold):
    the RoPE rows are copied as they are. rope_interleave=false (halves) is refused on import.
  - YaRN (rope_type yarn): factor, original_max_position_embeddings, beta_fast / beta_slow,
    mscale / mscale_all_dim are Megatron-Core's MLA YaRN fields of the same meaning; the two
    libraries agree on the frequencies and the softmax scale, and on the cos/sin factor where
    `_same_yarn_factor` says.
  - HF's latent norms q_a_layernorm / kv_a_layernorm are built with eps 1e-6 whatever
    rms_norm_eps says; ours use norm_eps: both ways need norm_eps = 1e-6.
  - Router: sigmoid scores, e_score_correction_bias = Megatron-Core's router.expert_bias (added
    only to choose experts), top-k renormalised (norm_topk_prob) when k > 1, times
    routed_scaling_factor. HF scores a group by the sum of its top 2 experts; Megatron-Core by
    its top topk / group_topk: equal only when that is 2 (DeepSeek-V3: 8 / 4). No groups = one
    group (n_group = topk_group = 1).
  - Layers: the first first_k_dense_replace layers dense (intermediate_size), then MoE
    (moe_intermediate_size routed experts + n_shared_experts x moe_intermediate_size shared).
    Megatron-Core saves a model with a moe_layer_freq list with the layer number in every key
    ("non-homogeneous layers": decoder.layers.3.mlp.router.weight, experts stacked on one axis),
    and an all-MoE moe_layer_freq=1 model stacked as usual (decoder.layers.mlp.router.weight).
  - MTP (multi-token prediction) layers are training-only: never exported (their keys hold
    `mtp`), and HF files' extra layers past num_hidden_layers are not imported.
"""

from __future__ import annotations

import re
from typing import Optional

from models.config import ModelConfig

ARCHITECTURE = "DeepseekV3ForCausalLM"
HF_LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which HF's latent norms keep
_NUMBERED = re.compile(r"^decoder\.layers\.(\d+)\.")

# (megatron name inside a layer, HF names inside model.layers.N., transform)
_ATTENTION = (
    ("input_layernorm.weight", ("input_layernorm.weight",), "copy"),
    ("self_attention.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",), "copy"),
    ("self_attention.kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",), "copy"),
    ("self_attention.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",), "copy"),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), "copy"),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "copy"),
)
_Q_LATENT = (
    ("self_attention.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",), "copy"),
    ("self_attention.q_layernorm.weight", ("self_attn.q_a_layernorm.weight",), "copy"),
    ("self_attention.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",), "copy"),
)
_DENSE = (
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), "copy"),
)
_MOE = (
    ("mlp.router.weight", ("mlp.gate.weight",), "copy"),
    ("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), "copy"),
    ("mlp.shared_experts.linear_fc1.weight", ("mlp.shared_experts.gate_proj.weight",
                                              "mlp.shared_experts.up_proj.weight"), "gate_up"),
    ("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_experts.down_proj.weight",), "copy"),
    ("mlp.experts.experts.linear_fc1.weight", ("mlp.experts.#.gate_proj.weight", "mlp.experts.#.up_proj.weight"),
     "gate_up"),
    ("mlp.experts.experts.linear_fc2.weight", ("mlp.experts.#.down_proj.weight",), "copy"),
)
# Linear modules with an `_extra_state` ShardedObject (None on the portable spec).
_EXTRA_ATTENTION = ("self_attention.linear_proj", "self_attention.linear_kv_down_proj",
                    "self_attention.linear_kv_up_proj")
_EXTRA_DENSE = ("mlp.linear_fc1", "mlp.linear_fc2")
_EXTRA_SHARED = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
_EXTRA_EXPERTS = ("linear_fc1", "linear_fc2")


def numbered_layers(model: ModelConfig) -> bool:
    """Whether Megatron-Core saves this model's layers under numbered keys (a moe_layer_freq
    list or every N-th layer: TransformerBlock.sharded_state_dict's non_homogeneous_layers)."""
    freq = model.moe_layer_freq
    return isinstance(freq, list) or freq > 1


def layer_of(key: str) -> Optional[int]:
    """The layer number of a numbered key (decoder.layers.3.x -> 3), else None."""
    match = _NUMBERED.match(key)
    return int(match.group(1)) if match else None


def _layer_parts(model: ModelConfig, moe: bool) -> tuple:
    return _ATTENTION[:1] + _Q_LATENT + _ATTENTION[1:] + (_MOE if moe else _DENSE)


def rules(model: ModelConfig) -> list[tuple[str, tuple[str, ...], str]]:
    """(megatron key, HF names, transform) of the decoder layers, layer by layer: numbered keys
    and layer numbers in the HF names (`#` = expert) for numbered models, else the stacked keys
    with `*` for the layer."""
    if not numbered_layers(model):
        return [(f"decoder.layers.{m}", tuple(f"model.layers.*.{h}" for h in hf), t)
                for m, hf, t in _layer_parts(model, moe=True)]
    out = []
    for layer, moe in enumerate(model.moe_layer_pattern):
        out += [(f"decoder.layers.{layer}.{m}", tuple(f"model.layers.{layer}.{h}" for h in hf), t)
                for m, hf, t in _layer_parts(model, moe=bool(moe))]
    return out


def _part_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, heads = model.hidden_size, model.num_attention_heads
    q_head = model.qk_head_dim + model.qk_pos_emb_head_dim
    experts, shared = model.expert_ffn_hidden_size, model.moe_shared_expert_hidden_size or 0
    return {
        "input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,),
        "self_attention.linear_q_down_proj.weight": (model.q_lora_rank or 0, h),
        "self_attention.q_layernorm.weight": (model.q_lora_rank or 0,),
        "self_attention.linear_q_up_proj.weight": (heads * q_head, model.q_lora_rank or 0),
        "self_attention.linear_kv_down_proj.weight": (model.kv_lora_rank + model.qk_pos_emb_head_dim, h),
        "self_attention.kv_layernorm.weight": (model.kv_lora_rank,),
        "self_attention.linear_kv_up_proj.weight": (heads * (model.qk_head_dim + model.v_head_dim),
                                                    model.kv_lora_rank),
        "self_attention.linear_proj.weight": (h, heads * model.v_head_dim),
        "mlp.linear_fc1.weight": (2 * model.ffn_hidden_size, h), "mlp.linear_fc2.weight": (h, model.ffn_hidden_size),
        "mlp.router.weight": (model.num_experts, h), "mlp.router.expert_bias": (model.num_experts,),
        "mlp.shared_experts.linear_fc1.weight": (2 * shared, h), "mlp.shared_experts.linear_fc2.weight": (h, shared),
        "mlp.experts.experts.linear_fc1.weight": (2 * experts, h),
        "mlp.experts.experts.linear_fc2.weight": (h, experts),
    }


def layer_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer (per-expert) shape of every decoder-layer key of rules(model)."""
    parts = _part_shapes(model)
    return {key: parts[_NUMBERED.sub("", key).removeprefix("decoder.layers.")] for key, _, _ in rules(model)}


def extra_state_keys(model: ModelConfig) -> list[str]:
    """The `_extra_state` ShardedObject keys Megatron-Core saves for the decoder layers."""
    n, e, keys = model.num_layers, model.num_experts, []
    q = ("self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj")
    for layer, moe in enumerate(model.moe_layer_pattern):
        modules = _EXTRA_ATTENTION + q + (_EXTRA_SHARED if moe else _EXTRA_DENSE)
        if numbered_layers(model):
            keys += [f"decoder.layers.{layer}.{m}._extra_state/shard_0_1" for m in modules]
            if moe:
                keys += [f"decoder.layers.{layer}.mlp.experts.experts.{m}._extra_state/shard_{x}_{e}"
                         for x in range(e) for m in _EXTRA_EXPERTS]
        else:
            keys += [f"decoder.layers.{m}._extra_state/shard_{layer}_{n}" for m in modules]
            keys += [f"decoder.layers.mlp.experts.experts.{m}._extra_state/shard_{layer}.{x}_{n}.{e}"
                     for x in range(e) for m in _EXTRA_EXPERTS]
    return keys


# --- what DeepseekV3ForCausalLM can hold ------------------------------------------------------


def problems(model: ModelConfig) -> list[str]:
    """Why DeepseekV3ForCausalLM would compute other logits than this MLA model ([] = none)."""
    found = []
    if model.normalization != "RMSNorm" or model.activation != "swiglu":
        found.append(f"normalization={model.normalization}, activation={model.activation} (DeepSeek-V3: RMSNorm, "
                     "SwiGLU)")
    if model.q_lora_rank is None:
        found.append("q_lora_rank=None (Megatron-Core's MLA then normalises the query input in linear_q_proj; "
                     "DeepSeek's q_proj has no norm)")
    if model.norm_eps != HF_LATENT_NORM_EPS:
        found.append(f"norm_eps={model.norm_eps:g} (transformers builds DeepSeek-V3's latent norms with eps 1e-6 "
                     "whatever rms_norm_eps says)")
    if not model.is_moe:
        found.append("no experts (DeepSeek-V3 has routed experts; a dense MLA model has no HF class here)")
        return found
    pattern = model.moe_layer_pattern
    dense = pattern.index(1)
    if pattern != [0] * dense + [1] * (len(pattern) - dense):
        found.append(f"moe_layer_freq={model.moe_layer_freq} (DeepSeek-V3's dense layers are the first "
                     "first_k_dense_replace ones, then every layer MoE)")
    if model.moe_router_score_function != "sigmoid" or not model.moe_router_enable_expert_bias:
        found.append("a router without sigmoid scores and the expert bias (DeepSeek-V3: moe_router_score_function="
                     "sigmoid, moe_router_enable_expert_bias=true)")
    shared, experts = model.moe_shared_expert_hidden_size, model.expert_ffn_hidden_size
    if not shared or shared % experts:
        found.append(f"moe_shared_expert_hidden_size={shared} (DeepSeek-V3: n_shared_experts x "
                     f"moe_ffn_hidden_size={experts}, at least one)")
    if model.yarn_scaling_factor is not None and not _same_yarn_factor(model.yarn_mscale, model.yarn_mscale_all_dim):
        found.append(f"yarn_mscale={model.yarn_mscale:g} with yarn_mscale_all_dim={model.yarn_mscale_all_dim:g} "
                     "(transformers derives YaRN's cos/sin factor from both only when both are non-zero, else from "
                     "the factor alone: use both non-zero, e.g. DeepSeek-V3's 1 and 1, or 1 and 0)")
    if model.moe_router_num_groups and model.moe_router_topk // model.moe_router_group_topk != 2:
        found.append(f"moe_router_topk / moe_router_group_topk = {model.moe_router_topk}/"
                     f"{model.moe_router_group_topk} (transformers scores a group by its top 2 experts, "
                     "Megatron-Core by its top topk / group_topk: make that 2, e.g. DeepSeek-V3's 8 / 4)")
    return found


def rope_parameters(model: ModelConfig) -> dict:
    """transformers' rope_parameters (what vLLM reads too): plain, or YaRN with every value given
    (no attention_factor: both sides derive it from factor, mscale and mscale_all_dim)."""
    if model.yarn_scaling_factor is None:
        return {"rope_type": "default", "rope_theta": model.rope_base}
    return {"rope_type": "yarn", "rope_theta": model.rope_base, "factor": model.yarn_scaling_factor,
            "original_max_position_embeddings": model.yarn_original_max_position_embeddings,
            "beta_fast": model.yarn_beta_fast, "beta_slow": model.yarn_beta_slow, "mscale": model.yarn_mscale,
            "mscale_all_dim": model.yarn_mscale_all_dim}


def to_hf_config(model: ModelConfig) -> dict:
    """DeepseekV3Config's fields for this model (rope_interleave=true, no MTP)."""
    experts = model.expert_ffn_hidden_size
    return {
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size, "moe_intermediate_size": experts,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_attention_heads,
        "n_shared_experts": model.moe_shared_expert_hidden_size // experts, "n_routed_experts": model.num_experts,
        "routed_scaling_factor": model.moe_router_topk_scaling_factor or 1.0,
        "kv_lora_rank": model.kv_lora_rank, "q_lora_rank": model.q_lora_rank,
        "qk_rope_head_dim": model.qk_pos_emb_head_dim, "qk_nope_head_dim": model.qk_head_dim,
        "v_head_dim": model.v_head_dim, "n_group": model.moe_router_num_groups or 1,
        "topk_group": model.moe_router_group_topk or 1, "num_experts_per_tok": model.moe_router_topk,
        "first_k_dense_replace": model.moe_layer_pattern.index(1),
        # Megatron-Core renormalises sigmoid top-k scores when k > 1 only.
        "norm_topk_prob": model.moe_router_topk > 1,
        "hidden_act": "silu", "max_position_embeddings": model.max_seq_length, "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_base, "rope_scaling": None, "rope_parameters": rope_parameters(model),
        "rope_interleave": True, "attention_bias": False, "attention_dropout": 0.0,
        "num_nextn_predict_layers": 0, "pretraining_tp": 1,
        # Not DeepseekV3Config fields, but what the released config.json says and vLLM reads: without
        # topk_method=noaux_tc vLLM builds no e_score_correction_bias and refuses the file.
        "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    }


def _same_yarn_factor(mscale: float, mscale_all_dim: float) -> bool:
    """Whether transformers and Megatron-Core scale YaRN's cos/sin alike: Megatron-Core by
    m(mscale) / m(mscale_all_dim) always (m(x) = 0.1 x ln f + 1), transformers so only when both
    are non-zero and by m(1) otherwise; the softmax scale, m(mscale_all_dim)^2, agrees always."""
    return (mscale > 0 and mscale_all_dim > 0) or (mscale == 1 and mscale_all_dim == 0)


def _rope_fields(config: dict, read_float, bad: list[str]) -> dict:
    """Our RoPE fields from rope_parameters (transformers 5) or the released files' rope_scaling;
    what we cannot reproduce goes to `bad`."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if kind == "default":
        return dict(rope_base=float(theta))
    if kind != "yarn":
        bad.append(f"rope type {kind!r} (plain RoPE and YaRN only)")
        return {}

    def number(name: str, default: float) -> float:  # a null value means the default, as in transformers
        return default if rope.get(name) is None else read_float(rope, name, default)

    original = int(number("original_max_position_embeddings", 4096))
    factor = number("factor", read_float(config, "max_position_embeddings", 4096) / original)
    fields = dict(rope_base=float(theta), yarn_scaling_factor=factor, yarn_original_max_position_embeddings=original,
                  yarn_beta_fast=number("beta_fast", 32.0), yarn_beta_slow=number("beta_slow", 1.0),
                  yarn_mscale_all_dim=number("mscale_all_dim", 0.0))
    # No mscale: transformers scales cos/sin by m(1) = ours with mscale 1 when mscale_all_dim is 0,
    # and with mscale_all_dim set by nothing we reproduce (refused below).
    fields["yarn_mscale"] = number("mscale", 0.0 if fields["yarn_mscale_all_dim"] else 1.0)
    if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        bad.append("YaRN with attention_factor or truncate=false (Megatron-Core derives the factor from mscale and "
                   "mscale_all_dim and rounds the correction range)")
    if not _same_yarn_factor(fields["yarn_mscale"], fields["yarn_mscale_all_dim"]):
        bad.append(f"YaRN mscale={fields['yarn_mscale']:g} with mscale_all_dim={fields['yarn_mscale_all_dim']:g} "
                   "(transformers then scales cos/sin by the factor alone, Megatron-Core by their ratio)")
    return fields


def model_fields(config: dict, read_int, read_float) -> dict:
    """Our ModelConfig fields for a DeepseekV3Config; ValueError names what we cannot reproduce.
    read_int / read_float: hf_format's typed readers of config.json fields."""
    bad = []
    rope = _rope_fields(config, read_float, bad)
    if config.get("rope_interleave", True) is not True:
        bad.append("rope_interleave=false (Megatron-Core's MLA rotates interleaved pairs; import needs true)")
    if config.get("q_lora_rank") is None:
        bad.append("q_lora_rank=null (Megatron-Core's MLA normalises the query input in linear_q_proj when there is "
                   "no query latent; DeepSeek's q_proj has no norm)")
    if config.get("attention_bias") or config.get("hidden_act", "silu") != "silu":
        bad.append("attention_bias / a hidden_act other than silu")
    if read_float(config, "rms_norm_eps", 1e-6) != HF_LATENT_NORM_EPS:
        bad.append(f"rms_norm_eps={config['rms_norm_eps']} (transformers' latent norms use 1e-6; ours use one eps)")
    layers, k = read_int(config, "num_hidden_layers"), read_int(config, "first_k_dense_replace", 3)
    topk = read_int(config, "num_experts_per_tok", 8)
    if k >= layers:
        bad.append(f"first_k_dense_replace={k} >= num_hidden_layers={layers} (no MoE layer)")
    if config.get("norm_topk_prob", True) != (topk > 1):
        bad.append(f"norm_topk_prob={config.get('norm_topk_prob')} with top-{topk} (Megatron-Core renormalises "
                   "sigmoid scores exactly when top-k > 1)")
    groups, group_topk = read_int(config, "n_group", 1), read_int(config, "topk_group", 1)
    if groups > 1 and topk // group_topk != 2:
        bad.append(f"num_experts_per_tok / topk_group = {topk}/{group_topk} (transformers scores a group by its "
                   "top 2 experts, Megatron-Core by its top topk / topk_group)")
    if bad:
        raise ValueError(f"config.json of {ARCHITECTURE} uses features we cannot reproduce: " + "; ".join(bad))
    experts = read_int(config, "moe_intermediate_size")
    scale = read_float(config, "routed_scaling_factor", 1.0)
    return dict(
        num_layers=layers, hidden_size=read_int(config, "hidden_size"),
        ffn_hidden_size=read_int(config, "intermediate_size"), num_attention_heads=read_int(config, "num_attention_heads"),
        vocab_size=read_int(config, "vocab_size"), max_seq_length=read_int(config, "max_position_embeddings", 4096),
        norm_eps=HF_LATENT_NORM_EPS, tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        init_std=read_float(config, "initializer_range", 0.02), **rope,
        multi_latent_attention=True, q_lora_rank=read_int(config, "q_lora_rank", None),
        kv_lora_rank=read_int(config, "kv_lora_rank"), qk_head_dim=read_int(config, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=read_int(config, "qk_rope_head_dim"), v_head_dim=read_int(config, "v_head_dim"),
        num_experts=read_int(config, "n_routed_experts"), moe_router_topk=topk, moe_ffn_hidden_size=experts,
        moe_shared_expert_hidden_size=read_int(config, "n_shared_experts", 1) * experts,
        moe_router_num_groups=groups if groups > 1 else None, moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=None if scale == 1.0 else scale, moe_aux_loss_coeff=0.0,
        # All-MoE: Megatron-Core's stacked layers (moe_layer_freq=1); dense-first: a list.
        moe_layer_freq=[0] * k + [1] * (layers - k) if k else 1,
    )


def mtp_layer_names(names, num_layers: int) -> list[str]:
    """HF tensors of DeepSeek's MTP layers (model.layers.N. with N >= num_hidden_layers)."""
    found = []
    for name in names:
        match = re.match(r"^model\.layers\.(\d+)\.", name)
        if match and int(match.group(1)) >= num_layers:
            found.append(name)
    return found
