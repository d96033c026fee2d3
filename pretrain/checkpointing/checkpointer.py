"""In-training checkpoints on Megatron-Core `dist_checkpointing` (torch_dist format).

The folder layout, metadata and `latest` pointer are `pretrain.checkpointing.format`'s. A
save writes into `.tmp.step_N`, every rank barriers, rank 0 writes meta.json, config.yaml and
`COMPLETE`, renames the directory to `step_N` and only then replaces `latest`. A crash at
any point leaves the previous checkpoint complete and `latest` pointing at it.

`Checkpointer` owns the save policy: the loop calls `checkpointer.save(step, state,
last_step=..., stop=...)` once per step on every rank, and the checkpointer decides (every
`save_interval` steps, the last step, a stop request), finalizes a finished async save,
and applies keep-last-N.

Model weights and the distributed optimizer state are saved in the fully reshardable form,
so a checkpoint loads at any TP/PP/VPP/DP layout. Loading uses torch's `weights_only`
unpickling for our own files (RNG); dist_checkpointing's `common.pt` holds only tensors,
numbers and strings (the LR scheduler state).
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import shutil
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, tensor_parallel

from pretrain.checkpointing import async_writer, fsdp_state
from pretrain.checkpointing.integrity import collect_file_table
from pretrain.checkpointing.format import (
    CONFIG,
    CheckpointError,
    CheckpointMeta,
    complete_checkpoints,
    read_latest,
    mark_complete,
    model_state_key,
    rng_file,
    step_dir_name,
    tmp_dir_name,
    write_latest,
)
from pretrain.config import ExperimentConfig, dump_yaml
from pretrain.runtime import collective_device

__all__ = ["CheckpointError", "Checkpointer", "check_compatible", "load", "load_model_weights",
           "precision_change"]

# The optimizer format that loads at any TP/PP/DP layout. 0.16.1's other reshardable
# format, "fully_sharded_model_space", fails on flattened ranges ("ShardedTensor.
# flattened_range is not supported"). Its save-time state is built by
# megatron_fixes.optimizer_save.
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _model_state(chunks: list) -> dict:
    return {model_state_key(i, len(chunks)): c.sharded_state_dict() for i, c in enumerate(chunks)}


def _sharded_state(run_state, is_loading: bool) -> dict:
    """Model chunks and optimizer as dist_checkpointing saves/loads them. Under Megatron-FSDP
    call it inside `fsdp_state.gathered`: the same keys and tensors, from the gathered model."""
    if fsdp_state.is_fsdp(run_state):
        model_sd = _model_state(fsdp_state.inner_models(run_state))
        build = fsdp_state.optimizer_state_for_load if is_loading else fsdp_state.optimizer_state_for_save
        return {**model_sd, "optimizer": build(run_state, model_sd)}
    model_sd = _model_state([chunk.module for chunk in run_state.model])
    state = dict(model_sd)
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


def _gathered_if_fsdp(run_state):
    """Megatron-FSDP: the full (TP-local) parameters while the state dict is built and used."""
    return fsdp_state.gathered(run_state) if fsdp_state.is_fsdp(run_state) else contextlib.nullcontext()


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


def _gather_params(run_state) -> None:
    """With optimizer.overlap_param_gather, an optimizer step updates only each rank's own
    shard of the weights; the others arrive with the next forward's all-gather, after this
    save. Gather them now, synchronously (Megatron-LM's force_param_sync before a save)."""
    for chunk in run_state.model:
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)


