"""CPU stand-ins that let Megatron-Core run its real code paths on CPU through gloo.

Applied by `pretrain.megatron_fixes.apply()` only when CUDA is absent; never at import time.
Each stand-in changes device placement, a CUDA-only API or a gloo limitation, never the
math, and says which Megatron-Core call site needs it (each found by running that path on
CPU and reading where it failed). Known for megatron-core 0.19.2 with torch 2.13.0 (PyPI's CUDA
build without a GPU: `torch.cuda.is_available()` is False, and e.g. `current_stream()`, which
0.19's DDP calls on every gradient sync, raises "Found no NVIDIA driver" without the stand-in).
Guards: the Megatron functions replaced here (`_batched_p2p_ops`, the tensor-parallel RNG
state accessors) are pinned by source digest; the torch collectives wrapped here by their
signatures.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from pretrain.megatron_fixes import import_cost
from pretrain.megatron_fixes._guard import expect_signature, expect_sources

# The Megatron-Core functions replaced here, by the digest of the source they replace.
SOURCES = {
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state": "aa26caaa069c5c4f",
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state": "b179c9d95438b61c",
    "megatron.core.pipeline_parallel.p2p_communication:_batched_p2p_ops": "4b0901807501c561",
}
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

    Also drops `pin_memory=True` (page-locked host memory needs a CUDA allocator), e.g.
    `rope_utils.get_pos_emb_on_this_cp_rank` pins the CP chunk indices under context
    parallelism before copying them to the GPU.
    """

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
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

    def wait(self, *args, **kwargs):
        """As an Event (Megatron-FSDP waits on `record_event()`'s result): CPU work is done."""

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


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    # tensor_parallel/random.py reads/writes torch.cuda.default_generators directly.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.default_generator.get_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.default_generator.set_state(state)


def _patch_all_to_all() -> None:
    """gloo's all_to_all_single needs split sizes as Python lists; the MoE alltoall
    dispatcher passes tensors, also from backward (where the function mode is inactive)."""
    expect_signature("cpu", "torch.distributed:all_to_all_single",
                     ("output", "input", "output_split_sizes", "input_split_sizes", "group", "async_op"))
    original = dist.all_to_all_single

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, *a, **k)

    dist.all_to_all_single = all_to_all_single


def _patch_uneven_collectives() -> None:
    """Uneven all-gather and list reduce-scatter on gloo.

    With expert tensor parallelism > 1 the MoE alltoall dispatcher gathers and
    reduce-scatters a different number of tokens per expert-TP rank
    (`token_dispatcher.MoEAlltoAllTokenDispatcher.dispatch_postprocess` /
    `combine_preprocess` -> `tensor_parallel.mappings._gather_along_first_dim` /
    `_reduce_scatter_along_first_dim` with split sizes, the latter from backward). gloo's
    all_gather needs equal shapes and gloo has no list reduce_scatter. Uneven gathers are
    padded to the largest piece; reduce_scatter is an all-reduce of the concatenation
    from which each rank keeps its piece (same sum, more traffic: fine for tests).
    """
    expect_signature("cpu", "torch.distributed:all_gather", ("tensor_list", "tensor", "group", "async_op"))
    expect_signature("cpu", "torch.distributed:reduce_scatter", ("output", "input_list", "op", "group", "async_op"))
    original_all_gather = dist.all_gather

    @functools.wraps(original_all_gather)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if all(t.shape == tensor.shape for t in tensor_list):
            return original_all_gather(tensor_list, tensor, group=group, async_op=async_op)
        if async_op:
            raise NotImplementedError("uneven async all_gather on gloo")
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        pieces = [torch.empty_like(padded) for _ in tensor_list]
        original_all_gather(pieces, padded, group=group)
        for out, piece in zip(tensor_list, pieces):
            out.copy_(piece[: out.shape[0]])
        return None

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op:
            raise NotImplementedError("async reduce_scatter on gloo")
        flat = torch.cat([t.reshape(-1) for t in input_list])
        dist.all_reduce(flat, op=op, group=group)
        rank = dist.get_rank(group)
        start = sum(t.numel() for t in input_list[:rank])
        output.copy_(flat[start:start + output.numel()].view_as(output))
        return None

    dist.all_gather = all_gather
    dist.reduce_scatter = reduce_scatter


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


def apply() -> None:
    """Install the CPU stand-ins (once; `megatron_fixes.apply` calls this when CUDA is absent)."""
    if torch.cuda.is_available():
        raise RuntimeError("the CPU stand-ins are for machines without CUDA")
    expect_sources("cpu", SOURCES)
    _patch_torch_cuda()
    _patch_rng_tracker()
    _patch_all_to_all()
    _patch_uneven_collectives()
    _patch_pipeline_p2p()
    _CudaToCpuMode().__enter__()  # stays active for the process lifetime (main thread)
    import_cost.run_eagerly()  # Megatron's @jit_fuser functions: no torch.compile on CPU (it says why)
