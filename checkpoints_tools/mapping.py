"""Megatron-Core (torch_dist) <-> Hugging Face names, as data, and the transforms beside them.

Names: a torch_dist key holds ALL layers stacked on a leading axis (and, for experts, all
experts on a second one), so one key maps to one HF name per layer: `*` in an HF name is
the layer index, `#` the expert index. Facts behind the transforms (checked numerically: an export's logits equal transformers'
on the same weights, tests/checkpoints_tools/test_export_hf.py):
  - fused QKV under GQA: rows grouped by query group, each group = its heads/groups query
    heads, then its key head, then its value head; HF keeps q, k, v apart in head order.
    No RoPE permutation: both sides rotate halves (rotary_interleaved=False).
  - SwiGLU fc1 = cat([gate, up]) globally (torch_dist holds the global tensor whatever the
    TP); Mixtral experts: w1 = gate, w3 = up, w2 = down.
  - vocabulary rows are padded to a multiple of make_vocab_size_divisible_by (NOT times TP
    here: our padded size is layout-invariant); HF holds exactly vocab_size rows.
  - GPT-2 (GPT2LMHeadModel: LayerNorm, GELU, learned positions, biases, MHA): its linear
    layers are Conv1D modules holding [in, out], the transpose of Megatron's [out, in];
    c_attn holds [all q | all k | all v] columns (and bias entries), split from Megatron's
    per-head grouping as for Llama.
  - Qwen3 (Qwen3ForCausalLM): Llama's names + self_attn.q_norm / k_norm = Megatron's
    q_layernorm / k_layernorm, [head_dim] each, applied per head before RoPE on both sides;
    head_dim is config.json's own field (it need not be hidden / heads).
  - Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention + mlp.gate = the router [experts, hidden]
    and per-expert mlp.experts.#.gate_proj / up_proj / down_proj (the names of the published
    safetensors; transformers 5 fuses them into 3-D gate_up_proj / down_proj parameters when it
    loads, and writes them back per expert when it saves). The top-k weights: HF's
    norm_topk_prob=true (softmax, top-k, renormalise) = Megatron-Core's default top-k-then-softmax
    (moe_router_pre_softmax=false); norm_topk_prob=false = moe_router_pre_softmax=true.
  - DeepSeek-V3 (DeepseekV3ForCausalLM: MLA + shared and routed experts, dense-first layers):
    checkpoints_tools/deepseek.py. Megatron-Core saves a model with dense and MoE layers under
    numbered keys (decoder.layers.3.mlp.router.weight; that layer's experts stacked on one axis):
    stacked_axes / stack_indices / layout_chunks read the layer number off the key.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional, Sequence

import torch

from checkpoints_tools import deepseek
from models.config import ModelConfig

LAYERS = "decoder.layers."
EXPERTS = "decoder.layers.mlp.experts.experts."
# Optimizer state keys: `optimizer.state.<exp_avg|exp_avg_sq|param>.<model key>`, with a
# `chained_<i>.` prefix when Megatron-Core chains optimizers (dense + expert params, MoE).
_OPTIMIZER_KEY = re.compile(r"^(?:chained_\d+\.)?optimizer\.")
_OPTIMIZER_STATE = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.[^.]+\.")
_NUMBERED_LAYER = re.compile(r"^decoder\.layers\.\d+\.")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One torch_dist key <-> one or more HF names through the named transform."""

    megatron: str
    hf: tuple[str, ...]
    transform: str = "copy"  # a key of TRANSFORMS


