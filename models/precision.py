"""FP8 through Transformer Engine: what each recipe needs, checked before any model is built.

Megatron-Core (0.16.1-0.19.2) takes FP8 as `TransformerConfig` fields (`fp8` = the format, `fp8_recipe`,
`fp8_margin`, `fp8_amax_history_len`, `fp8_amax_compute_algo`, `fp8_param`,
`first_last_layers_bf16`, `num_layers_at_start_in_bf16` / `..._end_...`) and turns them into a
Transformer Engine recipe in `megatron/core/fp8_utils.py:get_fp8_recipe`. Transformer Engine
2.11 refuses a recipe the GPU cannot run only when the first FP8 layer runs
(`transformer_engine/pytorch/quantization.py:check_recipe_support`, an assert), after the
model, optimizer and data are built. `machine_problems` applies the same rules from
`MachineFacts` at validation time, so the error comes first and names the fix.

The facts come from `probe_machine()`, the one place that asks torch and Transformer Engine
what this machine is; tests replace it (monkeypatch) to fake an H100 or a Blackwell on CPU.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from packaging.version import Version

from models.runtime import FP8_DETAIL_KEYS, FUSION_KEYS, RuntimeOptions


@dataclasses.dataclass(frozen=True)
class MachineFacts:
    """What the FP8 and spec checks need to know about this machine."""

    capability: Optional[tuple[int, int]] = None  # CUDA compute capability; None = no GPU
    gpu_name: Optional[str] = None
    cuda: Optional[str] = None  # torch.version.cuda
    te_version: Optional[str] = None  # None = Transformer Engine does not import
    # APEX's fused_weight_gradient_mlp_cuda: Megatron-Core's own (non-TE) linear layers, the
    # output layer among them, need it for gradient_accumulation_fusion.
    apex_wgrad: bool = False

    @property
    def has_gpu(self) -> bool:
        return self.capability is not None

    @property
    def has_te(self) -> bool:
        """What the `te` layer spec needs: a CUDA GPU and Transformer Engine."""
        return self.has_gpu and self.te_version is not None


def probe_machine() -> MachineFacts:
    """This machine's GPU (the one LOCAL_RANK will use), CUDA and Transformer Engine."""
    import torch

    if not torch.cuda.is_available():
        return MachineFacts()
    # Properties only: no CUDA context is created on the device, so ranks that have not yet
    # picked their GPU do not all land on GPU 0.
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    props = torch.cuda.get_device_properties(index)
    try:
        import transformer_engine
        from importlib.metadata import version

        te_version = getattr(transformer_engine, "__version__", None) or version("transformer-engine")
    except Exception:  # not installed, or its CUDA libraries do not load: no `te` spec here
        te_version = None
    from importlib.util import find_spec

    return MachineFacts(capability=(props.major, props.minor), gpu_name=props.name,
                        cuda=torch.version.cuda, te_version=te_version,
                        apex_wgrad=find_spec("fused_weight_gradient_mlp_cuda") is not None)


@dataclasses.dataclass(frozen=True)
class RecipeNeeds:
    title: str  # for messages
    te_class: str  # Transformer Engine's recipe class that Megatron-Core builds
    min_capability: tuple[int, int]
    below_capability: Optional[tuple[int, int]] = None  # unsupported from this one up
    min_cuda: Optional[tuple[int, int]] = None
    # The Transformer Engine that Megatron-Core's get_fp8_recipe needs for it (0.16.1 and 0.19.2 alike).
    min_te: str = "2.1.0"


# Transformer Engine 2.11 quantization.py: check_fp8_support (delayed, tensorwise: 8.9+; on Ada
# also CUDA 12.1), check_fp8_block_scaling_support (9.0+ and CUDA 12.9), check_mxfp8_support
# (10.x and 11.x: "not supported on 12.0+ architectures yet").
FP8_RECIPES: dict[str, RecipeNeeds] = {
    "delayed": RecipeNeeds("FP8 delayed scaling", "DelayedScaling", (8, 9)),
    "tensorwise": RecipeNeeds("FP8 current (per-tensor) scaling", "Float8CurrentScaling", (8, 9),
                              min_te="2.2.0.dev0"),
    "blockwise": RecipeNeeds("FP8 block scaling", "Float8BlockScaling", (9, 0), min_cuda=(12, 9),
                             min_te="2.3.0.dev0"),
    "mxfp8": RecipeNeeds("MXFP8", "MXFP8BlockScaling", (10, 0), below_capability=(12, 0)),
}
_GENERATIONS = {(8, 9): "Ada", (9, 0): "Hopper", (10, 0): "Blackwell", (12, 0): "Blackwell RTX"}


