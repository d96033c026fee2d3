"""Pretraining: experiment config, recipes, runtime start-up, the training step and loop,
checkpointing, metrics. `python -m pretrain --help` for the command line."""

from pretrain.megatron_fixes import import_cost as _import_cost, quiet_cpu_fallback_warnings as _quiet

# Before anything imports megatron.core: its import warns four times on a CPU machine, and
# builds ~20 torch.compile wrappers (2.8 CPU-s) that import_cost defers to their first call.
_quiet()
_import_cost.install()
