"""Checkpoint save/load benchmark: time, bytes written, and the training stall of async save.

    # tiny-llama, one rank, 3 repeats:
    torchrun --nproc-per-node 1 -m pretrain.checkpointing.benchmark --recipe tiny-llama --repeats 3
    # 98.6M parameters (1.58 GB with fp32 + Adam; issue 27's numbers), 6 interleaved repeats:
    torchrun --nproc-per-node 1 -m pretrain.checkpointing.benchmark --recipe tiny-llama --repeats 6 --no-load \
        model.hidden_size=1024 model.num_layers=8 model.ffn_hidden_size=2816
    # a ~1B-parameter Llama shape (hidden 2048, 18 layers, 32k vocab), fp32 + Adam state
    # (15 GB: staging an async save, or Megatron's load, would need as much again, so on a
    # 24 GB machine, sync saves only):
    torchrun --nproc-per-node 1 -m pretrain.checkpointing.benchmark --recipe tiny-llama --repeats 3 --no-async --no-load \
        model.num_layers=18 model.hidden_size=2048 model.ffn_hidden_size=5632 \
        model.num_attention_heads=16 model.num_query_groups=4 model.vocab_size=32000

Builds the model and optimizer (no training; one optimizer step so Adam state exists),
then per repeat: a synchronous save; the same state through dist_checkpointing alone, with and
without the shards hashed as they are written (the cost of checkpoint checksums on save); the
checksum verification a resume does by default; an async save; and a load. Async: the stall is the
time until `save()` returns and training goes on (the first repeat's, which also allocates
the staging memory, is reported apart); training steps then run until the checkpoint is
COMPLETE (total), and their time beyond a step without a save in flight is reported
(the background writer shares the CPU and disk). Prints medians and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _timed_steps(step_fn, count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        step_fn()
    return (time.perf_counter() - start) / count


def _async_save(run, step: int, async_saver, step_fn) -> dict:
    """One async save while training goes on. One checkpointer serves every repeat, as in
    training: its writer process and staging memory are made once (the first repeat's stall
    includes allocating the staging memory)."""
    out = {}
    baseline = _timed_steps(step_fn, 2)  # a training step without a save in flight
    start = time.perf_counter()
    async_saver.save_now(step, run.state)
    out["async_stall_s"] = time.perf_counter() - start
    if not async_saver.pending():
        raise SystemExit("the async save ran synchronously (no room to stage it: see the log); "
                         "rerun with --no-async or on a machine with more memory")
    # Training goes on while the writer works, as in the loop (which polls once per step);
    # the writer's CPU and disk use slow these steps down on a CPU-only machine.
    during = []
    while async_saver.pending():
        step_start = time.perf_counter()
        step_fn()
        during.append(time.perf_counter() - step_start)
        async_saver.poll()
    out["async_total_s"] = time.perf_counter() - start
    out["step_s"] = baseline
    out["steps_during_write"] = len(during)
    out["extra_step_s_during_write"] = sum(during) - len(during) * baseline
    return out


def _saver(run, root: Path, async_save: bool):
    """A checkpointer into `root` keeping one checkpoint (repeats save steps 1, 2, ...)."""
    from pretrain.checkpointing.checkpointer import Checkpointer

    ckpt = run.config.checkpoint.model_copy(update={"dir": str(root), "async_save": async_save, "keep_last": 1})
    return Checkpointer(run.config.model_copy(update={"checkpoint": ckpt}), run.world_size, lambda m: None)


def _hashing_cost(run, scratch: Path, hashed_first: bool) -> dict:
    """dist_checkpointing's own save of the same state, with and without the shards hashed as
    they are written (pretrain.checkpointing.integrity): the cost of the checksums on save.
    The two saves alternate their order from repeat to repeat, each after os.sync(): the second
    of two back-to-back saves was the slower whichever it was, to disk and to tmpfs alike (and
    the disk's speed drifts: 1.58 GB with fsync at 0.3 to 1.2 GB/s within a minute here).
    `hash_compute_s` is the hashing alone: xxh3 over the bytes of every tensor this rank
    writes, in memory (what the hashed writer adds, less torch.save's few headers)."""
    from megatron.core import dist_checkpointing

    from pretrain.checkpointing.async_writer import without_clones
    from pretrain.checkpointing.checkpointer import _sharded_state
    from pretrain.megatron_fixes.dist_checkpointing import unhashed_writes

    out = {}
    runs = [("dcp_save_unhashed_s", unhashed_writes), ("dcp_save_hashed_s", contextlib.nullcontext)]
    for name, hooks in reversed(runs) if hashed_first else runs:
        target = scratch / name
        if dist.get_rank() == 0:
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
        dist.barrier()
        state = _sharded_state(run.state, is_loading=False)
        _settle()
        start = time.perf_counter()
        with hooks(), without_clones():
            dist_checkpointing.save(state, str(target))
        dist.barrier()
        out[name] = time.perf_counter() - start
    out["hash_compute_s"] = _hash_in_memory(_sharded_state(run.state, is_loading=False))
    if dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def _settle() -> None:
    """Start a timed save with no write-back of earlier saves pending (on every rank)."""
    os.sync()
    dist.barrier()


def _hash_in_memory(sharded_state: dict) -> float:
    import xxhash
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import is_main_replica
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    tensors = [sh.data for sh in nested_values(extract_sharded_base(sharded_state)[0])
               if sh.data is not None and is_main_replica(sh.replica_id)]
    start = time.perf_counter()
    for tensor in tensors:
        digest = xxhash.xxh3_64()
        digest.update(memoryview(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()))
    return time.perf_counter() - start


def _one_repeat(run, step: int, sync_saver, async_saver, step_fn, load: bool) -> dict:
    from pretrain.checkpointing.checkpointer import load as load_checkpoint
    from pretrain.checkpointing.format import step_dir_name

    from pretrain.checkpointing.format import CheckpointMeta
    from pretrain.checkpointing.integrity import checksum_problems

    out = {}
    _settle()
    start = time.perf_counter()
    sync_saver.save_now(step, run.state)
    out["sync_save_s"] = time.perf_counter() - start
    saved = sync_saver.root / step_dir_name(step)
    out["bytes"] = _dir_bytes(saved)
    out.update(_hashing_cost(run, sync_saver.root / "scratch", hashed_first=step % 2 == 0))
    # What resume adds by default: re-read and hash every file (one rank here).
    start, cpu = time.perf_counter(), time.process_time()
    assert not checksum_problems(saved, CheckpointMeta.read(saved).files)
    out["verify_checksums_s"], out["verify_checksums_cpu_s"] = time.perf_counter() - start, time.process_time() - cpu

    if async_saver is not None:
        out.update(_async_save(run, step, async_saver, step_fn))

    if load:
        start = time.perf_counter()
        load_checkpoint(saved, run.state, sync_saver.config, run.world_size, lambda m: None)
        out["load_s"] = time.perf_counter() - start
    dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.checkpointing.benchmark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny-llama")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    parser.add_argument("--no-async", action="store_true",
                        help="sync save and load only (async staging needs the state's size again in "
                             "free memory: a ~1B model's 15 GB does not fit twice in 24 GB)")
    parser.add_argument("--no-load", action="store_true",
                        help="saves only (Megatron's fully_reshardable load allocates the whole "
                             "optimizer state once more: a ~1B model needs ~30 GB to load)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    from models.flops import total_params
    from pretrain.cli import resolve_config
    from pretrain.data import chunk_iterators
    from pretrain.runtime import shutdown
    from pretrain.step import train_step
    from pretrain.loop import setup
    from pretrain.megatron_fixes.optimizer_save import distributed_optimizers

    base = ["data.demo=false", "data.mock=true", "schedule.train_steps=1000", "schedule.seq_length=64",
            "schedule.micro_batch_size=1", "schedule.global_batch_size=1", "schedule.eval_interval=0",
            "logging.tensorboard=false", "checkpoint.resume=none"]
    config = resolve_config(args.recipe, None, base + list(args.overrides))
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-", dir=args.dir) as tmp:
        config = config.model_copy(update={"logging": config.logging.model_copy(update={"run_dir": f"{tmp}/run"})})
        run = setup(config)
        iters = chunk_iterators(run.datasets.train, config, 0, len(run.datasets.train))
        step_fn = lambda: train_step(run.state, iters, config, run.num_microbatches, 1)
        for opt in distributed_optimizers(run.state.optimizer):
            for group in opt.optimizer.param_groups:
                # torch's multi-tensor Adam makes whole-model temporaries (+4 GB at 1B
                # parameters); one tensor at a time keeps the benchmark within 24 GB.
                group["foreach"] = False
        step_fn()  # Adam state exists
        sync_saver = _saver(run, Path(tmp) / "sync", async_save=False)
        async_saver = None if args.no_async else _saver(run, Path(tmp) / "async", async_save=True)
        results = [_one_repeat(run, i + 1, sync_saver, async_saver, step_fn, not args.no_load)
                   for i in range(args.repeats)]
        for saver in (sync_saver, async_saver):
            if saver is not None:
                saver.close()
        if dist.get_rank() == 0:
            _report(args, config, results, total_params(config.model))
        shutdown()
    return 0


def _report(args, config, results: list[dict], params: int) -> None:
    from rich.console import Console
    from rich.table import Table

    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    if "async_stall_s" in med:
        med["first_async_stall_s"] = results[0]["async_stall_s"]
        if len(results) > 1:  # later saves reuse the staging memory: the steady state
            med["async_stall_s"] = statistics.median(r["async_stall_s"] for r in results[1:])
        med["async_stall_vs_sync"] = med["async_stall_s"] / med["sync_save_s"]
    med["save_gb_per_s"] = med["bytes"] / med["sync_save_s"] / 1e9
    # Per repeat (each pair ran back to back), then the median: robust to a drifting disk.
    med["hashing_on_save_frac"] = statistics.median(r["dcp_save_hashed_s"] / r["dcp_save_unhashed_s"] - 1
                                                    for r in results)
    med["hash_compute_frac"] = med["hash_compute_s"] / med["dcp_save_unhashed_s"]
    med["verify_checksums_gb_per_s"] = med["bytes"] / med["verify_checksums_s"] / 1e9
    table = Table(title=f"checkpoint benchmark: {params / 1e6:.1f}M parameters, median of {len(results)}")
    table.add_column("metric")
    table.add_column("median", justify="right")
    for key, value in med.items():
        table.add_row(key, f"{value:.4g}")
    Console().print(table)
    print(json.dumps({"params": params, "recipe": args.recipe, "overrides": args.overrides, **med,
                      "per_repeat": results}))


if __name__ == "__main__":
    sys.exit(main())
