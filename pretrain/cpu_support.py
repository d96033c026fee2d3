"""CPU stand-ins that let Megatron-Core 0.16 run its real code paths on CPU through gloo.

Applied by ONE explicit call, `enable_cpu_execution()`, during runtime start-up and only
when CUDA is absent; never at import time. Each stand-in changes device placement or a
CUDA-only API, never the math, and says which Megatron-Core call site needs it (measured
facts: ../shared/notes/megatron-core-on-cpu.md).
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_ENABLED = False
_CPU = torch.device("cpu")


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites `device="cuda"` / `device=<int>` in tensor factories to CPU.

    ~70 places hard-code a CUDA device, e.g. `transformer/utils.get_default_causal_mask`,
    rotary embeddings, p2p receive buffers. Torch function modes are thread-local and are
    not active inside autograd's backward threads; code reached from backward is patched
    directly below instead.
    """

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if func in (torch.Tensor.to,) and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


class _NoOpStream:
    """torch.cuda.Stream / Event stand-in: DDP and MoE layers order work with streams."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # ~175 calls of torch.cuda.current_device() are used as `device=`; a CPU device works.
    cuda.current_device = lambda: _CPU
    cuda.Stream = _NoOpStream
    cuda.Event = _NoOpStream
    cuda.current_stream = lambda *a, **k: _NoOpStream()
    cuda.default_stream = lambda *a, **k: _NoOpStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.set_device = lambda *a, **k: None
    cuda.nvtx = types.SimpleNamespace(
        range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
        range=lambda *a, **k: contextlib.nullcontext(), mark=lambda *a, **k: None,
    )
    # RNG: Megatron's tracker saves/restores the "CUDA" generator around forks; use the CPU
    # default generator. Must not call torch.manual_seed (it calls cuda.manual_seed_all).
    cuda.get_rng_state = lambda *a, **k: torch.default_generator.get_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.default_generator.set_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    # DistributedOptimizer / Float16Optimizer / clip_grads accept only parameters whose
    # type() string is a torch.cuda.*Tensor.
    original_type = torch.Tensor.type

    @functools.wraps(original_type)
    def _type(self, *args, **kwargs):
        result = original_type(self, *args, **kwargs)
        if not args and not kwargs and isinstance(result, str) and result.startswith("torch."):
            if not result.startswith("torch.cuda."):
                return "torch.cuda." + result[len("torch."):]
        return result

    torch.Tensor.type = _type


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    # tensor_parallel/random.py reads/writes torch.cuda.default_generators directly.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.default_generator.get_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.default_generator.set_state(state)

    # 0.16.1 without Transformer Engine: moe/moe_utils.py references te_general_gemm in the
    # router but only defines it when TE imports (NameError otherwise).
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_all_to_all() -> None:
    """gloo's all_to_all_single needs split sizes as Python lists; the MoE alltoall
    dispatcher passes tensors, also from backward (where the function mode is inactive)."""
    original = dist.all_to_all_single

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, *a, **k)

    dist.all_to_all_single = all_to_all_single


def _patch_pipeline_p2p() -> None:
    """Tag pipeline messages by direction so gloo matches them correctly.

    `p2p_communication._batched_p2p_ops` posts [send_prev, recv_prev, send_next, recv_next]
    with one tag. At PP=2 the previous and next stage are the same peer, so in the
    interleaved steady state rank A sends [grad, activation] to rank B while B posts its
    receives as [activation, grad]; gloo matches by (peer, tag) in posting order and swaps
    them (seen as wrong losses from the third microbatch on). Activations (send_next /
    recv_prev) and gradients (send_prev / recv_next) get different tags instead.
    """
    from megatron.core.pipeline_parallel import p2p_communication

    def _batched_p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                         group, prev_pipeline_rank, next_pipeline_rank):
        activation, gradient = 1, 2
        ops = []
        for tensor, op, peer, tag in (
            (tensor_send_prev, dist.isend, prev_pipeline_rank, gradient),
            (tensor_recv_prev, dist.irecv, prev_pipeline_rank, activation),
            (tensor_send_next, dist.isend, next_pipeline_rank, activation),
            (tensor_recv_next, dist.irecv, next_pipeline_rank, gradient),
        ):
            if tensor is not None:
                ops.append(dist.P2POp(op, tensor, peer, group, tag))
        return dist.batch_isend_irecv(ops) if ops else []

    p2p_communication._batched_p2p_ops = _batched_p2p_ops


def enable_cpu_execution() -> None:
    """Install the CPU stand-ins (idempotent). Call once at start-up when CUDA is absent."""
    global _ENABLED
    if _ENABLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("enable_cpu_execution() is for machines without CUDA")
    _patch_torch_cuda()
    _patch_megatron()
    _patch_all_to_all()
    _patch_pipeline_p2p()
    _CudaToCpuMode().__enter__()  # stays active for the process lifetime (main thread)
    _ENABLED = True


def cpu_execution_enabled() -> bool:
    return _ENABLED