_GLOBAL_RULES = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
)
_OUTPUT_RULE = Rule("output_layer.weight", ("lm_head.weight",), "vocab")
_ATTENTION_RULES = (
    Rule("decoder.layers.self_attention.linear_qkv.layer_norm_weight", ("model.layers.*.input_layernorm.weight",)),
    Rule("decoder.layers.self_attention.linear_qkv.weight",
         ("model.layers.*.self_attn.q_proj.weight", "model.layers.*.self_attn.k_proj.weight",
          "model.layers.*.self_attn.v_proj.weight"), "qkv"),
    Rule("decoder.layers.self_attention.linear_proj.weight", ("model.layers.*.self_attn.o_proj.weight",)),
    Rule("decoder.layers.mlp.linear_fc1.layer_norm_weight", ("model.layers.*.post_attention_layernorm.weight",)),
)
# Qwen3: per-head RMSNorm of queries and keys, one head_dim-sized weight each (replicated over TP).
_QK_NORM_RULES = (
    Rule("decoder.layers.self_attention.q_layernorm.weight", ("model.layers.*.self_attn.q_norm.weight",)),
    Rule("decoder.layers.self_attention.k_layernorm.weight", ("model.layers.*.self_attn.k_norm.weight",)),
)
_DENSE_MLP_RULES = (
    Rule("decoder.layers.mlp.linear_fc1.weight",
         ("model.layers.*.mlp.gate_proj.weight", "model.layers.*.mlp.up_proj.weight"), "gate_up"),
    Rule("decoder.layers.mlp.linear_fc2.weight", ("model.layers.*.mlp.down_proj.weight",)),
)
_MOE_RULES = (
    Rule("decoder.layers.mlp.router.weight", ("model.layers.*.block_sparse_moe.gate.weight",)),
    Rule("decoder.layers.mlp.experts.experts.linear_fc1.weight",
         ("model.layers.*.block_sparse_moe.experts.#.w1.weight",
          "model.layers.*.block_sparse_moe.experts.#.w3.weight"), "gate_up"),
    Rule("decoder.layers.mlp.experts.experts.linear_fc2.weight",
         ("model.layers.*.block_sparse_moe.experts.#.w2.weight",)),
)
# Qwen3-MoE: the router is mlp.gate; experts are Llama-style MLPs (gate/up/down) under mlp.experts.#.
_QWEN3_MOE_RULES = (
    Rule("decoder.layers.mlp.router.weight", ("model.layers.*.mlp.gate.weight",)),
    Rule("decoder.layers.mlp.experts.experts.linear_fc1.weight",
         ("model.layers.*.mlp.experts.#.gate_proj.weight", "model.layers.*.mlp.experts.#.up_proj.weight"), "gate_up"),
    Rule("decoder.layers.mlp.experts.experts.linear_fc2.weight", ("model.layers.*.mlp.experts.#.down_proj.weight",)),
)

_GPT2_RULES = (
    Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",), "vocab"),
    Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
    Rule("decoder.layers.self_attention.linear_qkv.layer_norm_weight", ("transformer.h.*.ln_1.weight",)),
    Rule("decoder.layers.self_attention.linear_qkv.layer_norm_bias", ("transformer.h.*.ln_1.bias",)),
    Rule("decoder.layers.self_attention.linear_qkv.weight", ("transformer.h.*.attn.c_attn.weight",), "qkv_conv1d"),
    Rule("decoder.layers.self_attention.linear_qkv.bias", ("transformer.h.*.attn.c_attn.bias",), "qkv_concat"),
    Rule("decoder.layers.self_attention.linear_proj.weight", ("transformer.h.*.attn.c_proj.weight",), "conv1d"),
    Rule("decoder.layers.self_attention.linear_proj.bias", ("transformer.h.*.attn.c_proj.bias",)),
    Rule("decoder.layers.mlp.linear_fc1.layer_norm_weight", ("transformer.h.*.ln_2.weight",)),
    Rule("decoder.layers.mlp.linear_fc1.layer_norm_bias", ("transformer.h.*.ln_2.bias",)),
    Rule("decoder.layers.mlp.linear_fc1.weight", ("transformer.h.*.mlp.c_fc.weight",), "conv1d"),
    Rule("decoder.layers.mlp.linear_fc1.bias", ("transformer.h.*.mlp.c_fc.bias",)),
    Rule("decoder.layers.mlp.linear_fc2.weight", ("transformer.h.*.mlp.c_proj.weight",), "conv1d"),
    Rule("decoder.layers.mlp.linear_fc2.bias", ("transformer.h.*.mlp.c_proj.bias",)),
    Rule("decoder.final_layernorm.weight", ("transformer.ln_f.weight",)),
    Rule("decoder.final_layernorm.bias", ("transformer.ln_f.bias",)),
)

