"""Log lines of Megatron-Core (and torch) that every run of ours would print about choices we
made on purpose, filtered by their exact text (every other record of those loggers passes).

Known for megatron-core 0.19.2 with torch 2.13.0 (PyPI's CUDA build). Each filtered message is
pinned by its text: `apply()` checks that the text still occurs in the source of the module
that logs it, and raises `UpstreamChanged` naming the message when it does not (a reworded
message would slip through the filter, and the decision behind it may need a fresh look).

- torch `utils/cpp_extension.py` (`_find_cuda_home`): "No CUDA runtime is found, using
  CUDA_HOME=..." when the CUDA build of torch runs on a machine without a GPU, as ours does on
  CPU, at `import megatron.core` (tensor_parallel/random.py imports cpp_extension since 0.17).
  Nothing of ours compiles a CUDA extension. Installed before megatron.core is imported
  (`install_import_filters`, called from the `pretrain` package).
- `models/gpt/gpt_model.py`, `GPTModel.__init__`: "GPTModel IS DEPRECATED ..." on every model
  build. We stay on GPTModel with 0.19 (docs/upgrading.md, "GPTModel or HybridModel"; no removal version
  is announced, and `tests/models/test_upstream_model.py` fails the day it goes).
- `distributed/distributed_data_parallel.py`: "full_param_layout not provided with
  use_distributed_optimizer=True" with ZeRO-1. DDP then computes the layout itself with its own
  process groups and bucket size, which is what we want (a copy of that computation outside
  DDP could only drift from it).
- `_rank_utils.py`, `safe_get_rank`: the Python warning "Could not determine rank from
  torch.distributed, RANK, or SLURM_PROCID. Defaulting to rank 0." whenever Megatron logs
  through `log_single_rank` in a process without a process group, which ours do on purpose:
  data preparation and validation (Megatron's dataset builders, in the launcher or a CLI)
  run before any group exists, where rank 0 is the right answer. A warnings filter, also
  repeated in pyproject.toml for pytest (which resets filters per test).
- `dist_checkpointing/strategies/torch.py`: "MCore's async save is deprecated ..." at the
  first save. Our async save is built on Megatron's `FileSystemWriterAsync` (our staging,
  hashing and writer process); NVIDIA Resiliency Extension's is not installed.
- `models/mimo/config/base_configs.py`: the Python warning "MimoModelConfig is experimental
  ..." at its import, which `get_megatron_optimizer` does on every call (an isinstance check
  for MimoModel). We build no MIMO model.
- torch `distributed/distributed_c10d.py`: the FutureWarnings "`torch.distributed.
  reduce_scatter_tensor` is deprecated" and "`...all_gather_into_tensor` is deprecated" (torch
  2.13), at the first step: Megatron's DDP buffers (`param_and_grad_buffer.py`) call them with
  the distributed optimizer. Megatron's call, not ours; the functions still work.
- torch's C++ "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"
  (a UserWarning) at every `zero_grad`: the distributed optimizer zeroes the grads of its fp32
  shards, which are views of the parameters (Megatron's own comment there: "throws
  grad-access warning"); reading an unset `.grad` of a view is harmless (None). Filtered only
  where it is raised from: Megatron's optimizer module, or on CPU our `megatron_fixes.cpu`
  torch-function mode, which every torch call passes through. Its text lives in torch's C++,
  so the guard provokes it once and compares; Megatron's comment is the other guard: when it
  goes, so may the access.
- torch's checkpoint loader, at every resume (and in the checkpoint tools), three Python
  warnings about how Megatron's `dist_checkpointing` calls it: "torch.distributed is disabled,
  unavailable or uninitialized, assuming the intent is to load in a single process."
  (`state_dict_loader.py`: Megatron passes `no_dist=True` on purpose, each rank reading its own
  shards without collectives), "The argument order of load has been changed" (`utils.py`'s
  `_api_bc_check`: Megatron passes the storage reader positionally) and the FutureWarning "Please
  use DTensor instead and we are deprecating ShardedTensor." (`_shard/_utils.py`: Megatron's
  torch strategy converts its sharded tensors to torch's ShardedTensor to load them). Megatron's
  calls, not ours (no module of ours calls torch's checkpoint load); the loads work. Guarded by
  the torch texts and by Megatron's `no_dist=True` / `mcore_to_pyt_state_dict` calls.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import warnings

from pretrain.megatron_fixes._guard import UpstreamChanged

# logger name (= the module that logs) -> the start of each message filtered there.
MEGATRON_MESSAGES = {
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),
    "megatron.core.distributed.distributed_data_parallel": (
        "DistributedDataParallel: full_param_layout not provided with",),
    "megatron.core.dist_checkpointing.strategies.torch": ("MCore's async save is deprecated",),
}
TORCH_MESSAGES = {"torch.utils.cpp_extension": ("No CUDA runtime is found",)}
# module -> the start of each Python warning (warnings.warn) filtered from it.
MEGATRON_WARNINGS = {
    "megatron.core._rank_utils": ("Could not determine rank from torch.distributed",),
    "megatron.core.models.mimo.config.base_configs": ("MimoModelConfig is experimental",),
    # Megatron calls these (DDP's buffers); the message is in torch's source, not Megatron's.
    "torch.distributed.distributed_c10d": ("`torch.distributed.reduce_scatter_tensor` is deprecated",
                                           "`torch.distributed.all_gather_into_tensor` is deprecated"),
    # Megatron's dist_checkpointing load calls torch's (above); the texts are torch's.
    "torch.distributed.checkpoint.state_dict_loader": (
        "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single",),
    "torch.distributed.checkpoint.utils": ("The argument order of ",),
    "torch.distributed._shard._utils": ("Please use DTensor instead and we are deprecating ShardedTensor.",),
}
# The FutureWarnings among MEGATRON_WARNINGS (every other one is a UserWarning).
FUTURE_WARNINGS = ("`torch.distributed.reduce_scatter_tensor` is deprecated",
                   "`torch.distributed.all_gather_into_tensor` is deprecated",
                   "Please use DTensor instead and we are deprecating ShardedTensor.")
NON_LEAF_GRAD = "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"
# Where the non-leaf .grad warning is raised from (above), and the source line that explains it.
NON_LEAF_GRAD_MODULES = r"(megatron\.core\.optimizer\.optimizer|pretrain\.megatron_fixes\.cpu)$"
NON_LEAF_GRAD_CAUSE = {"megatron.core.optimizer.distrib_optimizer": ("self.shard_fp32_groups,  # throws grad-access warning",)}
# The Megatron calls behind the checkpoint loader's warnings: when they change, look again.
CHECKPOINT_LOAD_CAUSE = {
    "megatron.core.dist_checkpointing.serialization": ("no_dist=True",),
    "megatron.core.dist_checkpointing.strategies.torch": ("no_dist=True", "mcore_to_pyt_state_dict(sharded_state_dict"),
}


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        return not message.startswith(self.prefixes)


def _install(messages: dict[str, tuple[str, ...]]) -> None:
    for name, prefixes in messages.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(prefixes))


def install_import_filters() -> None:
    """The filters that must precede megatron.core's import (they import nothing)."""
    _install(TORCH_MESSAGES)
    for prefixes in MEGATRON_WARNINGS.values():
        for prefix in prefixes:
            category = FutureWarning if prefix in FUTURE_WARNINGS else UserWarning
            warnings.filterwarnings("ignore", message=re.escape(prefix), category=category)
    warnings.filterwarnings("ignore", message=re.escape(NON_LEAF_GRAD), category=UserWarning,
                            module=NON_LEAF_GRAD_MODULES)


