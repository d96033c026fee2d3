"""Layout-invariant initialisation.

Every parameter's initial value is a function of (seed, global parameter name) only:
the full (global) tensor is drawn from a generator seeded by a hash of the seed and the
name with the *global* layer number, then this rank keeps its tensor-parallel shard.
So TP=1 and TP=4 x PP=2 start from identical weights, and changing the layout at
step 0 does not change the experiment.

The cost is drawing each full tensor on every TP rank that holds a shard of it; on GPU
this is a few milliseconds per layer, on CPU it is negligible for the test models.
"""

from __future__ import annotations

import hashlib
import math
import re

import torch

from megatron.core import parallel_state
from megatron.core.utils import init_method_normal, mup_scaled_init_method_normal, scaled_init_method_normal

from models.config import ModelConfig

_LAYER_RE = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
# SequentialMLP: experts.local_experts.<local>.linear_fc1.weight
_EXPERT_RE = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")
# Transformer Engine's grouped GEMM (TEGroupedMLP): experts.linear_fc1.weight<local>
_GROUPED_EXPERT_RE = re.compile(r"^(.*\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
# Output-side projections (attention, dense MLP, routed and shared experts) get
# std / sqrt(2 L) (GPT-2 / Megatron "scaled init", Megatron's output_layer_init_method;
# under muP also / sqrt(width_mult), Megatron's mup_scaled_init_method_normal).
_SCALED = ("self_attention.linear_proj.weight", "linear_fc2.weight")


def global_param_names(chunk: torch.nn.Module) -> dict[str, str]:
    """Map each local parameter name of a model chunk to its layout-independent name.

    Local layer indices restart at 0 in every pipeline chunk; Megatron-Core's
    `TransformerLayer.layer_number` is the global 1-based index, so we rewrite
    `decoder.layers.<local>.` to `decoder.layers.<global>.`. Local expert indices are
    rewritten to global ones with the EP rank's offset (EP rank r holds experts
    [r E/EP, (r+1) E/EP), as Megatron-Core's MoE layer and its checkpoints assume), and
    TE grouped-GEMM names map to the same per-expert names, so both specs and every EP
    size draw each expert from the same seed.
    """
    module = chunk.module if hasattr(chunk, "module") else chunk
    layer_numbers = {}
    for i, layer in enumerate(module.decoder.layers):
        layer_numbers[i] = layer.layer_number - 1
    offset = 0
    if module.config.num_moe_experts:
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        offset = parallel_state.get_expert_model_parallel_rank() * (module.config.num_moe_experts // ep_size)
    names = {}
    for name, _ in module.named_parameters():
        new = name
        m = _LAYER_RE.match(new)
        if m:
            new = f"{m.group(1)}{layer_numbers[int(m.group(2))]}{m.group(3)}"
        names[name] = global_expert_name(new, offset)
    return names


def global_expert_name(name: str, offset: int) -> str:
    """`...experts.local_experts.<offset + local>.<rest>` for a local expert parameter name."""
    m = _EXPERT_RE.match(name)
    if m:
        return f"{m.group(1)}{offset + int(m.group(2))}{m.group(3)}"
    m = _GROUPED_EXPERT_RE.match(name)
    if m:
        return f"{m.group(1)}local_experts.{offset + int(m.group(4))}.{m.group(2)}.{m.group(3)}"
    return name


def is_expert_param(name: str) -> bool:
    """Routed-expert weights (split over expert TP); shared experts are ordinary TP layers."""
    return ".experts." in name


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _tp_rank_world(param: torch.nn.Parameter, name: str) -> tuple[int, int]:
    # Expert weights are split over the expert-TP group, everything else over TP. Known by
    # name: Megatron marks them (allreduce=False) only when EP > 1, yet expert TP may
    # differ from TP at EP 1 too.
    if is_expert_param(name):
        return (parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def _local_shard(full: torch.Tensor, param: torch.nn.Parameter, name: str, gated: bool) -> torch.Tensor:
    """This rank's TP shard of a global tensor, in Megatron-Core's in-memory layout."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    rank, world = _tp_rank_world(param, name)
    dim = param.partition_dim
    if gated and name.endswith("linear_fc1.weight") or gated and name.endswith("linear_fc1.bias"):
        # SwiGLU fc1 is [gate; up] globally, but each TP rank holds [gate_r; up_r].
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(world, dim=0)[rank], up.chunk(world, dim=0)[rank]], dim=0)
    return full.chunk(world, dim=dim)[rank]


def _global_shape(param: torch.nn.Parameter, name: str) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= _tp_rank_world(param, name)[1]
    return shape


def _init_method(name: str, model: ModelConfig):
    """Megatron-Core's init method for this parameter: the one TransformerConfig.__post_init__
    picks (its muP variants when model.use_mup), so our draw is Megatron's, only seeded by name."""
    if name.startswith("embedding.") or name == "output_layer.weight":
        # embedding_init_method: unscaled under muP; muP's untied output layer uses it too
        # (gpt_model.py), and without muP init_method has the same std.
        return init_method_normal(model.init_std)
    if name.endswith(_SCALED):
        if model.use_mup:
            return mup_scaled_init_method_normal(model.init_std, model.num_layers, model.mup_width_mult)
        return scaled_init_method_normal(model.init_std, model.num_layers)
    if model.use_mup:  # hidden matrices: std / sqrt(width_mult)
        return init_method_normal(model.init_std / math.sqrt(model.mup_width_mult))
    return init_method_normal(model.init_std)


def _draw(name: str, shape: list[int], model: ModelConfig, seed: int, device) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    is_norm = "norm" in name
    if leaf == "bias" or leaf.endswith("_bias"):
        return torch.zeros(shape, device=device)
    if is_norm:  # norm weights (incl. TE's fused layer_norm_weight and the q/k norms' q_layernorm/k_layernorm)
        return torch.ones(shape, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(_seed_for(seed, name))
    return _init_method(name, model)(torch.empty(shape, device=device), generator=gen)


@torch.no_grad()
def initialize_weights(chunks: list[torch.nn.Module], model: ModelConfig, seed: int) -> None:
    """Overwrite every parameter of every chunk with its layout-invariant initial value (and
    the routers' expert bias with zero)."""
    for chunk in chunks:
        names = global_param_names(chunk)
        module = chunk.module if hasattr(chunk, "module") else chunk
        for local_name, param in module.named_parameters():
            name = names[local_name]
            if model.tie_embeddings and name == "output_layer.weight":
                # The last stage's copy of a tied embedding must equal the first stage's.
                name = "embedding.word_embeddings.weight"
            full = _draw(name, _global_shape(param, name), model, seed, param.device)
            value = _local_shard(full, param, name, model.gated)
            param.copy_(value)  # an FP8 weight (runtime.fp8_param_gather) quantizes it
            kept = getattr(param, "_high_precision_init_val", None)
            if kept is not None:
                # FP8 weights: Transformer Engine keeps the construction-time values on the CPU
                # (module/base.py, preserve_high_precision_init_val) and Megatron's distributed
                # optimizer builds its FP32 master weights from them, not from the FP8 values
                # (distrib_optimizer.py, get_high_precision_init_val). Construction drew nothing
                # (init_method is _keep), so without this the masters would start from
                # uninitialised memory and the first update would overwrite our weights with it.
                param._high_precision_init_val = value.detach().to(kept.dtype).cpu()
        for local_name, buffer in module.named_buffers():
            if local_name.endswith("router.expert_bias"):
                # The aux-loss-free routing bias (a persistent buffer, not a parameter) starts at
                # zero on every layout: set here rather than trusting the constructor's zeros.
                buffer.zero_()
