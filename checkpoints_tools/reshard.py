"""Reshard a training checkpoint to another parallel layout, offline, in one process.

    # TP2 x PP2 training checkpoint -> TP1 serving copy without optimizer state, in bf16:
    python -m checkpoints_tools.reshard runs/tiny/checkpoints runs/tiny/tp1 --tp 1 \
        --drop-optimizer --dtype bf16
    # TP2 x PP2 -> PP2 x VPP2 keeping the optimizer state, then resume there (2 ranks):
    python -m checkpoints_tools.reshard runs/tiny/checkpoints runs/tiny/pp2vpp2 --pp 2 --vpp 2
    python -m launch.local --recipe tiny-llama --nproc 2 parallel.pipeline_parallel=2 \
        parallel.virtual_pipeline=2 checkpoint.resume=runs/tiny/pp2vpp2 checkpoint.dir=runs/tiny/ckpt-vpp

Our torch_dist checkpoints hold global tensors, so any layout can load any checkpoint;
resharding rewrites the shards cut for the target layout (one chunk per layer and TP
rank, so each rank of the new layout reads only its bytes), optionally without the
optimizer state and cast to another dtype, and records the new layout in meta.json and
config.yaml. The target layout is validated against the model first (TP must divide the
heads, query groups, FFN and padded vocab; PP x VPP the layers; EP the experts). Tensors
are converted one layer at a time; the output appears only when complete (COMPLETE last).
A checkpoint without optimizer state resumes with a fresh optimizer.
"""

from __future__ import annotations

import argparse
import queue
import shutil
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import torch

from checkpoints_tools.common import (
    add_input_arguments,
    DTYPE_NAMES,
    add_layout_arguments,
    add_output_arguments,
    byte_progress,
    check_layout,
    checkpoint_model,
    layout_from_args,
    parse_dtype,
    read_experiment_config,
    resolve_checkpoint,
    run_cli,
    staged_output,
    write_training_meta,
)
from checkpoints_tools.dcp_io import CheckpointReader, layout_chunks, read_common, write_checkpoint
from checkpoints_tools.mapping import is_optimizer_key, stacked_axes
from models.layout import ParallelLayout


