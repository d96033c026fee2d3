"""In-training checkpoints on Megatron-Core `dist_checkpointing` (torch_dist format).

Directory layout under `checkpoint.dir`:
    step_00000020/          a complete checkpoint: dist_checkpointing shards + common.pt,
        rng/rank_<r>.pt     per-rank RNG states,
        meta.json           step, consumed samples, layout, model config, resolved config,
        COMPLETE            written last; a directory without it is not a checkpoint
    latest                  name of the newest complete checkpoint (replaced atomically)
    .tmp.step_00000030/     a save in progress (ignored; removed by the next save)

A save writes into `.tmp.step_N`, every rank barriers, rank 0 writes `COMPLETE`, renames
the directory to `step_N` and only then replaces `latest`. A crash at any point leaves the
previous checkpoint complete and `latest` pointing at it.

Model weights and the distributed optimizer state are saved in the fully reshardable
form, so a checkpoint loads at any TP/PP/VPP/DP layout. Loading uses torch's
`weights_only` unpickling for our own files (RNG); dist_checkpointing's `common.pt`
holds only tensors, numbers and strings (the LR scheduler state).
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, tensor_parallel

from pretrain.checkpointing import async_writer, optimizer_state
from pretrain.config import ExperimentConfig, dump_yaml
from pretrain.runtime import collective_device

COMPLETE = "COMPLETE"
# The optimizer format that loads at any TP/PP/DP layout. It gathers a DP-zero copy of the
# state while building the state dict (about 45% of a 100M model's async-save stall on
# CPU); 0.16.1's other reshardable format, "fully_sharded_model_space", fails on
# flattened ranges ("ShardedTensor.flattened_range is not supported").
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which and why."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (path / "meta.json").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and _is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def _sharded_state(run_state, config: Optional[ExperimentConfig], is_loading: bool) -> dict:
    optimizer_state.install(run_state.optimizer)
    model_sd = {}
    for i, chunk in enumerate(run_state.model):
        key = f"model{i}" if len(run_state.model) > 1 else "model"
        model_sd[key] = chunk.module.sharded_state_dict()
    state = dict(model_sd)
    # The nested {model0: ..., model1: ...} dict, as Megatron-LM passes it: chunks share
    # local key names, so flattening them would drop parameters.
    # Megatron runs a full gc.collect() in here (0.2 s with a model's worth of Python objects,
    # a third of an async save's stall); with the existing objects frozen it only looks at
    # the ones made since. Unfrozen right after, so nothing is kept from collection.
    gc.freeze()
    try:
        state["optimizer"] = run_state.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=OPTIM_METADATA
        )
    finally:
        gc.unfreeze()
    return state


def _rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _staging_fits(pool, state: dict, log) -> bool:
    """Whether every rank's share of this save fits its shared memory for staging; if
    not, this save is synchronous (training stalls for it, nothing is lost)."""
    fits, need = pool.room_for(state)
    flag = torch.tensor([0 if fits else 1], dtype=torch.int, device=collective_device())
    dist.all_reduce(flag)
    if int(flag.item()) == 0:
        return True
    log(f"warning: async checkpoint staging needs {need / 2**30:.2f} GiB of shared memory per "
        f"rank; some rank's {pool.shm_dir} or memory has less room: saving synchronously instead "
        "(enlarge /dev/shm, e.g. docker --shm-size, or set checkpoint.async_save=false)")
    return False


def _write_shards(root: Path, step: int, run_state, pool=None, log=print):
    """Write model/optimizer shards and RNG into the temporary directory.

    With a staging pool (async save), returns dist_checkpointing's AsyncRequest: every
    tensor has been copied into the pool, and the writer process writes from there while
    training goes on. Without one, writes synchronously and returns None.
    """
    rank = dist.get_rank()
    tmp = root / f".tmp.{step_dir_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # a crashed earlier attempt at this step
        tmp.mkdir(parents=True)
    dist.barrier()
    state = _sharded_state(run_state, None, is_loading=False)
    state["scheduler"] = run_state.scheduler.state_dict()
    if pool is not None and not _staging_fits(pool, state, log):
        pool = None
    if pool is None:
        with async_writer.without_clones():
            request = dist_checkpointing.save(state, str(tmp))
    else:
        with async_writer.staging(pool):
            request = dist_checkpointing.save(state, str(tmp), sharded_strategy=pool.strategy,
                                              async_sharded_save=True)
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank}.pt")
    return request


def _finalize(root: Path, step: int, config: ExperimentConfig, world_size: int, keep_last: int) -> Path:
    """Mark the checkpoint complete, move it into place, advance `latest` (all ranks call)."""
    dist.barrier()  # every rank's shards are on disk
    final = root / step_dir_name(step)
    tmp = root / f".tmp.{step_dir_name(step)}"
    if dist.get_rank() == 0:
        meta = {
            "step": step,
            "consumed_samples": step * config.schedule.global_batch_size,
            "world_size": world_size,
            "layout": config.parallel.model_dump(),
            "layout_name": config.parallel.describe(world_size),
            "model": config.model.model_dump(),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        (tmp / "config.yaml").write_text(dump_yaml(config))
        _fsync_write(tmp / COMPLETE, "complete\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_write(root / "latest.tmp", final.name + "\n")
        os.replace(root / "latest.tmp", root / "latest")
        _retain(root, keep_last)
    dist.barrier()
    return final


class Checkpointer:
    """Saves every N steps (sync or async); the loop polls it once per step on every rank."""

    def __init__(self, config: ExperimentConfig, world_size: int, log):
        self.config, self.world_size, self.log = config, world_size, log
        self.root = Path(config.checkpoint.dir) if config.checkpoint.dir else None
        self.queue = self.pool = None
        if self.root is not None:
            async_writer.start_write_results_queue()
        if config.checkpoint.async_save:
            self.queue, self.pool = async_writer.WriterQueue(), async_writer.StagingPool()

    def save(self, step: int, run_state) -> None:
        ckpt = self.config.checkpoint
        self.wait()  # at most one save in flight: the next save waits for the previous
        request = _write_shards(self.root, step, run_state, self.pool, self.log)
        finalize = lambda: self.log(f"saved checkpoint {_finalize(self.root, step, self.config, self.world_size, ckpt.keep_last)}")
        if request is None:
            finalize()
        else:
            request.add_finalize_fn(finalize)
            self.queue.schedule_async_request(request)

    def poll(self) -> None:
        """Finalize a finished async save without blocking (a collective: call on all ranks)."""
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        if self.queue is not None:
            self.queue.maybe_finalize_async_calls(blocking=True)

    def close(self) -> None:
        if self.queue is not None:
            self.wait()
            self.queue.close()


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _retain(root: Path, keep_last: int) -> None:
    """Delete all but the newest keep_last complete checkpoints (never the newest)."""
    complete = complete_checkpoints(root)
    for old in complete[: max(0, len(complete) - max(1, keep_last))]:
        shutil.rmtree(old, ignore_errors=True)


def resolve_resume(config: ExperimentConfig, log) -> Optional[Path]:
    """The checkpoint to resume from, or None to start fresh (before any process group)."""
    spec = str(config.checkpoint.resume)
    root = Path(config.checkpoint.dir) if config.checkpoint.dir else None
    if spec == "none":
        return None
    if spec == "auto":
        if root is None:
            return None
        for bad in sorted(root.glob("step_*")) if root.is_dir() else []:
            if bad.is_dir() and not _is_complete(bad):
                log(f"warning: skipping incomplete checkpoint {bad} (no {COMPLETE} marker: crash mid-save)")
        complete = complete_checkpoints(root)
        return complete[-1] if complete else None
    path = Path(spec)
    if spec.isdigit():
        if root is None:
            raise CheckpointError(f"checkpoint.resume={spec} is a step number but checkpoint.dir is unset")
        path = root / step_dir_name(int(spec))
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; use checkpoint.resume=auto or a valid path")
    if not (path / "meta.json").is_file() and not (path / COMPLETE).is_file():
        raise CheckpointError(f"{path} is not a checkpoint (no meta.json / {COMPLETE} marker)")
    if not _is_complete(path):
        raise CheckpointError(f"checkpoint {path} is incomplete (the save crashed before {COMPLETE}); "
                              "resume from an earlier step or use checkpoint.resume=auto")
    return path


def check_compatible(path: Path, config: ExperimentConfig) -> dict:
    """Refuse a checkpoint of a different model; returns its metadata."""
    meta = json.loads((path / "meta.json").read_text())
    mine = config.model.model_dump()
    diffs = [f"{k}: checkpoint {meta['model'].get(k)!r} vs config {v!r}"
             for k, v in mine.items() if meta["model"].get(k) != v]
    if diffs:
        raise CheckpointError(f"checkpoint {path} is from an incompatible model:\n  " + "\n  ".join(diffs))
    return meta


def _fresh_adam_optimizers(optimizer) -> list:
    """Inner torch AdamW optimizers that have never stepped (empty state)."""
    found = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.AdamW) and len(inner.state) == 0:
            found.append(inner)
    return found


def _loading_state_dict(run_state, config: ExperimentConfig) -> dict:
    """The sharded state dict to load into, for a never-stepped optimizer too.

    Without Transformer Engine/Apex, Megatron-Core 0.16's DistributedOptimizer.state_dict()
    reads a per-parameter `step` from the inner torch AdamW and asserts there is exactly one
    value, which fails before the first step. We give the inner optimizer a placeholder
    state while the (loading) state dict is built, then empty it again, because
    DistributedOptimizer.load_state_dict allocates the real state only when it is empty.
    """
    fresh = _fresh_adam_optimizers(run_state.optimizer)
    for inner in fresh:
        for group in inner.param_groups:
            for p in group["params"]:
                if len(inner.state[p]) == 0:
                    inner.state[p]["step"] = torch.tensor(0.0)
                    inner.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    inner.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
    state = _sharded_state(run_state, config, is_loading=True)
    for inner in fresh:
        inner.state.clear()
    return state


def _keep_unsaved_optimizer_keys(optimizer) -> None:
    """Let fully-reshardable loading skip per-parameter keys the checkpoint does not carry.

    With torch's AdamW (no TE/Apex) the inner state has a per-parameter `step`, which
    Megatron-Core 0.16 saves in the common state, not with the parameter shards; its
    `_set_main_param_and_optimizer_states` still copies every key of the live state and
    fails on `step`. This wraps that method on *these instances* only: a key missing from
    the loaded shard keeps the value `load_state_dict` just restored.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if original is None or getattr(original, "_keeps_unsaved", False):
            continue

        def wrapped(model_param, tensors, _opt=opt, _original=original):
            group_index, group_order = _opt.model_param_group_index_map[model_param]
            main_param = _opt.optimizer.param_groups[group_index]["params"][group_order]
            live = _opt.optimizer.state[main_param]
            merged = {**{k: v for k, v in live.items() if k not in tensors}, **tensors}
            return _original(model_param, merged)

        wrapped._keeps_unsaved = True
        opt._set_main_param_and_optimizer_states = wrapped


