"""Muon on Megatron-Core 0.19.2: our `optimizer.muon` section -> Megatron-Core's OptimizerConfig
`muon_*` fields and the per-parameter LR overrides of the parameters left to AdamW.

Megatron-Core builds Muon itself (`get_megatron_optimizer` with optimizer="muon" ->
optimizer/emerging_optimizers.py's TensorParallelMuon, whose Newton-Schulz is NVIDIA's
emerging_optimizers'); nothing here computes an update. What is ours:

- Which parameters get AdamW (`is_adamw_param`): Megatron-Core's own rule
  (`_is_nonlinear_or_embedding`: embedding/output layer, anything not 2-D) plus the MoE
  router's weight, which is 2-D but a per-expert score table, not a hidden map (Kimi K2,
  GLM-4.5 and torchtitan keep it on AdamW), and learned position embeddings (a lookup table). Megatron-Core lets no caller override which
  optimizer a parameter gets, so pretrain/megatron_fixes/muon.py installs this rule as its
  registry default. The router's expert bias is a buffer with its own update rule.
- Their LR (`optimizer.muon.adamw_lr` / `adamw_min_lr`): a `max_lr`/`min_lr` override, which
  the OptimizerParamScheduler reads per group.
- At DP > 1 with optimizer.distributed, Megatron-Core's layer-wise distributed optimizer
  (pretrain/wrap.py), bf16 only (pretrain/config/validation.py says why).
"""

from __future__ import annotations

from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_standard_config_overrides
from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate

from pretrain.config import ExperimentConfig

# Our optimizer.name values that Megatron-Core builds through its emerging-optimizer path
# (`_get_megatron_emerging_optimizer`); Lion's registry entry is fixed by megatron_fixes/lion.py.
EMERGING_OPTIMIZERS = ("muon", "lion")


def is_adamw_param(param, name: str) -> bool:
    """True for the parameters Muon leaves to AdamW (see the module docstring)."""
    # Learned absolute position embeddings are 2-D too, but Megatron-Core tags only the word
    # embedding and the output layer as embedding/output parameters.
    return (getattr(param, "is_embedding_or_output_parameter", False) or param.dim() != 2
            or ".router." in name or "position_embeddings" in name)


def megatron_muon_fields(config: ExperimentConfig) -> dict:
    """Megatron-Core OptimizerConfig keywords for optimizer.name=muon."""
    muon = config.optimizer.muon
    return dict(
        optimizer="muon",
        muon_momentum=muon.momentum,
        muon_nesterov=muon.nesterov,
        muon_num_ns_steps=muon.num_ns_steps,
        muon_coefficient_type=muon.coefficient_type,
        muon_scale_mode=muon.scale_mode,
        muon_extra_scale_factor=muon.extra_scale_factor,
        muon_fp32_matmul_prec=muon.fp32_matmul_prec,
        muon_split_qkv=muon.split_qkv,
        muon_tp_mode=muon.tp_mode,
        muon_scalar_optimizer="adam",
    )


def muon_param_overrides(mcfg: MegatronOptimizerConfig, config: ExperimentConfig) -> dict:
    """Megatron-Core's standard overrides (no weight decay on biases and 1-D parameters) plus
    the AdamW parameters' own LR. That they get AdamW at all is Megatron-Core's registry default
    (widened to the router by pretrain/megatron_fixes/muon.py): overrides may not name an optimizer."""
    overrides = get_standard_config_overrides(mcfg)
    muon = config.optimizer.muon
    lrs = {key: value for key, value in (("max_lr", muon.adamw_lr), ("min_lr", muon.adamw_min_lr))
           if value is not None}
    if lrs:
        overrides[ParamKey(with_name_predicate=ParamWithNamePredicate(name="adamw_lr", fn=is_adamw_param))] = lrs
    return overrides