# Which dimension of one layer's (one expert's) tensor tensor parallelism splits, and
# whether it is a GLU fc1 (gate and up halves split separately, when the model is gated).
# Keys not listed are replicated across TP ranks (norms, router, row-parallel biases).
# Used only to cut a checkpoint into the chunks a target TP loads; any chunking loads.
TP_SPLIT: dict[str, tuple[int, bool]] = {
    "embedding.word_embeddings.weight": (0, False),
    "output_layer.weight": (0, False),
    "decoder.layers.self_attention.linear_qkv.weight": (0, False),
    "decoder.layers.self_attention.linear_qkv.bias": (0, False),
    "decoder.layers.self_attention.linear_proj.weight": (1, False),
    "decoder.layers.mlp.linear_fc1.weight": (0, True),
    "decoder.layers.mlp.linear_fc1.bias": (0, True),
    "decoder.layers.mlp.linear_fc2.weight": (1, False),
    "decoder.layers.mlp.experts.experts.linear_fc1.weight": (0, True),
    "decoder.layers.mlp.experts.experts.linear_fc2.weight": (1, False),
    # MLA (portable spec: column-parallel down and up projections) and DeepSeek's shared expert.
    "decoder.layers.self_attention.linear_q_down_proj.weight": (0, False),
    "decoder.layers.self_attention.linear_q_up_proj.weight": (0, False),
    "decoder.layers.self_attention.linear_kv_down_proj.weight": (0, False),
    "decoder.layers.self_attention.linear_kv_up_proj.weight": (0, False),
    "decoder.layers.mlp.shared_experts.linear_fc1.weight": (0, True),
    "decoder.layers.mlp.shared_experts.linear_fc2.weight": (1, False),
}

# Linear modules whose `_extra_state` (Transformer Engine's FP8 metadata; None on the
# portable spec) Megatron-Core saves as one ShardedObject per layer (per expert).
EXTRA_STATE_MODULES = {
    "dense": ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"),
    "moe": ("self_attention.linear_qkv", "self_attention.linear_proj"),
    "experts": ("linear_fc1", "linear_fc2"),
}


def rules_for(model: ModelConfig) -> list[Rule]:
    """The name rules of this architecture, in HF order (embeddings, layers, norm, head)."""
    family = hf_family(model)
    if family == "deepseek_v3":
        rules = [_GLOBAL_RULES[0], *(Rule(*r) for r in deepseek.rules(model)), _GLOBAL_RULES[1]]
    elif family == "gpt2":
        rules = list(_GPT2_RULES)
    else:
        mlp = (_QWEN3_MOE_RULES if model.qk_layernorm else _MOE_RULES) if model.is_moe else _DENSE_MLP_RULES
        qk = _QK_NORM_RULES if model.qk_layernorm else ()
        rules = [_GLOBAL_RULES[0], *_ATTENTION_RULES, *qk, *mlp, _GLOBAL_RULES[1]]
    if not model.tie_embeddings:
        rules.append(_OUTPUT_RULE)
    return rules