class LayerCache:
    """Serves chunks of stacked tensors from the last few (key, layer[, expert]) reads.

    The writer asks for chunks in plan order (all TP chunks of a layer together), so each
    source layer is read once whatever the source and target TP. Given that `order`, a
    background thread reads the next layer while the writer writes this one (reading and
    writing overlap: the writer spends its time in write() and fsync, without the GIL);
    `ahead` layers at most wait read. Memory: `capacity` + `ahead` layers of one key (or
    unstacked tensors such as the embedding). Thread-safe for several writer threads.
    """

    def __init__(self, load, capacity: int = 1, order: Optional[list] = None, ahead: int = 1):
        self.load = load  # (key, index) -> tensor[index]
        self.capacity = capacity
        self.entries: OrderedDict = OrderedDict()
        self.lock = threading.Lock()
        self._ready: Optional[queue.Queue] = None
        self._stash: dict = {}
        if order:
            self._position = {where: i for i, where in enumerate(order)}
            self._ready = queue.Queue(maxsize=ahead)
            self._stop = threading.Event()
            threading.Thread(target=self._prefetch, args=(order,), name="reshard-prefetch", daemon=True).start()

    def _prefetch(self, order: list) -> None:
        try:
            for where in order:
                tensor = self.load(*where)
                while not self._stop.is_set():
                    try:
                        self._ready.put((where, tensor), timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._ready.put(None)
        except BaseException as exc:  # re-raised in the writer's thread by _take
            self._ready.put(exc)

    def close(self) -> None:
        if self._ready is not None:
            self._stop.set()

    def _take(self, where):
        """The tensor for `where`: prefetched if it is next in order, else read now."""
        while self._ready is not None:
            if where in self._stash:
                return self._stash.pop(where)
            item = self._ready.get()
            if item is None:
                self._ready = None  # every prefetched layer was handed out
                break
            if isinstance(item, BaseException):
                raise item
            got, tensor = item
            if got == where:
                return tensor
            if self._position.get(got, -1) > self._position.get(where, -1):
                self._stash[got] = tensor  # asked out of order: keep it for later
                break
            # an earlier layer nobody asked for any more: drop it
        return self.load(*where)

    def chunk(self, key: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        lead = stacked_axes(key)
        where = (key, tuple(offsets[:lead]))
        with self.lock:
            if where in self.entries:
                self.entries.move_to_end(where)
            else:
                while len(self.entries) >= self.capacity:
                    self.entries.popitem(last=False)  # drop before reading: bounded memory
                self.entries[where] = self._take(where)
            view = self.entries[where]
        for dim, (start, length) in enumerate(zip(offsets[lead:], sizes[lead:])):
            view = view.narrow(dim, start, length)
        return view.reshape(sizes)


def read_order(tensors: dict) -> list:
    """(key, layer[, expert]) in the order the writer will ask for them, each once."""
    order = []
    for key, (_, _, chunks) in tensors.items():
        lead = stacked_axes(key)
        for offsets, _ in chunks:
            where = (key, tuple(offsets[:lead]))
            if not order or order[-1] != where:
                order.append(where)
    return order


def reshard(src: Path, dst: Path, *, layout: ParallelLayout, world_size: Optional[int] = None,
            drop_optimizer: bool = False, dtype: Optional[torch.dtype] = None, overwrite: bool = False,
            progress: bool = False, verify_checksums: bool = True) -> dict:
    """Write the checkpoint `src` (a step directory or a checkpoint.dir) to `dst` for `layout`.

    dtype casts the model weights only (optimizer state stays fp32). Returns a summary
    (output, layouts, bytes written, seconds).
    """
    start = time.perf_counter()
    src = resolve_checkpoint(src, verify_checksums=verify_checksums)
    meta, model = checkpoint_model(src)
    world = check_layout(model, layout, world_size)
    reader = CheckpointReader(src)
    has_optimizer = meta.has_optimizer and any(is_optimizer_key(k) for k in reader.tensor_keys())
    keep_optimizer = has_optimizer and not drop_optimizer
    tensors = {}
    for key in reader.tensor_keys():
        is_optimizer = is_optimizer_key(key)
        if is_optimizer and not keep_optimizer:
            continue
        shape = reader.shape(key)
        out_dtype = dtype if dtype is not None and not is_optimizer else reader.dtype(key)
        tensors[key] = (shape, out_dtype, layout_chunks(key, shape, layout, model.gated))
    objects = {key: reader.read_object(key) for key in reader.object_keys()
               if keep_optimizer or not is_optimizer_key(key)}
    common = read_common(src)
    if not keep_optimizer:
        common.pop("optimizer", None)
    total = sum(_nbytes(shape, dt) for shape, dt, _ in tensors.values())
    cache = LayerCache(reader.read, order=read_order(tensors))
    try:
        with staged_output(dst, overwrite=overwrite, protect=(src,), what="reshard output") as out, \
                byte_progress(progress) as bar:
            task = bar.add_task(f"reshard -> {layout.describe(world)}", total=total)

            def produce(key, offsets, sizes):
                chunk = cache.chunk(key, offsets, sizes)
                bar.advance(task, chunk.numel() * tensors[key][1].itemsize)
                return chunk

            write_checkpoint(out, tensors, produce, objects, common)
            if meta.layout_name == layout.describe(world) and (src / "rng").is_dir():
                shutil.copytree(src / "rng", out / "rng")  # same ranks: their RNG streams still apply
            write_training_meta(
                out, model=model, layout=layout, world_size=world, step=meta.step,
                consumed_samples=meta.consumed_samples, has_optimizer=keep_optimizer,
                config=read_experiment_config(src, model),
                # An imported model keeps what its export needs (HF architecture, BOS/EOS ids).
                provenance={**{k: v for k, v in (meta.converted_by or {}).items() if k.startswith("hf_")},
                            "tool": "checkpoints_tools.reshard", "source": str(src.resolve()),
                            "source_layout": meta.layout_name,
                            "dtype": DTYPE_NAMES.get(dtype) if dtype else "unchanged"},
            )
    finally:
        cache.close()  # stop reading ahead (an error, or Ctrl-C)
    return {"output": str(Path(dst)), "source_layout": meta.layout_name, "layout": layout.describe(world),
            "optimizer": keep_optimizer, "bytes": total, "seconds": time.perf_counter() - start}


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m checkpoints_tools.reshard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="checkpoint step directory, or a checkpoint.dir (newest)")
    parser.add_argument("dst", type=Path, help="output checkpoint directory (resume with checkpoint.resume=DST)")
    add_layout_arguments(parser)
    parser.add_argument("--drop-optimizer", action="store_true", help="write model weights only (serving copy)")
    add_output_arguments(parser, dtype_help="cast model weights (default: keep)")
    add_input_arguments(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        _, model = checkpoint_model(resolve_checkpoint(args.src, verify_checksums=not args.no_verify_checksums))
        layout, world = layout_from_args(model, args)
        summary = reshard(args.src, args.dst, layout=layout, world_size=world, drop_optimizer=args.drop_optimizer,
                          dtype=parse_dtype(args.dtype), overwrite=args.overwrite, progress=not args.no_progress,
                          verify_checksums=not args.no_verify_checksums)
        print(f"wrote {summary['output']}: {summary['source_layout']} -> {summary['layout']}, "
              f"{summary['bytes'] / 1e9:.3f} GB in {summary['seconds']:.1f} s"
              + ("" if summary["optimizer"] else " (model weights only)"))
        return 0

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
