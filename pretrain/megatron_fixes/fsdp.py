"""Megatron-FSDP (ZeRO-2/3, HSDP: `megatron.core.distributed.fsdp`) on CPU through gloo.

Known for megatron-core 0.19.2 (in-tree Megatron-FSDP 0.6.1; first written for 0.16.1, each
fact measured by comparing every layout with the one-rank run: losses, grad norms, final
weights; tests/pretrain/test_sharded_dp.py keeps them). Paths below are under
`megatron/core/distributed/fsdp/`. Applied by `megatron_fixes.apply()` on CPU; each
replaced or wrapped object is pinned by its source digest.

CPU stand-ins (no CUDA):
1. `src/megatron_fsdp/megatron_fsdp.py`, `MegatronFSDP.__init__` formats
   `torch.device(f"cuda:{torch.cuda.current_device()}")` even when a device is passed (for
   a warning); with our CPU stand-in `current_device()` is a CPU device and the string
   "cuda:cpu" is invalid. During that constructor `current_device()` answers 0 (no CUDA
   call is made with it) and its "using device cpu instead of cuda:0" warning is muted: we
   pass device=cpu on purpose. (0.19.2 added constructor arguments, mixed-precision policy
   and fine-grained units among them; the device lines are unchanged.)
2. `src/megatron_fsdp/param_and_grad_buffer.py`, `AllGatherPipeline.all_gather_params`:
   the parameter all-gather is coalesced and asynchronous (`async_param_gather=True`;
   megatron_fsdp.py never passes it). On gloo, coalesced async all-gathers corrupted
   the heap in 2 of 53 runs (0.16.1, the note); here they are made synchronous (gloo runs them
   on the CPU that computes anyway: nothing is lost by waiting). 0.19.2 changed the body
   (double-buffer prefetch, HSDP's outer all-gather per expert group) and kept the signature
   and the `_coalescing_manager(async_ops=async_param_gather)` call this forces.
3. `optimizer/clip_grads.py`: without Apex/TE the grad norm falls back to
   `utils.local_multi_tensor_l2_norm` (unchanged in 0.19.2), torch.norm in fp32, which on CPU
   is off by ~5e-6 relative for a 0.5M-element tensor, differently for differently sharded
   tensors: two layouts with the same gradients (to 3e-8) reported grad norms 1.6e-5 apart
   (TP2 plain DDP included). The norm is accumulated in fp64 instead (the CUDA kernels are
   accurate to ~1e-7), so grad-norm parity is meaningful on CPU.

Deleted with 0.19: the stand-in for `mcore_fsdp_adapter.TELinear` (0.16.1's
`_fix_tensor_parallel_attributes` did `isinstance(module, (TELinear,))`, and without TE
`TELinear` was a MagicMock). 0.19 removed that method: tensor-parallel metadata is now
annotated from class names and the modules' `tensor_model_parallel`/`partition_dim`
attributes (`_detect_parallelism_type`), which needs no TE.

0.16.1 bugs that were avoided by refusing the layouts, re-measured on 0.19.2 and no longer refused
(tests/pretrain/test_sharded_dp.py trains each against one rank: losses, grad norms, weights):
- A gradient buffer that is not sharded (strategy `optim`, or a shard group of ONE rank:
  ZeRO-2/3 at DP 1, HSDP with one rank per replica) added the reduce-scatter result to this
  rank's own gradient (0.16.1 `_bucket_group_gradient_reduce`; measured 2.8-3.3x grad norm at
  HSDP 2x1). 0.19.2 copies instead for `no_shard`/`optim` and skips unsharded buffers.
- HSDP with `outer_dp_sharding_strategy` other than `no_shard` reduced the grad norm over
  one replica only (0.16.1 optimizer/__init__.py:459; 0.43-0.66x): our HSDP is always "shard
  inside a replica, replicate across replicas" (outer `no_shard`).
- MoE with HSDP: 0.16.1's adapter built no expert mesh for HSDP (`_init_dist_index`), weights
  came out 0.14 off with no error. 0.19.2 builds one.
Still refused:
- PP > 1: the adapter's device mesh has no pipeline dimension (`_get_dp_tp_mesh`, unchanged
  in 0.19.2; einops shape mismatch at wrap time): refused.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

from pretrain.megatron_fixes._guard import expect_signature, expect_sources

_FSDP = "megatron.core.distributed.fsdp"
SOURCES = {
    f"{_FSDP}.src.megatron_fsdp.megatron_fsdp:MegatronFSDP.__init__": "d07b622fa2f3a780",
    f"{_FSDP}.src.megatron_fsdp.param_and_grad_buffer:AllGatherPipeline.all_gather_params": "4530f38ae3143f84",
    "megatron.core.utils:local_multi_tensor_l2_norm": "01526c55444a73bd",
}


def _constructor_on_cpu() -> None:
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp

    original = megatron_fsdp.MegatronFSDP.__init__
    log = logging.getLogger(megatron_fsdp.__name__)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        current, level = torch.cuda.current_device, log.level
        torch.cuda.current_device = lambda: 0
        log.setLevel(logging.ERROR)
        try:
            original(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current
            log.setLevel(level)

    megatron_fsdp.MegatronFSDP.__init__ = __init__


def _synchronous_param_gather() -> None:
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import AllGatherPipeline

    expect_signature("fsdp", f"{_FSDP}.src.megatron_fsdp.param_and_grad_buffer:AllGatherPipeline.all_gather_params",
                     ("self", "params", "prefetch", "prefetch_order", "suggested_AG_prefetch_size",
                      "async_param_gather", "outer_fsdp_group_param_gather", "bwd"))
    original = AllGatherPipeline.all_gather_params
    signature = inspect.signature(original)

    @functools.wraps(original)
    def all_gather_params(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["async_param_gather"] = False
        return original(*bound.args, **bound.kwargs)

    AllGatherPipeline.all_gather_params = all_gather_params


def _fp64_grad_norm() -> None:
    from megatron.core.optimizer import clip_grads

    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        """(the norm over every tensor as a 1-element fp32 tensor, None), as the fallback
        returns it; accumulated in fp64."""
        total = torch.zeros((), dtype=torch.float64)
        for tensors in tensor_lists:
            for t in tensors:
                total += torch.linalg.vector_norm(t, dtype=torch.float64).square()
        return total.sqrt().to(torch.float32).reshape(1), None

    if clip_grads.l2_norm_impl.__name__ == "local_multi_tensor_l2_norm":  # no Apex/TE kernel
        clip_grads.l2_norm_impl = l2_norm


def apply() -> None:
    """The CPU stand-ins above (megatron_fixes.apply calls this when CUDA is absent)."""
    expect_sources("fsdp", SOURCES)
    _constructor_on_cpu()
    _synchronous_param_gather()
    _fp64_grad_norm()