def _llama_problems(model: ModelConfig) -> list[str]:
    problems = []
    if model.normalization != "RMSNorm":
        problems.append(f"normalization={model.normalization} (Llama-family models use RMSNorm)")
    if model.activation != "swiglu":
        problems.append(f"activation={model.activation} (Llama-family models use SwiGLU)")
    if model.position_embedding != "rope":
        problems.append(f"position_embedding={model.position_embedding} (Llama-family models use RoPE)")
    if model.add_bias_linear or model.add_qkv_bias:
        problems.append("linear biases (add_bias_linear / add_qkv_bias)")
    if model.moe_shared_expert_hidden_size:
        problems.append("a shared expert (moe_shared_expert_hidden_size; Mixtral and Qwen3-MoE have none)")
    if model.moe_router_score_function != "softmax":
        problems.append(f"moe_router_score_function={model.moe_router_score_function} (Mixtral and Qwen3-MoE route "
                        "by softmax)")
    if model.moe_router_enable_expert_bias:
        problems.append("moe_router_enable_expert_bias=true (the aux-loss-free routing bias; Mixtral and Qwen3-MoE "
                        "have none)")
    if model.is_moe and model.moe_layer_freq != 1:
        problems.append("moe_layer_freq (dense layers among MoE ones; Mixtral and Qwen3-MoE here are all-MoE)")
    if model.moe_router_num_groups or model.moe_router_topk_scaling_factor:
        problems.append("group-limited routing / moe_router_topk_scaling_factor (DeepSeek-V3's; Mixtral and "
                        "Qwen3-MoE have neither)")
    return problems


def _qwen3_problems(model: ModelConfig) -> list[str]:
    """Qwen3 / Qwen3-MoE = the Llama family's parts + q/k RMSNorm (+ routed experts, either top-k
    weighting: norm_topk_prob)."""
    problems = _llama_problems(model)
    if not model.qk_layernorm:
        problems.append("no q/k norms (Qwen3 has qk_layernorm)")
    return problems


def _gpt2_problems(model: ModelConfig) -> list[str]:
    problems = []
    if model.normalization != "LayerNorm":
        problems.append(f"normalization={model.normalization} (GPT-2 uses LayerNorm)")
    if model.activation != "gelu":
        problems.append(f"activation={model.activation} (GPT-2 uses GELU)")
    if model.position_embedding != "learned_absolute":
        problems.append(f"position_embedding={model.position_embedding} (GPT-2 learns absolute positions)")
    if not (model.add_bias_linear and model.add_qkv_bias):
        problems.append("linears without biases (GPT-2 has add_bias_linear and add_qkv_bias)")
    if model.query_groups != model.num_attention_heads:
        problems.append(f"num_query_groups={model.num_query_groups} (GPT-2 is multi-head attention)")
    if model.head_dim * model.num_attention_heads != model.hidden_size:
        problems.append(f"kv_channels={model.kv_channels} (GPT-2's head size is hidden_size / heads)")
    if model.is_moe:
        problems.append("experts (GPT-2 is dense)")
    return problems


def hf_family(model: ModelConfig) -> str:
    """'llama' (Llama/Mistral/Mixtral: RMSNorm, SwiGLU, RoPE, no biases), 'qwen3' (the same +
    q/k RMSNorm, dense), 'qwen3_moe' (Qwen3 + routed experts, no shared expert) or 'gpt2'
    (GPT2LMHeadModel: LayerNorm, GELU, learned positions, biases, MHA); a ValueError naming the
    fields when none can express the model."""
    if model.multi_latent_attention:
        found = deepseek.problems(model)
        if not found:
            return "deepseek_v3"
        raise ValueError("this multi-latent-attention model has no DeepseekV3ForCausalLM equivalent: "
                         + "; ".join(found) + ". No other HF class holds MLA weights")
    if model.qk_layernorm:
        qwen3 = _qwen3_problems(model)
        if not qwen3:
            return "qwen3_moe" if model.is_moe else "qwen3"
        raise ValueError("this model has q/k norms but no Qwen3 equivalent: " + "; ".join(qwen3) + ". Export/import "
                         "supports q/k norms as Qwen3ForCausalLM / Qwen3MoeForCausalLM: RMSNorm + SwiGLU + RoPE, no "
                         "biases, no shared expert")
    llama, gpt2 = _llama_problems(model), _gpt2_problems(model)
    if model.moe_router_pre_softmax:
        # Mixtral always renormalises its top-k weights (no norm_topk_prob switch).
        llama.append("moe_router_pre_softmax=true (Mixtral renormalises the top-k weights)")
    if not llama:
        return "llama"
    if not gpt2:
        return "gpt2"
    raise ValueError("this model has no Llama/Mistral/Mixtral or GPT-2 equivalent: as Llama: " + "; ".join(llama)
                     + "; as GPT-2: " + "; ".join(gpt2) + ". Export/import supports RMSNorm + SwiGLU + RoPE "
                     "decoders without biases (+ q/k norms: Qwen3), and (export) GPT-2: LayerNorm + GELU + "
                     "learned positions + biases")


