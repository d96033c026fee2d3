"""Architecture config (`ModelConfig`) and the named flavors.

A flavor is a function-free dict entry built from a base with `model_copy(update=...)`,
so variants never copy-paste whole edit lists.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from models.suggest import did_you_mean


class ModelConfig(BaseModel):
    """Architecture of a GPT/Llama-family decoder (dense or MoE).

    Field names follow Megatron-Core's `TransformerConfig` where one exists, so
    `models.build.transformer_config` reads as a plain mapping.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    # None means multi-head attention (one KV head per query head).
    num_query_groups: Optional[int] = Field(default=None, gt=0)
    # Head size; None means hidden_size // num_attention_heads. Qwen3 decouples the two
    # (Qwen3-0.6B: hidden 1024, 16 heads of 128), so the attention width n * kv_channels may
    # differ from hidden_size; TP splits heads, so TP | heads keeps every rank's width whole.
    kv_channels: Optional[int] = Field(default=None, gt=0)
    # Per-head RMSNorm (LayerNorm with normalization=LayerNorm) of queries and keys before
    # RoPE, with one weight of size head_dim shared by all heads (Qwen3, OLMo-2-style
    # stabilisation). Megatron-Core's qk_layernorm; its eps is norm_eps.
    qk_layernorm: bool = False
    vocab_size: int = Field(gt=0)
    # Vocab is padded to a multiple of this so TP can split it. Unlike Megatron-LM we do NOT
    # multiply by TP: the padded size (and so the loss over padded logits) must not change
    # with the layout, or layouts could not be compared step for step. TP must divide it.
    make_vocab_size_divisible_by: int = Field(default=128, gt=0)
    max_seq_length: int = Field(gt=0)
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    norm_eps: float = 1e-5
    activation: Literal["swiglu", "gelu"] = "swiglu"
    position_embedding: Literal["rope", "learned_absolute"] = "rope"
    rope_base: float = 10000.0
    # Llama-3.1 style frequency scaling (HF rope_type "llama3"): RoPE wavelengths longer than
    # original_max_position_embeddings / low_freq_factor are stretched by the factor, those
    # shorter than original / high_freq_factor kept, the band between interpolated smoothly.
    # Defaults are Llama-3.1's (8, 1, 4, 8192); older configs without the last three load with them.
    rope_scaling: bool = False
    rope_scaling_factor: float = Field(default=8.0, gt=0)
    rope_scaling_low_freq_factor: float = Field(default=1.0, gt=0)
    rope_scaling_high_freq_factor: float = Field(default=4.0, gt=0)
    rope_scaling_original_max_position_embeddings: int = Field(default=8192, gt=0)
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    tie_embeddings: bool = False
    init_std: float = Field(default=0.02, gt=0)

    # Multi-latent attention (DeepSeek-V2/V3; Megatron-Core's MLATransformerConfig, same names).
    # Queries: h -> q_lora_rank (RMSNorm) -> heads x (qk_head_dim + qk_pos_emb_head_dim), or
    # h -> heads x (...) directly when q_lora_rank is None. Keys/values: h -> kv_lora_rank
    # (RMSNorm) -> heads x (qk_head_dim + v_head_dim), plus one RoPE key of qk_pos_emb_head_dim
    # shared by all heads. Softmax scale 1/sqrt(qk_head_dim + qk_pos_emb_head_dim). The latent
    # norms are always on (qk_layernorm is the per-head q/k norm of Qwen3: refused with MLA).
    # RoPE is plain (rope_base) unless yarn_scaling_factor is set (below).
    multi_latent_attention: bool = False
    # MLA's query latent width (DeepSeek-V3: 1536); None = queries projected from h directly.
    q_lora_rank: Optional[int] = Field(default=None, gt=0)
    # MLA's key/value latent width (DeepSeek-V3: 512); required with MLA.
    kv_lora_rank: Optional[int] = Field(default=None, gt=0)
    # MLA's per-head q/k channels without RoPE (DeepSeek-V3's qk_nope_head_dim: 128).
    qk_head_dim: Optional[int] = Field(default=None, gt=0)
    # MLA's per-head q/k RoPE channels (DeepSeek-V3's qk_rope_head_dim: 64; even).
    qk_pos_emb_head_dim: Optional[int] = Field(default=None, gt=0)
    # MLA's per-head value channels (DeepSeek-V3: 128).
    v_head_dim: Optional[int] = Field(default=None, gt=0)
    # YaRN RoPE for MLA (HF rope_type "yarn"; Megatron-Core's MLATransformerConfig rope_type="yarn",
    # its rotary_scaling_factor, original_max_position_embeddings, beta_fast/slow, mscale,
    # mscale_all_dim): RoPE frequencies of wavelengths past original / beta_slow are divided by
    # the factor, those within original / beta_fast kept, a linear ramp between; cos/sin scaled
    # by (0.1 mscale ln f + 1) / (0.1 mscale_all_dim ln f + 1), the softmax scale by
    # (0.1 mscale_all_dim ln f + 1)^2. None = plain RoPE. DeepSeek-V3's released long-context
    # model: factor 40, original 4096, 32, 1, mscale 1, mscale_all_dim 1 (these defaults).
    yarn_scaling_factor: Optional[float] = Field(default=None, gt=1)
    yarn_original_max_position_embeddings: int = Field(default=4096, gt=0)
    yarn_beta_fast: float = Field(default=32.0, gt=0)
    yarn_beta_slow: float = Field(default=1.0, gt=0)
    yarn_mscale: float = Field(default=1.0, ge=0)
    yarn_mscale_all_dim: float = Field(default=1.0, ge=0)

    # muP (maximal update parametrization) on Megatron-Core's own: TransformerConfig's use_mup,
    # mup_* (same names, same defaults; transformer_config.py) and Megatron-Core's optimizer rule
    # (optimizer.get_mup_config_overrides: AdamW LR and eps of hidden matrices / width_mult).
    # width_mult = hidden_size / mup_base_hidden_size; None = hidden_size (width_mult 1).
    # Init: hidden matrices std / sqrt(width_mult), embedding and output layer unscaled.
    # Forward: embeddings x mup_embedding_mult, logits x mup_output_mult (None = Megatron's
    # auto 1 / width_mult), attention softmax scale sqrt(mup_base_head_dim) / head_dim **
    # mup_attn_scale_power (base_head_dim None: 1 / head_dim ** power). Tied embeddings are
    # allowed: Megatron-Core keeps the shared matrix at the base LR and scales the logits.
    use_mup: bool = False
    mup_base_hidden_size: Optional[int] = Field(default=None, gt=0)
    mup_embedding_mult: float = Field(default=1.0, gt=0)
    mup_output_mult: Optional[float] = Field(default=None, gt=0)
    mup_base_head_dim: Optional[int] = Field(default=None, gt=0)
    # 1.0 = muP (1/d), 0.5 = standard (1/sqrt(d)); powers outside [0.5, 1] are neither: refused.
    mup_attn_scale_power: float = Field(default=1.0, ge=0.5, le=1.0)

    # Mixture of experts (None = dense).
    num_experts: Optional[int] = Field(default=None, gt=0)
    moe_router_topk: int = Field(default=2, gt=0)
    moe_ffn_hidden_size: Optional[int] = Field(default=None, gt=0)
    # How the top-k experts' weights are computed (Megatron-Core's moe_router_pre_softmax).
    # False: the top-k logits, then a softmax over those k, so the k weights sum to 1; this equals
    # a softmax over all experts renormalised over the top k (HF's norm_topk_prob=true:
    # Mixtral, Qwen3-30B-A3B). True: a softmax over all experts, then the top k, weights kept
    # as they are (HF's norm_topk_prob=false); the only form that gives top-1 a gradient.
    moe_router_pre_softmax: bool = False
    # Router scores (Megatron-Core's moe_router_score_function): softmax, or sigmoid per expert
    # (DeepSeek-V3), whose top-k scores are renormalised to sum to 1 when top-k > 1.
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    # Aux-loss-free load balancing (DeepSeek-V3; Megatron-Core's moe_router_enable_expert_bias):
    # a per-expert bias, added to the scores only to choose the top k, moves after every
    # global batch by +-moe_router_bias_update_rate toward the mean load (finalize_model_grads
    # counts the tokens over TP x CP x DP). Starts at zero; a buffer kept in checkpoints.
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: Optional[float] = Field(default=None, gt=0)  # None: 1e-3 (Megatron-Core's)
    moe_shared_expert_hidden_size: Optional[int] = Field(default=None, gt=0)
    # Which layers are MoE (Megatron-Core's moe_layer_freq): N = every N-th layer from the first
    # (1 = all), or a 0/1 list with one entry per layer (0 = dense MLP of ffn_hidden_size).
    # DeepSeek-V3's first_k_dense_replace=3 is [0, 0, 0, 1, ...].
    moe_layer_freq: int | list[int] = 1
    # Group-limited routing (DeepSeek-V3's n_group / topk_group): experts in
    # moe_router_num_groups equal groups; each token picks moe_router_group_topk groups (by the
    # sum of each group's top topk/group_topk scores), then its top k experts inside them.
    moe_router_num_groups: Optional[int] = Field(default=None, gt=0)
    # Groups each token chooses (DeepSeek-V3: 4 of 8); set with moe_router_num_groups.
    moe_router_group_topk: Optional[int] = Field(default=None, gt=0)
    # Routed-expert weights times this (DeepSeek-V3's routed_scaling_factor 2.5); None = 1.
    moe_router_topk_scaling_factor: Optional[float] = Field(default=None, gt=0)
    # Load-balancing (Switch) aux loss weight; 0 turns it off. Logged as `moe_aux_loss`.
    moe_aux_loss_coeff: float = Field(default=1e-2, ge=0)
    # Router z-loss weight (ST-MoE); None = off.
    moe_z_loss_coeff: Optional[float] = Field(default=None, gt=0)
    # Expert capacity as a multiple of the even share (tokens x top-k / experts); tokens over
    # capacity are dropped. None = no dropping (every routed token is computed).
    moe_capacity_factor: Optional[float] = Field(default=None, gt=0)
    # Which tokens to drop when over capacity: lowest router probability, or latest position.
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    # Pad every expert's input to its capacity (fixed shapes); needs moe_capacity_factor.
    moe_pad_to_capacity: bool = False

    # Multi-token prediction (DeepSeek-V3; Megatron-Core's mtp_num_layers / mtp_loss_scaling_factor,
    # its MultiTokenPredictionBlock). Each MTP layer k (1..N) on the last pipeline stage joins the
    # previous depth's hidden state with the embedding of token i+k (each normed, concatenated, a
    # 2h -> h projection), runs one transformer layer shaped like the model's last one and the
    # shared output layer, and predicts token i+k+1. Training only: the main logits do not
    # depend on it (models.build; HF export drops it). 0 = off. DeepSeek-V3: 1 layer.
    mtp_num_layers: int = Field(default=0, ge=0)
    # The MTP losses' weight in the training loss: scaling_factor / N per layer (DeepSeek-V3's
    # lambda: 0.3 early, 0.1 later). 0.1 is Megatron-Core's default.
    mtp_loss_scaling_factor: float = Field(default=0.1, gt=0)

    @model_validator(mode="after")
    def _check_shapes(self) -> "ModelConfig":
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups={self.num_query_groups} must divide "
                f"num_attention_heads={self.num_attention_heads}; valid: "
                f"{divisors(self.num_attention_heads)}"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; set kv_channels explicitly or change one of them"
            )
        if self.position_embedding == "rope" and self.head_dim % 2:
            # RoPE rotates pairs of channels; Megatron-Core's rotary code fails at the first
            # forward ("The size of tensor a (15) must match the size of tensor b (16)").
            heads = self.num_attention_heads
            near = sorted({max(2, self.head_dim - 1), self.head_dim + 1})
            raise ValueError(
                f"position_embedding=rope needs an even head dimension (RoPE rotates pairs of channels), but "
                f"{'kv_channels' if self.kv_channels else f'hidden_size / num_attention_heads = {self.hidden_size}/{heads}'}"
                f" = {self.head_dim}; e.g. hidden_size={' or '.join(str(heads * d) for d in near)}, or an even kv_channels"
            )
        if self.position_embedding == "rope" and (self.rope_base <= 1 or self.rope_base != int(self.rope_base)):
            # Megatron-Core takes an integer rotary_base (models.build passes int(rope_base)): a
            # fraction was cut off silently, and a base <= 1 gave a NaN loss at step 1.
            raise ValueError(f"rope_base={self.rope_base} must be a whole number above 1 (Megatron-Core's rotary "
                             "base is an integer; Llama uses 10000 or 500000)")
        if self.rope_scaling_low_freq_factor >= self.rope_scaling_high_freq_factor:
            raise ValueError(
                f"rope_scaling_low_freq_factor={self.rope_scaling_low_freq_factor} must be below "
                f"rope_scaling_high_freq_factor={self.rope_scaling_high_freq_factor} (Llama-3.1: 1 and 4)"
            )
        if self.num_experts is not None and self.moe_router_topk > self.num_experts:
            raise ValueError(
                f"moe_router_topk={self.moe_router_topk} exceeds num_experts={self.num_experts}"
            )
        if self.num_experts is not None and self.moe_router_topk == 1 and not self.moe_router_pre_softmax:
            # Megatron-Core accepts top-1 only with a softmax before the top-k (transformer_config.py,
            # "Please use --moe-router-pre-softmax when topk is 1"): a softmax over one logit is 1
            # and gives the router no gradient.
            raise ValueError(f"moe_router_topk=1 needs moe_router_pre_softmax=true (a softmax over one expert is "
                             f"constant: the router would never learn); or use top-k 2..{self.num_experts}")
        if self.num_experts is not None and self.moe_shared_expert_hidden_size and self.add_bias_linear:
            # megatron/core/transformer/moe/shared_experts.py: "bias is not supported in the shared experts".
            raise ValueError("moe_shared_expert_hidden_size needs add_bias_linear=false (Megatron-Core's shared "
                             "expert has no biases)")
        self._check_router()
        self._check_mla()
        moe_only = {"moe_ffn_hidden_size": self.moe_ffn_hidden_size,
                    "moe_shared_expert_hidden_size": self.moe_shared_expert_hidden_size,
                    "moe_capacity_factor": self.moe_capacity_factor,
                    "moe_z_loss_coeff": self.moe_z_loss_coeff,
                    "moe_router_num_groups": self.moe_router_num_groups,
                    "moe_router_group_topk": self.moe_router_group_topk,
                    "moe_router_topk_scaling_factor": self.moe_router_topk_scaling_factor}
        set_without_experts = [k for k, v in moe_only.items() if v is not None]
        for flag in ("moe_router_pre_softmax", "moe_router_enable_expert_bias"):
            if getattr(self, flag):
                set_without_experts.append(flag)
        if self.moe_router_score_function != "softmax":
            set_without_experts.append("moe_router_score_function")
        if self.moe_layer_freq != 1:
            set_without_experts.append("moe_layer_freq")
        if self.num_experts is None and set_without_experts:
            raise ValueError(f"{', '.join(set_without_experts)} need(s) a MoE model; set num_experts")
        if self.num_experts is not None:
            self._check_moe_layers()
        if not self.use_mup:
            mup_keys = {"mup_base_hidden_size": None, "mup_embedding_mult": 1.0, "mup_output_mult": None,
                        "mup_base_head_dim": None, "mup_attn_scale_power": 1.0}
            set_keys = [k for k, default in mup_keys.items() if getattr(self, k) != default]
            if set_keys:
                # Megatron-Core reads them only with use_mup: they would silently do nothing.
                raise ValueError(f"{set_keys[0]} is set but use_mup=false; set use_mup=true or remove it")
        elif self.mup_base_hidden_size is not None and self.mup_base_hidden_size > self.hidden_size:
            # width_mult < 1 would raise hidden LRs above the tuned base LR: a base wider than
            # the model is a swapped pair, not a proxy.
            raise ValueError(f"mup_base_hidden_size={self.mup_base_hidden_size} exceeds hidden_size="
                             f"{self.hidden_size}; the base is the small proxy model's width (<= hidden_size)")
        if self.moe_pad_to_capacity and self.moe_capacity_factor is None:
            raise ValueError("moe_pad_to_capacity=true needs moe_capacity_factor (the capacity to pad to)")
        if self.mtp_loss_scaling_factor != 0.1 and not self.mtp_num_layers:
            # Megatron-Core reads it only with MTP layers: it would silently do nothing.
            raise ValueError("mtp_loss_scaling_factor is set but mtp_num_layers=0; set mtp_num_layers (DeepSeek-V3: 1) "
                             "or remove it")
        return self

    def _check_router(self) -> None:
        if self.moe_router_score_function == "sigmoid" and self.moe_router_pre_softmax:
            raise ValueError("moe_router_pre_softmax=true is a softmax option; with moe_router_score_function=sigmoid "
                             "set it false (sigmoid scores are renormalised over the top k)")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            # Megatron-Core's TransformerConfig refuses it too ("Expert bias for aux-loss-free
            # routing only supports 'sigmoid' and 'sqrtsoftplus' score functions").
            raise ValueError("moe_router_enable_expert_bias=true needs moe_router_score_function=sigmoid "
                             "(Megatron-Core adds the bias to sigmoid scores only)")
        if self.moe_router_bias_update_rate is not None and not self.moe_router_enable_expert_bias:
            raise ValueError("moe_router_bias_update_rate is set but moe_router_enable_expert_bias=false: it would "
                             "change nothing; set moe_router_enable_expert_bias=true or drop the rate")

    def _check_mla(self) -> None:
        mla = {"q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank, "qk_head_dim": self.qk_head_dim,
               "qk_pos_emb_head_dim": self.qk_pos_emb_head_dim, "v_head_dim": self.v_head_dim}
        if not self.multi_latent_attention:
            stray = [k for k, v in {**mla, "yarn_scaling_factor": self.yarn_scaling_factor}.items() if v is not None]
            if stray:
                raise ValueError(f"{', '.join(stray)} need(s) multi_latent_attention=true; set it, or remove them")
            return
        if self.yarn_scaling_factor is not None and self.yarn_beta_slow >= self.yarn_beta_fast:
            raise ValueError(f"yarn_beta_slow={self.yarn_beta_slow:g} must be below yarn_beta_fast={self.yarn_beta_fast:g} "
                             "(DeepSeek-V3: 1 and 32)")
        missing = [k for k, v in mla.items() if v is None and k != "q_lora_rank"]
        if missing:
            raise ValueError(f"multi_latent_attention=true needs {', '.join(missing)} (DeepSeek-V3: kv_lora_rank=512, "
                             "qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128; q_lora_rank=1536 or unset)")
        clashes = {"num_query_groups": self.num_query_groups is not None and self.num_query_groups != self.num_attention_heads,
                   "kv_channels": self.kv_channels is not None, "qk_layernorm": self.qk_layernorm,
                   "add_bias_linear": self.add_bias_linear, "add_qkv_bias": self.add_qkv_bias,
                   "rope_scaling": self.rope_scaling, "use_mup": self.use_mup,
                   "position_embedding=learned_absolute": self.position_embedding != "rope"}
        bad = [k for k, v in clashes.items() if v]
        if bad:
            # MLA sets its own head sizes (qk_/v_head_dim), has one K/V head per query head and
            # always-on latent norms, no biases (Megatron-Core's MLASelfAttention), and RoPE of its own.
            raise ValueError(f"multi_latent_attention=true does not combine with {bad[0]}; remove it (MLA's head "
                             "sizes are qk_head_dim / qk_pos_emb_head_dim / v_head_dim, its latent norms are "
                             "always on, it has no biases and its own RoPE, plain or YaRN: yarn_scaling_factor)")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} must be even (RoPE rotates pairs "
                             "of channels)")

    def _check_moe_layers(self) -> None:
        freq, n = self.moe_layer_freq, self.num_layers
        if isinstance(freq, int) and not 1 <= freq <= n:
            raise ValueError(f"moe_layer_freq={freq} must be between 1 and num_layers={n} (every N-th layer is MoE)")
        if isinstance(freq, list) and (len(freq) != n or set(freq) - {0, 1} or 1 not in freq):
            raise ValueError(f"moe_layer_freq as a list needs num_layers={n} entries of 0 (dense) or 1 (MoE), at "
                             f"least one 1; got {freq}")
        groups, group_topk, e, k = self.moe_router_num_groups, self.moe_router_group_topk, self.num_experts, \
            self.moe_router_topk
        if (groups is None) != (group_topk is None):
            raise ValueError("group-limited routing needs both moe_router_num_groups and moe_router_group_topk "
                             "(DeepSeek-V3: 8 and 4), or neither")
        if groups is None:
            return
        if e % groups:
            raise ValueError(f"moe_router_num_groups={groups} does not divide num_experts={e}; valid: {divisors(e)}")
        if group_topk > groups:
            raise ValueError(f"moe_router_group_topk={group_topk} exceeds moe_router_num_groups={groups}")
        if k % group_topk or k > group_topk * (e // groups):
            # Megatron-Core scores a group by the sum of its top (topk / group_topk) experts.
            raise ValueError(f"moe_router_topk={k} must be a multiple of moe_router_group_topk={group_topk} and at "
                             f"most group_topk x experts per group = {group_topk * (e // groups)}")

    @property
    def moe_layer_pattern(self) -> list[int]:
        """1 (MoE) or 0 (dense) per layer, as Megatron-Core reads moe_layer_freq; [] for a dense model."""
        if not self.is_moe:
            return []
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            return list(freq)
        return [1 if i % freq == 0 else 0 for i in range(self.num_layers)]

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_pattern)

    @property
    def q_head_dim(self) -> int:
        """MLA's query/key head size (the no-RoPE and RoPE parts); head_dim without MLA."""
        if not self.multi_latent_attention:
            return self.head_dim
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    @property
    def expert_bias_update_rate(self) -> float:
        return self.moe_router_bias_update_rate or 1e-3

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return math.ceil(self.vocab_size / m) * m

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    @property
    def mup_width_mult(self) -> float:
        """hidden_size / mup_base_hidden_size (Megatron-Core's formula); 1.0 without muP."""
        if not self.use_mup:
            return 1.0
        return self.hidden_size / (self.mup_base_hidden_size or self.hidden_size)

    @property
    def mup_forward(self) -> tuple[float, float, float]:
        """(embedding multiplier, logit multiplier, attention softmax scale) as Megatron-Core's
        TransformerConfig derives them (transformer_config.py, __post_init__'s muP block)."""
        if not self.use_mup:
            return 1.0, 1.0, self.head_dim ** -0.5
        width = self.mup_width_mult
        output = self.mup_output_mult if self.mup_output_mult is not None else (1.0 / width if width != 1.0 else 1.0)
        base = 1.0 if self.mup_base_head_dim is None else self.mup_base_head_dim ** 0.5
        return self.mup_embedding_mult, output, base / self.head_dim ** self.mup_attn_scale_power

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_LLAMA2_7B = ModelConfig(
    num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
    vocab_size=32000, max_seq_length=4096, norm_eps=1e-5, rope_base=10000.0,
)
_LLAMA3_8B = ModelConfig(
    num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
    num_query_groups=8, vocab_size=128256, max_seq_length=8192, norm_eps=1e-5,
    rope_base=500000.0,
)
_TINY_LLAMA = ModelConfig(
    # GQA (8 heads, 2 groups), RoPE, SwiGLU, RMSNorm, untied; vocab 4000 pads to 4096.
    num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=8,
    num_query_groups=2, vocab_size=4000, max_seq_length=256, norm_eps=1e-5,
    rope_base=10000.0,
)
# Qwen3-8B: the published config.json of Qwen/Qwen3-8B-Base (hidden 4096, 36 layers, 32 heads, 8
# KV heads, head_dim 128, intermediate 12288, vocab 151936, rope_theta 1e6, rms_norm_eps 1e-6,
# max_position_embeddings 32768, untied, no attention bias); Qwen3 = Llama + q/k RMSNorm. Here
# head_dim equals hidden / heads, but Qwen3 states it separately, so kv_channels is explicit.
_QWEN3_8B = ModelConfig(
    num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32,
    num_query_groups=8, kv_channels=128, vocab_size=151936, max_seq_length=32768, norm_eps=1e-6,
    rope_base=1000000.0, qk_layernorm=True,
)
# tiny-llama's shape with Qwen3's parts: q/k norms, head_dim 32 != hidden / heads = 16 (the
# attention is 256 wide on a 128-wide residual), GQA 8 heads / 2 groups, Qwen3's eps and theta.
_TINY_QWEN3 = _TINY_LLAMA.model_copy(update=dict(kv_channels=32, qk_layernorm=True, norm_eps=1e-6,
                                                 rope_base=1000000.0))
