"""Pretraining: experiment config, recipes, runtime start-up, the training step and loop,
checkpointing, metrics. `python -m pretrain --help` for the command line."""

from pretrain.megatron_fixes import import_cost as _import_cost, quiet_cpu_fallback_warnings as _quiet
from pretrain.megatron_fixes.quiet import install_import_filters as _quiet_import_logs

# Before anything imports megatron.core: its import warns four times on a CPU machine (and
# torch's cpp_extension once, with the CUDA build and no GPU), and builds ~20 torch.compile
# wrappers (2.8 CPU-s) that import_cost defers to their first call.
_quiet()
_quiet_import_logs()
_import_cost.install()