def _cc(capability: tuple[int, int]) -> str:
    name = _GENERATIONS.get(tuple(capability))
    return f"{capability[0]}.{capability[1]}" + (f" ({name})" if name else "")


def _cuda_tuple(text: Optional[str]) -> tuple[int, int]:
    parts = (text or "0.0").split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


def recipe_problem(recipe: str, facts: MachineFacts) -> Optional[str]:
    """Why this machine cannot run the FP8 recipe (None if it can), e.g. "MXFP8 needs compute
    capability 10.0 (Blackwell); this GPU (NVIDIA H100 80GB HBM3) is 9.0 (Hopper)"."""
    needs = FP8_RECIPES[recipe]
    what = needs.title
    if not facts.has_gpu:
        return f"{what} needs an NVIDIA GPU of compute capability {_cc(needs.min_capability)} or newer; this machine has none"
    gpu = f"this GPU ({facts.gpu_name})" if facts.gpu_name else "this GPU"
    cc = tuple(facts.capability)
    if cc < needs.min_capability:
        return f"{what} needs compute capability {_cc(needs.min_capability)}; {gpu} is {_cc(cc)}"
    if needs.below_capability and cc >= needs.below_capability:
        return (f"{what} is not supported on compute capability {_cc(needs.below_capability)} or newer "
                f"by Transformer Engine 2.11; {gpu} is {_cc(cc)}")
    cuda = _cuda_tuple(facts.cuda)
    if needs.min_cuda and cuda < needs.min_cuda:
        return (f"{what} needs CUDA {needs.min_cuda[0]}.{needs.min_cuda[1]} or newer; torch is built for "
                f"CUDA {facts.cuda}")
    if cc == (8, 9) and cuda < (12, 1):
        return f"{what} on Ada (compute capability 8.9) needs CUDA 12.1 or newer; torch is built for CUDA {facts.cuda}"
    if facts.te_version is None:
        return f"{what} needs Transformer Engine: pip install '.[gpu]'"
    if Version(facts.te_version) < Version(needs.min_te):
        return (f"{what} ({needs.te_class}) needs Transformer Engine >= {needs.min_te} (Megatron-Core 0.19.2); "
                f"{facts.te_version} is installed")
    return None


def supported_recipes(facts: MachineFacts) -> list[str]:
    """The FP8 recipes this machine runs, in FP8_RECIPES order."""
    return [name for name in FP8_RECIPES if recipe_problem(name, facts) is None]