def check_hf_compatible(model: ModelConfig) -> None:
    """Refuse architectures no HF class of ours can express, naming the field."""
    hf_family(model)


def is_optimizer_key(key: str) -> bool:
    return bool(_OPTIMIZER_KEY.match(key))


def model_key(key: str) -> str:
    """`[chained_0.]optimizer.state.exp_avg.<model key>` -> `<model key>`; model keys unchanged."""
    return _OPTIMIZER_STATE.sub("", key, count=1)


def generic_key(key: str) -> str:
    """A model key without its layer number (Megatron-Core's numbered keys of non-homogeneous
    layers, e.g. DeepSeek's dense-first layers: decoder.layers.3.x -> decoder.layers.x)."""
    return _NUMBERED_LAYER.sub(LAYERS, model_key(key), count=1)


def is_expert_key(key: str) -> bool:
    return generic_key(key).startswith(EXPERTS)


def stacked_axes(key: str) -> int:
    """Leading axes of a torch_dist key that index layers and experts: 2 for stacked experts,
    1 for other stacked layer keys and for a numbered layer's experts, else 0."""
    key = model_key(key)
    numbered = _NUMBERED_LAYER.match(key) is not None
    if is_expert_key(key):
        return 1 if numbered else 2
    return 1 if key.startswith(LAYERS) and not numbered else 0


def layer_of(key: str, index: tuple) -> Optional[int]:
    """The layer a (key, stack index) belongs to; None for keys outside the decoder layers."""
    numbered = deepseek.layer_of(model_key(key))
    if numbered is not None:
        return numbered
    return index[0] if stacked_axes(key) else None


def hf_name(pattern: str, layer: Optional[int] = None, expert: Optional[int] = None) -> str:
    """`*` -> layer, `#` -> expert. A numbered layer's pattern has its layer already and `#`
    only: its one index (stack_indices of a numbered expert key) is the expert."""
    if "*" not in pattern and "#" in pattern and expert is None:
        layer, expert = None, layer
    name = pattern if layer is None else pattern.replace("*", str(layer))
    return name if expert is None else name.replace("#", str(expert))


