"""The one place that builds Megatron-Core `TransformerConfig`, layer specs and `GPTModel` chunks.

`build_model_chunks` applies parallelism in this order:
  1. `transformer_config`: architecture + layout + precision + recompute -> TransformerConfig
     (TP/PP/VPP sizes MUST be set there: without them every stage silently builds all layers).
  2. `layer_spec`: `te` (Transformer Engine fused modules) or `portable` (torch-native).
  3. one `GPTModel` per virtual pipeline stage, each with the pre/post-process flags of
     its position in the pipeline, built on the current device.
  4. `initialize_weights`: layout-invariant values (seed, global name) -> same start for
     every layout.
Wrapping for training (DDP, optimizer) is `pretrain.wrap.wrap_for_training`'s job.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from models.config import ModelConfig
from models.init import initialize_weights
from models.layout import ParallelLayout
from models.portable import PortableNorm

SpecName = Literal["auto", "te", "portable"]


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    """Init method that leaves the tensor as is (see perform_initialization below)."""
    return tensor


def te_available() -> bool:
    """True when Transformer Engine imports and a GPU is present (what `auto` needs for `te`)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def resolve_spec(spec: SpecName) -> Literal["te", "portable"]:
    if spec == "auto":
        return "te" if te_available() else "portable"
    if spec == "te" and not te_available():
        raise RuntimeError(
            "layer spec 'te' needs Transformer Engine and a CUDA GPU; install the `gpu` extra "
            "(pip install '.[gpu]') on a GPU machine, or use model.spec=portable"
        )
    return spec


def transformer_config(
    model: ModelConfig,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    recompute: Literal["none", "selective", "full"] = "none",
    microbatch_group_size_per_vp_stage: Optional[int] = None,
    fp8: Optional[str] = None,
    spec: Literal["te", "portable"] = "portable",
) -> TransformerConfig:
    """Map (architecture, layout, precision) onto Megatron-Core's TransformerConfig."""
    on_gpu = torch.cuda.is_available()
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
        init_method_std=model.init_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Parallel layout.
        tensor_model_parallel_size=layout.tensor_parallel,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline,
        context_parallel_size=layout.context_parallel,
        expert_model_parallel_size=layout.expert_parallel,
        expert_tensor_parallel_size=layout.expert_tensor_parallel or layout.tensor_parallel,
        sequence_parallel=layout.sequence_parallel,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
        # Precision.
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        fp8=fp8,
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
        # Fused kernels exist only on GPU.
        bias_activation_fusion=on_gpu and spec == "te" and model.gated,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_backend=AttnBackend.auto if spec == "te" else AttnBackend.local,
    )
    if recompute == "selective":
        kwargs.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if model.is_moe:
        kwargs.update(
            num_moe_experts=model.num_experts,
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.expert_ffn_hidden_size,
            moe_shared_expert_intermediate_size=model.moe_shared_expert_hidden_size,
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            moe_z_loss_coeff=model.moe_z_loss_coeff,
            moe_router_load_balancing_type="aux_loss",
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
        )
    return TransformerConfig(**kwargs)


def layer_spec(config: TransformerConfig, spec: Literal["te", "portable"], vp_stage: Optional[int]):
    """The block spec for this pipeline chunk (its layers and its final norm)."""
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    if spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization=config.normalization, vp_stage=vp_stage
        )
    local = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, normalization=config.normalization
    )
    submodules = dataclasses.replace(
        local.submodules, input_layernorm=PortableNorm, pre_mlp_layernorm=PortableNorm
    )
    layer = ModuleSpec(module=local.module, submodules=submodules, params=local.params)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=PortableNorm)


def build_model_chunks(
    model: ModelConfig,
    layout: ParallelLayout,
    *,
    seed: int,
    spec: SpecName = "auto",
    params_dtype: torch.dtype = torch.float32,
    recompute: Literal["none", "selective", "full"] = "none",
    fp8: Optional[str] = None,
) -> list[GPTModel]:
    """Build this rank's model chunks (one per virtual pipeline stage), initialised.

    Needs `parallel_state` initialised with the same layout.
    """
    resolved = resolve_spec(spec)
    config = transformer_config(
        model, layout, params_dtype=params_dtype, recompute=recompute, fp8=fp8, spec=resolved,
        microbatch_group_size_per_vp_stage=layout.pipeline_parallel if layout.virtual_pipeline else None,
    )
    device = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
    chunks = []
    for vp_stage in range(layout.vpp):
        vp = vp_stage if layout.virtual_pipeline else None
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(config, resolved, vp),
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
        if gpt.pre_process and model.position_embedding == "learned_absolute":
            # Megatron-Core creates learned position embeddings as a plain fp32
            # torch.nn.Embedding (Megatron-LM casts them through Float16Module, which we do
            # not use); in fp32 they would turn bf16 hidden states into fp32 ones.
            gpt.embedding.position_embeddings.to(dtype=params_dtype)
        gpt.to(device)
        chunks.append(gpt)
    initialize_weights(chunks, model, seed)
    return chunks
