"""Pretraining: experiment config, recipes, runtime start-up, the training step and loop,
checkpointing, metrics. `python -m pretrain --help` for the command line."""

from pretrain.megatron_fixes import quiet_cpu_fallback_warnings as _quiet

# Before anything imports megatron.core (its import warns four times on a CPU machine).
_quiet()