def layer_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer (per-expert) shape of every torch_dist model tensor, from the config alone."""
    h, d = model.hidden_size, model.head_dim
    vp = model.padded_vocab_size
    if model.multi_latent_attention:
        shapes = {"embedding.word_embeddings.weight": (vp, h), "decoder.final_layernorm.weight": (h,),
                  **deepseek.layer_shapes(model)}
        if not model.tie_embeddings:
            shapes["output_layer.weight"] = (vp, h)
        return shapes
    qkv = (model.num_attention_heads + 2 * model.query_groups) * d
    fc1 = (2 if model.gated else 1) * (model.expert_ffn_hidden_size if model.is_moe else model.ffn_hidden_size)
    shapes = {
        "embedding.word_embeddings.weight": (vp, h),
        "decoder.final_layernorm.weight": (h,),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (h,),
        "decoder.layers.self_attention.linear_qkv.weight": (qkv, h),
        "decoder.layers.self_attention.linear_proj.weight": (h, model.num_attention_heads * d),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (h,),
    }
    if model.is_moe:
        shapes["decoder.layers.mlp.router.weight"] = (model.num_experts, h)
        shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] = (fc1, h)
        shapes["decoder.layers.mlp.experts.experts.linear_fc2.weight"] = (h, model.expert_ffn_hidden_size)
    else:
        shapes["decoder.layers.mlp.linear_fc1.weight"] = (fc1, h)
        shapes["decoder.layers.mlp.linear_fc2.weight"] = (h, model.ffn_hidden_size)
    if not model.tie_embeddings:
        shapes["output_layer.weight"] = (vp, h)
    if model.position_embedding == "learned_absolute":
        shapes["embedding.position_embeddings.weight"] = (model.max_seq_length, h)
    if model.normalization == "LayerNorm":
        for key in ("decoder.final_layernorm.bias", "decoder.layers.self_attention.linear_qkv.layer_norm_bias",
                    "decoder.layers.mlp.linear_fc1.layer_norm_bias"):
            shapes[key] = (h,)
    if model.qk_layernorm:
        for norm in ("q_layernorm", "k_layernorm"):
            shapes[f"decoder.layers.self_attention.{norm}.weight"] = (d,)
            if model.normalization == "LayerNorm":
                shapes[f"decoder.layers.self_attention.{norm}.bias"] = (d,)
    if model.add_qkv_bias:
        shapes["decoder.layers.self_attention.linear_qkv.bias"] = (qkv,)
    if model.add_bias_linear and not model.is_moe:
        shapes["decoder.layers.self_attention.linear_proj.bias"] = (h,)
        shapes["decoder.layers.mlp.linear_fc1.bias"] = (fc1,)
        shapes["decoder.layers.mlp.linear_fc2.bias"] = (h,)
    return shapes


def global_shape(model: ModelConfig, key: str) -> tuple[int, ...]:
    """The stacked (global) shape torch_dist stores for a model key."""
    axes = stacked_axes(key)
    if axes == 1 and is_expert_key(key):  # a numbered layer's experts
        return (model.num_experts,) + layer_shapes(model)[key]
    lead = {0: (), 1: (model.num_layers,), 2: (model.num_layers, model.num_experts or 1)}[axes]
    return lead + layer_shapes(model)[key]


def stack_indices(model: ModelConfig, key: str) -> list[tuple[int, ...]]:
    """Every (layer[, expert]) index of a key: () for an unstacked key."""
    axes = stacked_axes(key)
    if axes == 0:
        return [()]
    if axes == 1 and is_expert_key(key):  # a numbered layer's experts
        return [(e,) for e in range(model.num_experts)]
    if axes == 1:
        return [(layer,) for layer in range(model.num_layers)]
    return [(layer, e) for layer in range(model.num_layers) for e in range(model.num_experts)]


def extra_state_keys(model: ModelConfig) -> list[str]:
    """The ShardedObject keys Megatron-Core expects for `_extra_state` (layout-invariant)."""
    if model.multi_latent_attention:
        return deepseek.extra_state_keys(model)
    n, keys = model.num_layers, []
    modules = EXTRA_STATE_MODULES["moe" if model.is_moe else "dense"]
    for layer in range(n):
        keys += [f"{LAYERS}{m}._extra_state/shard_{layer}_{n}" for m in modules]
        if model.is_moe:
            e = model.num_experts
            keys += [f"{EXPERTS}{m}._extra_state/shard_{layer}.{x}_{n}.{e}"
                     for x in range(e) for m in EXTRA_STATE_MODULES["experts"]]
    return keys


# --- transforms: one layer's (one expert's) tensor <-> the HF tensors -------------------

def split_qkv(qkv: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, ...]:
    """Megatron's grouped [q heads of group g; k_g; v_g]... rows (weight or bias) -> HF q, k, v."""
    groups, d = model.query_groups, model.head_dim
    per_group = model.num_attention_heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group + 2, d, *rest)
    q = grouped[:, :per_group].reshape(groups * per_group * d, *rest)
    k = grouped[:, per_group].reshape(groups * d, *rest)
    v = grouped[:, per_group + 1].reshape(groups * d, *rest)
    return q, k, v


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """HF q, k, v -> Megatron's fused rows, grouped by query group (inverse of split_qkv)."""
    groups, d = model.query_groups, model.head_dim
    per_group = model.num_attention_heads // groups
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(groups, per_group, d, *rest), k.reshape(groups, 1, d, *rest),
                         v.reshape(groups, 1, d, *rest)], dim=1)
    return grouped.reshape(-1, *rest)