# Qwen3-30B-A3B: the published config.json of Qwen/Qwen3-30B-A3B (48 layers, hidden 2048, 32 heads,
# 4 KV heads, head_dim 128 (attention 4096 wide on a 2048 residual), 128 experts of 768, top-8
# renormalised (norm_topk_prob true), no shared expert, every layer MoE (decoder_sparse_step 1,
# mlp_only_layers []), router_aux_loss_coef 0.001, vocab 151936, rope_theta 1e6, rms_norm_eps
# 1e-6, max_position_embeddings 40960, untied). intermediate_size 6144 is the dense MLP width
# HF keeps for mlp_only_layers (none here): ffn_hidden_size holds it, unused by the model.
_QWEN3_30B_A3B = _QWEN3_8B.model_copy(update=dict(
    num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32, num_query_groups=4,
    kv_channels=128, max_seq_length=40960, num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
    moe_aux_loss_coeff=1e-3,
))
# tiny-qwen3's attention (q/k norms, head_dim 32 != 128 / 8) with Qwen3-MoE's fine-grained experts:
# 8 experts of 64 (a quarter of a dense 256-wide MLP each), top-4 renormalised, no shared expert.
# EP 1, 2, 4 and 8 all hold whole experts.
_TINY_QWEN3_MOE = _TINY_QWEN3.model_copy(update=dict(
    num_experts=8, moe_router_topk=4, moe_ffn_hidden_size=64, moe_aux_loss_coeff=1e-3,
))
# DeepSeek-V3: transformers' DeepseekV3Config defaults, which document deepseek-ai/DeepSeek-V3's
# config.json (61 layers, hidden 7168, 128 heads, MLA q_lora_rank 1536, kv_lora_rank 512,
# qk_nope 128 + qk_rope 64, v 128; 256 routed experts of 2048 + 1 shared of 2048, top-8 of 8
# groups (4 chosen), sigmoid scores with the aux-loss-free bias, routed_scaling_factor 2.5; the
# first 3 layers dense (first_k_dense_replace) with intermediate 18432; vocab 129280, rms eps
# 1e-6, untied; num_nextn_predict_layers 1: one multi-token prediction layer, a MoE layer like the
# last, training only). Pretraining RoPE is plain at 4096, transformers' default; the released
# model's 128K context is YaRN (yarn_scaling_factor=40, the other yarn_* defaults). Not modelled
# yet: the sequence-wise balance loss (alpha 1e-4): moe_aux_loss_coeff is 0.
_DEEPSEEK_V3 = ModelConfig(
    num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128,
    vocab_size=129280, max_seq_length=4096, norm_eps=1e-6, rope_base=10000.0,
    multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
    qk_pos_emb_head_dim=64, v_head_dim=128,
    num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_hidden_size=2048,
    moe_router_num_groups=8, moe_router_group_topk=4, moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=0.0,
    moe_layer_freq=[0] * 3 + [1] * 58, mtp_num_layers=1,
)
# DeepSeek-V3's parts at tiny-llama's size: MLA (q latent 64, kv latent 32, heads of 16 + 8 RoPE
# for q/k and 16 for v), layer 1 dense (ffn 256), layers 2-4 with 8 routed experts of 32 (top-2
# inside 1 group chosen out of 2, each group scored by its top 2 experts: top-k / chosen groups = 2,
# the one grouping DeepseekV3ForCausalLM computes the same, so the flavor exports as shipped)
# + a 64-wide shared expert, sigmoid routing with the expert bias.
_TINY_DEEPSEEK = _TINY_LLAMA.model_copy(update=dict(
    num_query_groups=None, ffn_hidden_size=256, norm_eps=1e-6,
    multi_latent_attention=True, q_lora_rank=64, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
    v_head_dim=16,
    num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_hidden_size=64,
    moe_router_num_groups=2, moe_router_group_topk=1, moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=0.0,
    moe_layer_freq=[0, 1, 1, 1],
))
# 4 experts, top-2: EP 1, 2 and 4 all hold whole experts.
_TINY_MOE = _TINY_LLAMA.model_copy(update=dict(num_experts=4, moe_router_topk=2, ffn_hidden_size=256))