def check_non_leaf_grad_text() -> None:
    """UpstreamChanged unless reading an unset .grad of a view still warns NON_LEAF_GRAD."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _ = torch.zeros(2, requires_grad=True).view(-1).grad
    if not any(str(w.message).startswith(NON_LEAF_GRAD) for w in caught):
        raise UpstreamChanged(f"megatron_fixes.quiet: torch no longer warns {NON_LEAF_GRAD!r} on a view's "
                              f"unset .grad (it warned {[str(w.message)[:80] for w in caught]}); read "
                              "pretrain/megatron_fixes/quiet.py")


def check_messages(messages: dict[str, tuple[str, ...]]) -> None:
    """UpstreamChanged unless every filtered message still occurs in its module's source."""
    for name, prefixes in messages.items():
        source = inspect.getsource(importlib.import_module(name))
        for prefix in prefixes:
            if prefix not in source:
                raise UpstreamChanged(
                    f"megatron_fixes.quiet: {name} no longer logs {prefix!r}; read what it logs now "
                    "against pretrain/megatron_fixes/quiet.py")


def apply() -> None:
    # Filters first: the check imports the modules, and importing the MIMO config warns.
    install_import_filters()
    check_messages({**MEGATRON_MESSAGES, **TORCH_MESSAGES, **MEGATRON_WARNINGS, **NON_LEAF_GRAD_CAUSE,
                    **CHECKPOINT_LOAD_CAUSE})
    check_non_leaf_grad_text()
    _install(MEGATRON_MESSAGES)