def _qkv_split_sizes(model: ModelConfig) -> list[int]:
    d = model.head_dim
    return [model.num_attention_heads * d, model.query_groups * d, model.query_groups * d]


def qkv_to_concat(qkv: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor]:
    """Megatron's per-group QKV bias -> GPT-2's [all q | all k | all v]."""
    return (torch.cat(split_qkv(qkv, model)),)


def concat_to_qkv(concat: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    return fuse_qkv(*concat.split(_qkv_split_sizes(model)), model)


def qkv_to_conv1d(qkv: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor]:
    """Megatron's per-group QKV weight [out, in] -> GPT-2's c_attn Conv1D [in, q|k|v]."""
    return (torch.cat(split_qkv(qkv, model)).t(),)


def conv1d_to_qkv(weight: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    return concat_to_qkv(weight.t(), model)


def to_conv1d(weight: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor]:
    """Linear [out, in] -> GPT-2's Conv1D [in, out]."""
    return (weight.t(),)


def from_conv1d(weight: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    return weight.t()


def split_gate_up(fc1: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, ...]:
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)


def unpad_vocab(rows: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor]:
    """Drop the padding rows: HF holds exactly vocab_size rows."""
    return (rows[: model.vocab_size],)


def pad_vocab(rows: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """Zero rows up to the padded size (never looked up; their logits are masked to -inf:
    models/padded_vocab.py)."""
    extra = model.padded_vocab_size - rows.shape[0]
    return torch.cat([rows, rows.new_zeros(extra, *rows.shape[1:])]) if extra else rows


def _copy_out(tensor: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor]:
    return (tensor,)


def _copy_in(tensor: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    return tensor


# name -> (to HF: megatron layer tensor -> HF tensors, from HF: HF tensors -> megatron tensor)
TRANSFORMS: dict[str, tuple[Callable[..., Sequence[torch.Tensor]], Callable[..., torch.Tensor]]] = {
    "copy": (_copy_out, _copy_in),
    "qkv": (split_qkv, fuse_qkv),
    "gate_up": (split_gate_up, fuse_gate_up),
    "vocab": (unpad_vocab, pad_vocab),
    "qkv_conv1d": (qkv_to_conv1d, conv1d_to_qkv),
    "qkv_concat": (qkv_to_concat, concat_to_qkv),
    "conv1d": (to_conv1d, from_conv1d),
}


def to_hf(rule: Rule, tensor: torch.Tensor, model: ModelConfig) -> Sequence[torch.Tensor]:
    return TRANSFORMS[rule.transform][0](tensor, model)


def from_hf(rule: Rule, tensors: Sequence[torch.Tensor], model: ModelConfig) -> torch.Tensor:
    return TRANSFORMS[rule.transform][1](*tensors, model)


def hf_layer_shapes(rule: Rule, model: ModelConfig) -> list[tuple[int, ...]]:
    """Shapes of the HF tensors of one rule (per layer/expert), by running the transform on
    a meta tensor: shapes can never disagree with what the transform produces."""
    meta = torch.empty(layer_shapes(model)[rule.megatron], device="meta")
    return [tuple(t.shape) for t in to_hf(rule, meta, model)]