def _write_shards(root: Path, step: int, run_state, pool=None, log=print):
    """Write model/optimizer shards and RNG into the temporary directory.

    With a staging pool (async save), returns dist_checkpointing's AsyncRequest: every
    tensor has been copied into the pool, and the writer process writes from there while
    training goes on. Without one, writes synchronously and returns None.
    """
    rank = dist.get_rank()
    tmp = root / tmp_dir_name(step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # a crashed earlier attempt at this step
        tmp.mkdir(parents=True)
    dist.barrier()
    _gather_params(run_state)
    # Under Megatron-FSDP the gathered parameters are released when save() returns: a sync
    # save has written them, an async one has copied them into its staging memory.
    with _gathered_if_fsdp(run_state):
        state = _sharded_state(run_state, is_loading=False)
        state["scheduler"] = run_state.scheduler.state_dict()
        if pool is not None and not _staging_fits(pool, state, log):
            pool = None
        # async_strategy "mcore": Megatron's own FileSystemWriterAsync, which our staging and
        # write hooks wrap (0.19 defaults to NVIDIA Resiliency Extension's, not installed here;
        # a sync save always uses Megatron's).
        if pool is None:
            with async_writer.without_clones():
                request = dist_checkpointing.save(state, str(tmp))
        else:
            with async_writer.staging(pool):
                request = dist_checkpointing.save(state, str(tmp), sharded_strategy=pool.strategy,
                                                  async_sharded_save=True, async_strategy="mcore")
    rng_file(tmp, rank).parent.mkdir(exist_ok=True)
    torch.save(_rng_state(), rng_file(tmp, rank))
    return request


def training_meta(config: ExperimentConfig, step: int, world_size: int,
                  tracker_runs: Optional[dict] = None) -> CheckpointMeta:
    samples = step * config.schedule.global_batch_size
    return CheckpointMeta(
        step=step, consumed_samples=samples, consumed_tokens=samples * config.schedule.seq_length,
        world_size=world_size, layout=config.parallel.model_dump(),
        layout_name=config.parallel.describe(world_size), model=config.model.model_dump(),
        precision=config.runtime.precision(),
        tracker_runs=tracker_runs or None,
        optimizer=config.optimizer.name,
    )


# Fault drills: every rank waits this long with its shards written and the checkpoint not yet
# complete, a window in which to crash a node mid-save (tests/launch/test_multinode_faults.py
# sets it for one job with `launch.slurm --env`). Unset, as in every real run: no wait.
FAULT_SAVE_PAUSE_ENV = "PRETRAIN_FAULT_SAVE_PAUSE_S"


def _fault_drill_pause() -> None:
    seconds = float(os.environ.get(FAULT_SAVE_PAUSE_ENV) or 0)
    if seconds > 0:
        time.sleep(seconds)


def _finalize(root: Path, step: int, config: ExperimentConfig, world_size: int, keep_last: int, log,
              tracker_runs: Optional[dict] = None) -> Path:
    """Mark the checkpoint complete, move it into place, advance `latest` (all ranks call)."""
    _fault_drill_pause()
    dist.barrier()  # every rank's shards are on disk
    final = root / step_dir_name(step)
    tmp = root / tmp_dir_name(step)
    if dist.get_rank() == 0:
        (tmp / CONFIG).write_text(dump_yaml(config))
        meta = training_meta(config, step, world_size, tracker_runs)
        meta.files = collect_file_table(tmp)
        meta.write(tmp)
        mark_complete(tmp)
        if final.exists():
            # Not expected (resume refuses or moves newer checkpoints aside first, see
            # pretrain.checkpointing.resume); still, never delete a checkpoint silently.
            aside = root / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}" / final.name
            aside.parent.mkdir(parents=True, exist_ok=True)
            final.rename(aside)
            log(f"warning: {final} existed; moved it to {aside}")
        tmp.replace(final)
        write_latest(root, final.name)
        _retain(root, keep_last, final, tuple(config.checkpoint.save_steps))
    dist.barrier()
    return final


def _retain(root: Path, keep_last: int, saved: Path, pinned: tuple[int, ...] = ()) -> None:
    """Keep the newest keep_last complete checkpoints, and always the one just saved, the
    one `latest` names and those of the `pinned` steps (checkpoint.save_steps); delete the rest."""
    complete = complete_checkpoints(root)
    keep = set(complete[-max(1, keep_last):]) | {saved} | {root / step_dir_name(s) for s in pinned}
    latest = read_latest(root)
    if latest is not None:
        keep.add(root / latest)
    for old in complete:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)