def _unshare_adam_steps(optimizer) -> None:
    """Give every parameter its own AdamW `step` tensor after loading.

    Megatron-Core 0.16's DistributedOptimizer.load_state_dict (no TE/Apex branch) assigns
    ONE tensor as `step` to every parameter; torch's AdamW increments it in place, so after
    a resume each parameter's update would see step + (its index) and resume diverges.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.AdamW):
            for state in inner.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].detach().clone()


def read_meta(path: Path) -> dict:
    """meta.json of a checkpoint directory (step, layout, model config, contents)."""
    return json.loads((Path(path) / "meta.json").read_text())


def has_optimizer_state(meta: dict) -> bool:
    """False for model-only checkpoints: checkpoints_tools' serving copies and HF imports."""
    return bool(meta.get("has_optimizer", True))


def mark_complete(directory: Path) -> None:
    """Write the COMPLETE marker (fsynced); call after every other file of the checkpoint."""
    _fsync_write(Path(directory) / COMPLETE, "complete\n")


def model_state_key(index: int, num_chunks: int) -> str:
    """`model` for one chunk, `model0`, `model1`, ... for virtual pipeline chunks."""
    return f"model{index}" if num_chunks > 1 else "model"


def load_model_weights(path: Path, chunks: list) -> None:
    """Load only the model weights of a checkpoint into (unwrapped) chunks at this layout."""
    state = {model_state_key(i, len(chunks)): c.sharded_state_dict() for i, c in enumerate(chunks)}
    loaded = dist_checkpointing.load(state, str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[model_state_key(i, len(chunks))])


