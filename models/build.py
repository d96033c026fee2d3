"""The one place that builds Megatron-Core `TransformerConfig`, layer specs and `GPTModel` chunks.

`build_model_chunks` applies parallelism in this order:
  1. `transformer_config`: architecture + layout + precision + recompute (+ Megatron-Core's muP
     fields with model.use_mup) -> TransformerConfig
     (TP/PP/VPP sizes MUST be set there: without them every stage silently builds all layers).
  2. `layer_spec`: `te` (Transformer Engine fused modules; TE does SP and CP) or
     `portable` (torch-native; our SP-aware norm, our CP attention at CP > 1), both with
     Megatron-Core's MoE router (since 0.17 it scales the aux and z-loss gradients by the
     TP x CP group's tokens itself, which our router subclass did for 0.16).
  3. one `GPTModel` (`models.documents.DocumentGPTModel`) per virtual pipeline stage, each with the pre/post-process flags of
     its position in the pipeline (and, with model.mtp_num_layers, Megatron-Core's MTP block on the
     last stage: `mtp_block_spec`), built on the current device; Llama-3.1 RoPE scaling
     completed with all four of its values (`models.rope`: GPTModel passes only the factor).
  4. expert weights marked expert-parallel at every EP size (same optimizer structure).
  5. `initialize_weights`: layout-invariant values (seed, global name) -> same start for
     every layout.
Wrapping for training (DDP, optimizer) is `pretrain.wrap.wrap_for_training`'s job.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec_for_backend
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlockSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from models.config import ModelConfig
from models.context_parallel import ContextParallelAttention
from models.documents import DocumentGPTModel
from models.init import initialize_weights, is_expert_param
from models.layout import ParallelLayout
from models.mla import mla_self_attention
from models.padded_vocab import mask_padded_logits
from models.precision import MachineFacts, fp8_transformer_kwargs, probe_machine
from models.runtime import RuntimeOptions, SpecName
from models.portable import PortableNorm
from models.rope import apply_llama3_scaling

def _keep(tensor: torch.Tensor) -> torch.Tensor:
    """Init method that leaves the tensor as is (see perform_initialization below)."""
    return tensor


def te_available(facts: Optional[MachineFacts] = None) -> bool:
    """True when Transformer Engine imports and a GPU is present (what `auto` needs for `te`)."""
    return (facts or probe_machine()).has_te


def resolve_spec(spec: SpecName, facts: Optional[MachineFacts] = None) -> Literal["te", "portable"]:
    """`auto` -> the spec this machine runs; `te` is refused where it cannot run."""
    if spec == "auto":
        return "te" if te_available(facts) else "portable"
    if spec == "te" and not te_available(facts):
        raise RuntimeError(
            "layer spec 'te' needs Transformer Engine and a CUDA GPU; install the `gpu` extra "
            "(pip install '.[gpu]') on a GPU machine, or set runtime.spec=portable"
        )
    return spec


def transformer_config(
    model: ModelConfig,
    layout: ParallelLayout,
    runtime: RuntimeOptions,
    *,
    spec: Literal["te", "portable"],
) -> TransformerConfig:
    """Map (architecture, layout, runtime) onto Megatron-Core's TransformerConfig; `spec` is
    runtime.spec resolved for this machine."""
    on_gpu = torch.cuda.is_available()
    params_dtype = runtime.torch_dtype
    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_eps,
        gated_linear_unit=model.gated,
        activation_func=F.silu if model.gated else F.gelu,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        # Both specs read it: te builds TENorm q/k norms, our portable spec PortableNorm ones;
        # finalize_model_grads sums their gradients over TP by name (each TP rank normalises
        # only its own heads with the one shared weight).
        # (MLA: its q/kv latent norms, always on; models.mla says how their TP gradients work.)
        qk_layernorm=model.qk_layernorm or model.multi_latent_attention,
        init_method_std=model.init_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Parallel layout.
        **layout.megatron_parallel_sizes(),
        **layout.megatron_pipeline_split(),
        sequence_parallel=layout.sequence_parallel,
        # The interleaved schedule's group size; Megatron-LM uses the PP size.
        microbatch_group_size_per_vp_stage=layout.pipeline_parallel if layout.virtual_pipeline else None,
        # Precision.
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        **fp8_transformer_kwargs(runtime),
        # Loss is summed per token and divided by the global token count in
        # finalize_model_grads: exact for any DP/microbatch split.
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=True,
        # Megatron sets the TP attributes (tensor_model_parallel, partition_dim) that DDP,
        # grad-norm and checkpointing rely on only inside its init path, so keep that path
        # but make the draw a no-op: initialize_weights() fills in layout-invariant values.
        perform_initialization=True,
        init_method=_keep,
        output_layer_init_method=_keep,
        use_cpu_initialization=False,
        # Fused kernels exist only on GPU (runtime.fused_*: None = this default; validation
        # refuses them without the te spec).
        bias_activation_fusion=_pick(runtime.fused_swiglu, on_gpu and spec == "te") and model.gated,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=_pick(runtime.fused_rope, False),
        gradient_accumulation_fusion=_pick(runtime.gradient_accumulation_fusion, False),
        persist_layer_norm=False,
        attention_backend=AttnBackend.auto if spec == "te" else AttnBackend.local,
        # No CUDA graphs (cuda_graph_impl stays "none"). 0.19's default, "full", means the same
        # as empty here but warns its own deprecation at every model build.
        cuda_graph_modules=[],
    )
    if model.mtp_num_layers:
        # Megatron-Core's MTP: its layers on the last pipeline stage (no custom layout).
        kwargs.update(mtp_num_layers=model.mtp_num_layers, mtp_loss_scaling_factor=model.mtp_loss_scaling_factor)
    if runtime.fused_cross_entropy:
        # TE's fused vocab-parallel cross-entropy (logits never materialised in fp32).
        kwargs.update(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    if runtime.recompute == "selective":
        kwargs.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif runtime.recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if layout.context_parallel > 1 and spec == "te":
        # TE's names; the portable spec has one CP algorithm (all-gather) and ignores this.
        kwargs.update(cp_comm_type=_TE_CP_COMM[layout.cp_comm_type or "p2p"])
    if model.is_moe:
        kwargs.update(_moe_kwargs(model, layout, spec, runtime.moe_grouped_gemm))
    if model.multi_latent_attention:
        # use_mup is refused with MLA (ModelConfig), so this is the whole config.
        return MLATransformerConfig(**kwargs, **_mla_kwargs(model))
    if not model.use_mup:
        return TransformerConfig(**kwargs)
    kwargs.update(_mup_kwargs(model))
    with warnings.catch_warnings():
        # Megatron-Core warns that a custom init_method "may break MuP initialization": ours
        # (_keep) draws nothing; models/init.py draws Megatron-Core's muP init per global name.
        warnings.filterwarnings("ignore", message="use_mup is enabled, but custom")
        config = TransformerConfig(**kwargs)
    if model.mup_output_mult is not None:
        # Megatron-Core takes 1.0 as "unset" and replaces it by 1 / width_mult; an explicit
        # value, 1.0 included, is what the user asked for.
        config.mup_output_mult = model.mup_output_mult
    return config


def _mup_kwargs(model: ModelConfig) -> dict:
    """Megatron-Core's muP fields (it derives width_mult, softmax_scale and the output multiplier)."""
    return dict(
        use_mup=True,
        mup_base_hidden_size=model.mup_base_hidden_size,
        mup_embedding_mult=model.mup_embedding_mult,
        mup_output_mult=model.mup_output_mult or 1.0,
        mup_base_head_dim=model.mup_base_head_dim,
        mup_attn_scale_power=model.mup_attn_scale_power,
    )