class Checkpointer:
    """The save policy and the saves. `save(...)` is called once per step on every rank."""

    def __init__(self, config: ExperimentConfig, world_size: int, log, tracker_runs: Optional[dict] = None):
        self.config, self.world_size, self.log = config, world_size, log
        self.tracker_runs = tracker_runs  # written into every checkpoint's meta.json
        self.root = Path(config.checkpoint.dir) if config.checkpoint.dir else None
        self._queue = self._pool = None
        if self.root is not None and config.checkpoint.async_save:
            # The writer process is started by the first async save, not here.
            self._pool = async_writer.StagingPool()

    def save(self, step: int, run_state, *, last_step: bool = False, stop: bool = False) -> None:
        """Finalize a finished async save; save this step if it is due (every
        `checkpoint.save_interval` steps, a step of `checkpoint.save_steps`, the last step, or a
        stop request)."""
        self.poll()
        interval = self.config.checkpoint.save_interval
        due = (interval and step % interval == 0) or step in self.config.checkpoint.save_steps
        if self.root is not None and (last_step or stop or due):
            # The run waits for its last save and a stop save anyway: written in this process,
            # with no staging copy (and no writer process started for it).
            self.save_now(step, run_state, in_process=last_step or stop)

    def save_now(self, step: int, run_state, in_process: bool = False) -> None:
        """Save this step now: async if configured and not `in_process` (returns once the
        state is staged), else written before it returns."""
        if self.root is None:
            raise CheckpointError("checkpoint.dir is unset: nowhere to save")
        self.wait()  # at most one save in flight: the next save waits for the previous
        pool = None if in_process else self._pool
        if pool is not None and self._queue is None:
            self._queue = async_writer.WriterQueue()
        request = _write_shards(self.root, step, run_state, pool, self.log)
        keep = self.config.checkpoint.keep_last

        def finalize():
            final = _finalize(self.root, step, self.config, self.world_size, keep, self.log, self.tracker_runs)
            self.log(f"saved checkpoint {final}")

        if request is None:
            finalize()
        else:
            request.add_finalize_fn(finalize)
            self._queue.schedule_async_request(request)

    def pending(self) -> bool:
        """Whether an async save is still being written (this rank's view)."""
        return bool(self._queue is not None and self._queue.get_num_unfinalized_calls())

    def poll(self) -> None:
        """Finalize a finished async save without blocking (a collective: call on all ranks)."""
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=True)

    def close(self) -> None:
        if self._queue is not None:
            self.wait()
            self._queue.close()


def check_compatible(path: Path, config: ExperimentConfig) -> CheckpointMeta:
    """Refuse a checkpoint of a different model; returns its metadata."""
    meta = CheckpointMeta.read(path)
    mine = config.model.model_dump()
    # A key the checkpoint lacks was added to ModelConfig after it was written (e.g.
    # qk_layernorm after format-1 fixtures): new fields default to the behaviour before them,
    # so the checkpoint's value is that default.
    fields = type(config.model).model_fields
    theirs = {k: meta.model[k] if k in meta.model else fields[k].get_default(call_default_factory=True)
              for k in mine}
    diffs = [f"{k}: checkpoint {theirs[k]!r} vs config {v!r}" for k, v in mine.items() if theirs[k] != v]
    if diffs:
        raise CheckpointError(f"checkpoint {path} is from an incompatible model:\n  " + "\n  ".join(diffs))
    _check_moe_optimizer_move(path, meta, config)
    _check_optimizer_name(path, meta, config)
    return meta


def _check_optimizer_name(path: Path, meta: CheckpointMeta, config: ExperimentConfig) -> None:
    """AdamW moments, Muon and Lion momenta are different state: loading one into the other failed
    deep inside the load, or (Megatron-LM #6920) went through with the wrong state."""
    if meta.has_optimizer and meta.optimizer_name != config.optimizer.name:
        raise CheckpointError(
            f"checkpoint {path} holds {meta.optimizer_name} optimizer state, this run has optimizer.name="
            f"{config.optimizer.name}; resume with optimizer.name={meta.optimizer_name}, or start "
            f"{config.optimizer.name} from the weights: python -m checkpoints_tools.reshard {path} NEW_DIR "
            "--drop-optimizer, then checkpoint.resume=NEW_DIR")


def _fsdp_sharding(sharding: Optional[str]) -> bool:
    return sharding in ("zero2", "zero3")


def _check_moe_optimizer_move(path: Path, meta: CheckpointMeta, config: ExperimentConfig) -> None:
    """A MoE model's optimizer state cannot move between Megatron-FSDP (one optimizer over
    every parameter) and DDP / ZeRO-1 (separate dense and expert optimizers, `chained_<i>`
    keys): refused with the way out, instead of failing inside the load."""
    if not config.model.is_moe or not meta.has_optimizer:
        return
    saved = meta.layout.get("sharding")
    if _fsdp_sharding(saved) == config.parallel.fsdp:
        return
    raise CheckpointError(
        f"checkpoint {path} holds a MoE model's optimizer state saved with parallel.sharding={saved or 'none/zero1'}, "
        f"which cannot load at sharding={config.parallel.sharding or 'none/zero1'} (dense and expert optimizer state "
        "are kept together under zero2/zero3, apart otherwise); resume at the saved sharding level, or continue "
        "from the weights with a fresh optimizer: python -m checkpoints_tools.reshard "
        f"{path} NEW_DIR --drop-optimizer, then checkpoint.resume=NEW_DIR")