def _load_model_only(path: Path, run_state, meta: dict, log) -> int:
    """Resume from a model-only checkpoint: weights (and the LR schedule if saved), a fresh
    optimizer. The optimizer copied its main params from the initial weights when it was
    built, so they are refreshed from the loaded ones."""
    load_model_weights(path, [chunk.module for chunk in run_state.model])
    run_state.optimizer.reload_model_params()
    common = dist_checkpointing.load_common_state_dict(str(path)) or {}
    if "scheduler" in common:
        run_state.scheduler.load_state_dict(common["scheduler"])
    log(f"loaded model weights from {path} (step {meta['step']}); it holds no optimizer state, "
        "so the optimizer starts fresh" + ("" if "scheduler" in common else " and the LR schedule at step 0"))
    return int(meta["step"])


def load(path: Path, run_state, config: ExperimentConfig, world_size: int, log) -> int:
    """Load model, optimizer, scheduler (and RNG if the layout is unchanged); returns the step."""
    meta = check_compatible(path, config)
    if not has_optimizer_state(meta):
        return _load_model_only(path, run_state, meta, log)
    state = _loading_state_dict(run_state, config)
    _keep_unsaved_optimizer_keys(run_state.optimizer)
    loaded = dist_checkpointing.load(state, str(path))
    for i, chunk in enumerate(run_state.model):
        key = f"model{i}" if len(run_state.model) > 1 else "model"
        chunk.module.load_state_dict(loaded[key])
    run_state.optimizer.load_state_dict(loaded["optimizer"])
    _unshare_adam_steps(run_state.optimizer)
    run_state.scheduler.load_state_dict(loaded["scheduler"])
    now = config.parallel.describe(world_size)
    rng_file = path / "rng" / f"rank_{dist.get_rank()}.pt"
    if meta["layout_name"] == now and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
        log(f"resumed from {path} at step {meta['step']} (layout {now})")
    else:
        log(f"resumed from {path} at step {meta['step']}: resharded from {meta['layout_name']} to {now} "
            "(RNG states not restored: they are per rank)")
    return int(meta["step"])