def _mla_kwargs(model: ModelConfig) -> dict:
    """MLATransformerConfig's own fields. Its rope_type defaults to YaRN (factor 40); without
    yarn_scaling_factor we run plain RoPE at rope_base, and a scaling factor of 1 keeps YaRN's
    mscale out of the softmax scale (MultiLatentAttention multiplies it by mscale^2 whatever
    the rope type)."""
    rope = dict(rope_type="rope", rotary_scaling_factor=1.0, mscale_all_dim=0.0)
    if model.yarn_scaling_factor is not None:
        rope = dict(rope_type="yarn", rotary_scaling_factor=model.yarn_scaling_factor,
                    original_max_position_embeddings=model.yarn_original_max_position_embeddings,
                    beta_fast=model.yarn_beta_fast, beta_slow=model.yarn_beta_slow, mscale=model.yarn_mscale,
                    mscale_all_dim=model.yarn_mscale_all_dim)
    return dict(
        q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_head_dim,
        qk_pos_emb_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim,
        rotary_base=model.rope_base, **rope,
    )


_TE_CP_COMM = {"p2p": "p2p", "a2a": "a2a", "allgather": "all_gather"}


def _pick(option: Optional[bool], default: bool) -> bool:
    return default if option is None else option


def _moe_kwargs(model: ModelConfig, layout: ParallelLayout, spec: str, grouped_gemm: Optional[bool]) -> dict:
    if grouped_gemm and spec != "te":
        raise ValueError("moe_grouped_gemm needs the te spec (Transformer Engine's grouped GEMM)")
    return dict(
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=model.expert_bias_update_rate,
        moe_layer_freq=model.moe_layer_freq,
        moe_router_num_groups=model.moe_router_num_groups,
        moe_router_group_topk=model.moe_router_group_topk,
        moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
        moe_ffn_hidden_size=model.expert_ffn_hidden_size,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_hidden_size,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_z_loss_coeff=model.moe_z_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        moe_expert_capacity_factor=model.moe_capacity_factor,
        moe_token_drop_policy=model.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=model.moe_pad_to_capacity,
        moe_token_dispatcher_type=layout.moe_dispatcher,
        moe_grouped_gemm=spec == "te" if grouped_gemm is None else grouped_gemm,
    )