def precision_change(path: Path, meta: CheckpointMeta, config: ExperimentConfig) -> Optional[str]:
    """A warning if the checkpoint was trained with other precision settings (dtype, FP8 format,
    recipe or its settings) than this run's; None if they agree or the checkpoint does not say.
    Warned, not refused: changing the recipe mid-run is legitimate (e.g. BF16 warm-up, then
    FP8), but the loss curve is then not the one an uninterrupted run would give."""
    if meta.precision is None:
        return None
    now = config.runtime.precision()
    keys = sorted(set(meta.precision) | set(now))
    diffs = [f"{k} {meta.precision.get(k)!r} -> {now.get(k)!r}" for k in keys if meta.precision.get(k) != now.get(k)]
    if not diffs:
        return None
    return (f"warning: checkpoint {path} was trained with other precision settings than this run "
            f"({'; '.join(diffs)}); resuming from its weights and optimizer state anyway: the loss "
            "may jump and will not match an uninterrupted run")


def load_model_weights(path: Path, chunks: list) -> None:
    """Load only the model weights of a checkpoint into (unwrapped) chunks at this layout."""
    loaded = dist_checkpointing.load(_model_state(chunks), str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[model_state_key(i, len(chunks))])


def _load_model_only(path: Path, run_state, meta: CheckpointMeta, log) -> int:
    """Resume from a model-only checkpoint: weights (and the LR schedule if saved), a fresh
    optimizer. The optimizer copied its main params from the initial weights when it was
    built, so they are refreshed from the loaded ones."""
    if fsdp_state.is_fsdp(run_state):
        with fsdp_state.gathered(run_state) as models:
            loaded = dist_checkpointing.load(_model_state(models), str(path))
            fsdp_state.load_model(run_state, [loaded[model_state_key(i, len(models))] for i in range(len(models))])
    else:
        load_model_weights(path, [chunk.module for chunk in run_state.model])
        run_state.optimizer.reload_model_params()
    common = dist_checkpointing.load_common_state_dict(str(path)) or {}
    if "scheduler" in common:
        run_state.scheduler.load_state_dict(common["scheduler"])
    log(f"loaded model weights from {path} (step {meta.step}); it holds no optimizer state, "
        "so the optimizer starts fresh" + ("" if "scheduler" in common else " and the LR schedule at step 0"))
    return meta.step


def _load_scheduler(scheduler, saved: dict, branch: bool) -> None:
    """A resume takes the saved schedule (Megatron's use_checkpoint_opt_param_scheduler, as we
    build it). A branch keeps only the saved step count: its LR schedule is this config's
    (Megatron-LM's --override-opt-param-scheduler, for this one load; the values that must
    agree were checked by branch.check_branch)."""
    if not branch:
        scheduler.load_state_dict(saved)
        return
    flags = scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler
    scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler = True, False
    try:
        scheduler.load_state_dict(saved)
    finally:
        scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler = flags


def load(path: Path, run_state, config: ExperimentConfig, world_size: int, log, branch: bool = False) -> int:
    """Load model, optimizer, scheduler (and RNG if the layout is unchanged); returns the step.
    `branch`: a cooldown branch (checkpoint.branch_from): the LR schedule is the config's."""
    meta = check_compatible(path, config)
    warning = precision_change(path, meta, config)
    if warning:
        log(warning)
    if not meta.has_optimizer:
        return _load_model_only(path, run_state, meta, log)
    chunks = len(run_state.model)
    if fsdp_state.is_fsdp(run_state):
        with fsdp_state.gathered(run_state):
            loaded = dist_checkpointing.load(_sharded_state(run_state, is_loading=True), str(path))
            fsdp_state.load_model(run_state, [loaded[model_state_key(i, chunks)] for i in range(chunks)])
            fsdp_state.load_optimizer(run_state, loaded["optimizer"])
    else:
        loaded = dist_checkpointing.load(_sharded_state(run_state, is_loading=True), str(path))
        for i, chunk in enumerate(run_state.model):
            chunk.module.load_state_dict(loaded[model_state_key(i, chunks)])
        run_state.optimizer.load_state_dict(loaded["optimizer"])
    _load_scheduler(run_state.scheduler, loaded["scheduler"], branch)
    now = config.parallel.describe(world_size)
    rng = rng_file(path, dist.get_rank())
    how = "branched" if branch else "resumed"
    if meta.layout_name == now and rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=True))
        log(f"{how} from {path} at step {meta.step} (layout {now})")
    else:
        log(f"{how} from {path} at step {meta.step}: resharded from {meta.layout_name} to {now} "
            "(RNG states not restored: they are per rank)")
    if branch:
        sched = config.schedule
        log(f"cooldown branch: {sched.wsd_cooldown_steps} steps ({sched.lr_wsd_decay_style}) from step {meta.step} "
            f"to {sched.train_steps}, LR {config.optimizer.lr:g} -> {config.optimizer.min_lr:g}")
    return meta.step