def config_problems(runtime: RuntimeOptions, *, num_layers: int, pipeline_parallel: int,
                    distributed_optimizer: bool) -> list[str]:
    """FP8 settings that cannot work whatever the machine (checked with the world size)."""
    if not runtime.fp8:
        stray = [key for key in FP8_DETAIL_KEYS
                 if getattr(runtime, key) != RuntimeOptions.model_fields[key].default]
        return [f"runtime.{key}={getattr(runtime, key)} has no effect without runtime.fp8; set "
                "runtime.fp8=hybrid (E4M3 forward, E5M2 gradients) or e4m3, or remove it"
                for key in stray]
    problems = []
    recipe = runtime.fp8_recipe_name
    if runtime.dtype not in ("bf16", "fp16"):
        problems.append(f"runtime.fp8 runs inside BF16/FP16 mixed precision (non-FP8 layers, master "
                        f"weights); runtime.dtype={runtime.dtype}: set runtime.dtype=bf16")
    if recipe != "delayed":
        for key in ("fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin"):
            if getattr(runtime, key) is not None:
                problems.append(f"runtime.{key} applies to fp8_recipe=delayed only ({recipe} computes "
                                "scales from the current values); remove it or set runtime.fp8_recipe=delayed")
    first, last = runtime.fp8_bf16_first_layers, runtime.fp8_bf16_last_layers
    if (first or last) and recipe == "delayed":
        problems.append("runtime.fp8_bf16_first_layers / fp8_bf16_last_layers need a recipe other than "
                        "delayed (Megatron-Core 0.16.1-0.19.2 refuses BF16 layers inside delayed scaling, whose amax "
                        "reduction spans all FP8 layers); set runtime.fp8_recipe=tensorwise or blockwise")
    per_stage = num_layers // pipeline_parallel
    for key, value in (("fp8_bf16_first_layers", first), ("fp8_bf16_last_layers", last)):
        if value > per_stage:
            problems.append(f"runtime.{key}={value} exceeds the layers per pipeline stage ({num_layers} / "
                            f"PP{pipeline_parallel} = {per_stage}), Megatron-Core's limit; valid: 0..{per_stage}")
    if first + last >= num_layers:
        problems.append(f"runtime.fp8_bf16_first_layers + fp8_bf16_last_layers = {first + last} keeps all "
                        f"{num_layers} layers in BF16; lower them or remove runtime.fp8")
    if runtime.fp8_param_gather and not distributed_optimizer:
        problems.append("runtime.fp8_param_gather=true needs optimizer.distributed=true: only Megatron's "
                        "distributed optimizer re-quantizes its FP32 master shards into the FP8 weights "
                        "(Megatron-LM refuses it likewise); without it the weights would never change")
    return problems


def machine_problems(runtime: RuntimeOptions, spec: str, facts: MachineFacts) -> list[str]:
    """FP8 and fused-kernel settings this machine (or the resolved layer spec) cannot run."""
    problems = []
    if runtime.fp8:
        if spec != "te":
            problems.append("runtime.fp8 needs the Transformer Engine spec; set runtime.spec=te or auto on a "
                            "GPU with Transformer Engine")
        else:
            why = recipe_problem(runtime.fp8_recipe_name, facts)
            if why:
                others = supported_recipes(facts)
                hint = (f"set runtime.fp8_recipe to one this machine runs: {', '.join(others)}" if others
                        else "remove runtime.fp8 on this machine")
                problems.append(f"{why} (runtime.fp8_recipe={runtime.fp8_recipe_name}); {hint}")
    if spec != "te":
        for key in FUSION_KEYS:
            if getattr(runtime, key):
                problems.append(f"runtime.{key}=true needs the Transformer Engine spec (runtime.spec=te on a GPU "
                                "with Transformer Engine); remove it on this machine")
    elif runtime.gradient_accumulation_fusion and not facts.apex_wgrad:
        problems.append("runtime.gradient_accumulation_fusion=true needs APEX's fused_weight_gradient_mlp_cuda "
                        "extension (Megatron-Core's output layer is not a TE module: tensor_parallel/layers.py "
                        "refuses it without); it does not import here: remove the key or install APEX with --cuda_ext")
    return problems


def fp8_transformer_kwargs(runtime: RuntimeOptions) -> dict:
    """Megatron-Core TransformerConfig fields for the runtime's FP8 settings ({} without FP8)."""
    if not runtime.fp8:
        return {}
    recipe = runtime.fp8_recipe_name
    kwargs = dict(fp8=runtime.fp8, fp8_recipe=recipe, fp8_param=runtime.fp8_param_gather)
    if recipe == "delayed":
        kwargs.update(fp8_margin=runtime.fp8_margin or 0,
                      fp8_amax_history_len=runtime.fp8_amax_history_len or 1,
                      fp8_amax_compute_algo=runtime.fp8_amax_compute_algo or "most_recent")
    first, last = runtime.fp8_bf16_first_layers, runtime.fp8_bf16_last_layers
    if first or last:
        kwargs.update(first_last_layers_bf16=True, num_layers_at_start_in_bf16=first,
                      num_layers_at_end_in_bf16=last)
    return kwargs