def layer_spec(config: TransformerConfig, spec: Literal["te", "portable"], vp_stage: Optional[int]):
    """The block spec for this pipeline chunk (its layers and its final norm).

    `te`: Megatron-Core's Transformer Engine block spec (TE does SP and CP itself; MLA and
    moe_layer_freq included).
    `portable`: the local spec with `PortableNorm` (sequence-parallel aware) as every norm,
    q/k norms included (the local spec's WrappedTorchNorm refuses SP even there), at CP > 1
    `ContextParallelAttention` as core attention, and with MLA models.mla's core attention
    and latent norms. With moe_layer_freq the dense layers get a dense MLP, as upstream's
    block spec does; this chunk takes its layers' slice of the global pattern.
    """
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    if spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization=config.normalization, vp_stage=vp_stage
        )
    moe = _portable_layer(config, config.num_moe_experts)
    if not config.num_moe_experts:
        return TransformerBlockSubmodules(layer_specs=[moe] * num_layers, layer_norm=PortableNorm)
    dense = _portable_layer(config, None)
    freq = config.moe_layer_freq
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = [moe if is_moe else dense for is_moe in pattern[offset:offset + num_layers]]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=PortableNorm)


class _PortableBackend(LocalSpecProvider):
    """Megatron-Core's local modules with `PortableNorm` as every norm (the MTP layer's
    hidden/embedding/final norms run on sequence-sharded tokens under SP, which the local
    spec's WrappedTorchNorm refuses)."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        return PortableNorm


def mtp_block_spec(config: TransformerConfig, block: TransformerBlockSubmodules, spec: Literal["te", "portable"],
                   vp_stage: Optional[int]) -> Optional[MultiTokenPredictionBlockSubmodules]:
    """The MTP layers of this chunk (None on all but the last pipeline stage, or without MTP):
    upstream's `get_gpt_mtp_block_spec_for_backend`, whose transformer layer is `block`'s last
    (DeepSeek-V3's MTP layer is a MoE layer like its last decoder layer), with TE's modules
    on `te` and ours on `portable`."""
    if not config.mtp_num_layers:
        return None
    if spec == "te":
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend = TESpecProvider()
    else:
        backend = _PortableBackend()
    return get_gpt_mtp_block_spec_for_backend(config, block, backend, vp_stage=vp_stage)


def _portable_layer(config: TransformerConfig, num_experts: Optional[int]) -> ModuleSpec:
    """One portable transformer layer (dense MLP when num_experts is None)."""
    mla = config.multi_latent_attention
    local = get_gpt_layer_local_spec(
        num_experts=num_experts, normalization=config.normalization, qk_layernorm=config.qk_layernorm,
        multi_latent_attention=mla,
    )
    submodules = dataclasses.replace(
        local.submodules, input_layernorm=PortableNorm, pre_mlp_layernorm=PortableNorm
    )
    attention = local.submodules.self_attention
    if mla:
        # Context parallelism with MLA is refused on this spec (pretrain.config.validation).
        attention = mla_self_attention(attention)
    else:
        replaced = {}
        if config.qk_layernorm:
            replaced.update(q_layernorm=PortableNorm, k_layernorm=PortableNorm)
        if config.context_parallel_size > 1:
            replaced.update(core_attention=ContextParallelAttention)
        if replaced:
            attention = dataclasses.replace(
                attention, submodules=dataclasses.replace(attention.submodules, **replaced))
    submodules = dataclasses.replace(submodules, self_attention=attention)
    return ModuleSpec(module=local.module, submodules=submodules, params=local.params)


def build_model_chunks(model: ModelConfig, layout: ParallelLayout, runtime: RuntimeOptions, *,
                       reset_position_ids: bool = False) -> list[GPTModel]:
    """Build this rank's model chunks (one per virtual pipeline stage), initialised.

    Chunks are `models.documents.DocumentGPTModel` (GPTModel plus document masking when a
    forward gets `document_ids`); `reset_position_ids` makes RoPE follow the batch's
    position ids (data.reset_position_ids).

    Needs `parallel_state` initialised with the same layout. `runtime.spec` may be `auto`
    (resolved here); training resolves and checks it once before any process group
    (pretrain.config.validate_for_machine) and passes the result.
    """
    resolved = resolve_spec("auto") if runtime.spec == "auto" else runtime.spec
    config = transformer_config(model, layout, runtime, spec=resolved)
    params_dtype = runtime.torch_dtype
    device = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
    chunks = []
    for vp_stage in range(layout.vpp):
        vp = vp_stage if layout.virtual_pipeline else None
        block = layer_spec(config, resolved, vp)
        gpt = DocumentGPTModel(
            reset_position_ids=reset_position_ids,
            packed=resolved == "te",  # document masking as THD packed sequences (TE's attention)
            config=config,
            transformer_layer_spec=block,
            mtp_block_spec=mtp_block_spec(config, block, resolved, vp),
            vocab_size=model.padded_vocab_size,
            max_sequence_length=model.max_seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=model.tie_embeddings,
            position_embedding_type=model.position_embedding,
            rotary_base=int(model.rope_base),
            rope_scaling=model.rope_scaling,
            rope_scaling_factor=model.rope_scaling_factor,
            vp_stage=vp,
        )
        if model.position_embedding == "rope" and not model.multi_latent_attention:
            # (MLA builds its RoPE inside each attention layer: no GPTModel table to scale.)
            # GPTModel hands RotaryEmbedding only the scaling factor (see models/rope.py).
            apply_llama3_scaling(gpt.rotary_pos_emb, model)
        if gpt.pre_process and model.position_embedding == "learned_absolute":
            # Megatron-Core creates learned position embeddings as a plain fp32
            # torch.nn.Embedding (Megatron-LM casts them through Float16Module, which we do
            # not use); in fp32 they would turn bf16 hidden states into fp32 ones.
            gpt.embedding.position_embeddings.to(dtype=params_dtype)
        gpt.to(device)
        mask_padded_logits(gpt, model)  # padded vocab ids: -inf logits (models/padded_vocab.py)
        if model.is_moe:
            _mark_expert_params(gpt)
        chunks.append(gpt)
    initialize_weights(chunks, model, runtime.seed)
    return chunks


def _mark_expert_params(chunk: torch.nn.Module) -> None:
    """Treat routed-expert weights as expert-parallel at every EP size, EP 1 included.

    Megatron-Core sets `allreduce=False` on expert weights only when EP > 1; that flag
    decides whether DDP reduces their gradients over the expert-DP group and whether the
    optimizer puts them in a separate (chained) optimizer. Setting it always keeps the
    optimizer's structure, and so its checkpoint keys, the same at EP 1 and EP > 1 (a
    checkpoint saved at EP2 then loads at EP1), and reduces expert gradients over the
    ranks that really hold replicas of the same expert shard when expert TP != TP.
    """
    for name, param in chunk.named_parameters():
        if is_expert_param(name):
            param.allreduce = False
