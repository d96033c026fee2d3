"""Runtime start-up: rank discovery (torchrun or Slurm), process groups, Megatron parallel state.

Order: read the environment -> pick the device and backend (NCCL on GPU, gloo on CPU) ->
apply megatron_fixes (CPU stand-ins if there is no GPU) -> init_process_group -> parallel_state ->
seeds (Python, numpy, torch, Megatron's tensor-parallel RNG tracker).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel

from models.layout import ParallelLayout
from pretrain import megatron_fixes


@dataclasses.dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"


def read_dist_env(environ: dict | None = None) -> DistEnv:
    """Rank/world from torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or Slurm (SLURM_PROCID/...)."""
    env = os.environ if environ is None else environ
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                       addr, int(env.get("MASTER_PORT", 29500)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        # One srun task per device; launch.slurm exports MASTER_ADDR/PORT from the allocation.
        port = int(env.get("MASTER_PORT", 20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000))
        return DistEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                       int(env.get("SLURM_LOCALID", 0)), addr, port, "slurm")
    return DistEnv(0, 1, 0, addr, int(env.get("MASTER_PORT", 29500)), "single")


def world_size_from_env() -> int:
    return read_dist_env().world_size


def init_distributed(layout: ParallelLayout, *, seed: int, timeout_minutes: int = 10) -> DistEnv:
    """Create the process groups and Megatron-Core's parallel state exactly once."""
    env = read_dist_env()
    _forked_children_die_with_rank()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    megatron_fixes.apply(cpu=not on_gpu)
    if not dist.is_initialized():
        # One process needs no rendezvous: an in-memory store binds no port, so any number of
        # single-process runs (and tests) share a machine without EADDRINUSE.
        rendezvous = (dict(store=dist.HashStore()) if env.source == "single"
                      else dict(init_method=f"tcp://{env.master_addr}:{env.master_port}"))
        dist.init_process_group(
            backend="nccl" if on_gpu else "gloo",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            **rendezvous,
        )
    if not parallel_state.model_parallel_is_initialized():
        # HSDP: Megatron's data-parallel groups split into inner (shard) and outer (replica) ones.
        parallel_state.initialize_model_parallel(**layout.megatron_parallel_sizes(),
                                                 num_distributed_optimizer_instances=layout.hsdp_replicas)
    set_seeds(seed)
    return env


_fork_hook_installed = False


def _forked_children_die_with_rank() -> None:
    """Processes forked from a rank (dist_checkpointing 0.16 forked one writer per file; 0.19
    writes from threads, but a forked child, e.g. a data worker, still may) inherit
    its rendezvous socket. If the rank is killed mid-save they live on, blocked on a queue
    lock the rank held, and keep the port: the next launch on it fails with EADDRINUSE.
    So every child forked from here dies with its parent."""
    global _fork_hook_installed
    if not _fork_hook_installed:
        from data_pipeline.processes import die_with_parent

        os.register_at_fork(after_in_child=die_with_parent)
        _fork_hook_installed = True


def collective_device() -> torch.device:
    """Where a small tensor must live to go through the default group's collectives."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_seeds(seed: int) -> None:
    """Same seed on every rank for Python/numpy/torch; Megatron derives TP/EP-specific
    streams (dropout inside TP regions) from it in its RNG tracker."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown(barrier: bool = True) -> None:
    """Tear down Megatron's groups and the process group. barrier=False after an error on
    this rank: its peers may be waiting in another collective, and a barrier would hang the
    rank instead of letting its exception end the job."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


def is_logging_rank() -> bool:
    """The last pipeline stage's first rank sees the loss; it prints and writes metrics."""
    if not dist.is_initialized():
        return True
    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
        and parallel_state.get_context_parallel_rank() == 0
    )