FLAVORS: dict[str, ModelConfig] = {
    "llama2-7b": _LLAMA2_7B,
    "llama3-8b": _LLAMA3_8B,
    "llama3-70b": _LLAMA3_8B.model_copy(
        update=dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64)
    ),
    "llama3.1-405b": _LLAMA3_8B.model_copy(
        update=dict(num_layers=126, hidden_size=16384, ffn_hidden_size=53248,
                    num_attention_heads=128, max_seq_length=131072, rope_scaling=True)
    ),
    "gpt3-175b": ModelConfig(
        num_layers=96, hidden_size=12288, ffn_hidden_size=49152, num_attention_heads=96,
        vocab_size=50257, max_seq_length=2048, normalization="LayerNorm", activation="gelu",
        position_embedding="learned_absolute", add_bias_linear=True, add_qkv_bias=True,
        tie_embeddings=True, init_std=0.006,
    ),
    "mixtral-8x7b": _LLAMA2_7B.model_copy(
        update=dict(ffn_hidden_size=14336, num_query_groups=8, max_seq_length=32768,
                    rope_base=1000000.0, num_experts=8, moe_router_topk=2)
    ),
    "qwen3-8b": _QWEN3_8B,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "deepseek-v3": _DEEPSEEK_V3,
    "tiny-deepseek": _TINY_DEEPSEEK,
    "tiny-llama": _TINY_LLAMA,
    "tiny-qwen3": _TINY_QWEN3,
    "tiny-qwen3-moe": _TINY_QWEN3_MOE,
    # 8 layers so PP2 x VPP2 and PP4 x VPP2 both have whole layers per stage.
    "tiny-llama-8l": _TINY_LLAMA.model_copy(update=dict(num_layers=8)),
    "tiny-llama-tied": _TINY_LLAMA.model_copy(update=dict(tie_embeddings=True)),
    "tiny-gpt": ModelConfig(
        num_layers=4, hidden_size=128, ffn_hidden_size=512, num_attention_heads=4,
        vocab_size=4000, max_seq_length=256, normalization="LayerNorm", activation="gelu",
        position_embedding="learned_absolute", add_bias_linear=True, add_qkv_bias=True,
        tie_embeddings=True,
    ),
    "tiny-moe": _TINY_MOE,
    # The optional MoE features on: a shared expert (always-on dense MLP beside the routed
    # experts) and the router z-loss.
    "tiny-moe-shared": _TINY_MOE.model_copy(
        update=dict(moe_shared_expert_hidden_size=128, moe_z_loss_coeff=1e-3)
    ),
}


def get_flavor(name: str) -> ModelConfig:
    """The named flavor; unknown names list the valid ones."""
    try:
        return FLAVORS[name]
    except KeyError:
        raise ValueError(
            f"unknown model flavor {name!r}.{did_you_mean(name, FLAVORS, sentence=True)} Valid flavors: {', '.join(sorted(FLAVORS))}"
        ) from None
