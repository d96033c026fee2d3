"""What every checkpoints_tools command shares: errors, finding a checkpoint, staged output
directories (all or nothing), target layouts, training-checkpoint metadata, progress bars."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator, Optional

import torch
import yaml
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from data_pipeline.checks import positive_int, writable_dir_problem
from models.config import ModelConfig
from models.layout import LayoutError, ParallelLayout, validate_layout
from models.runtime import DTYPE_NAMES, DTYPES  # noqa: F401 (import_hf uses DTYPE_NAMES from here)
from pretrain.checkpointing.integrity import checksum_problems, collect_file_table
from pretrain.checkpointing.format import (
    COMPLETE,
    CONFIG,
    CheckpointError,
    CheckpointMeta,
    damage,
    find_resumable,
    is_complete,
    looks_like_checkpoint,
    mark_complete,
)
from pretrain.config import ExperimentConfig, dump_yaml



class ToolError(Exception):
    """Bad input to a checkpoints_tools command; the message says what and how to fix it."""


_VERIFIED: set[Path] = set()  # checkpoints whose checksums this process has checked


def resolve_checkpoint(path: Path, *, verify_checksums: bool = True) -> Path:
    """A complete, undamaged checkpoint step directory, given it or a `checkpoint.dir` (what
    `latest` names, else the newest undamaged one, as training's checkpoint.resume=auto picks).
    Its .metadata is unpickled the safe way and its file sizes are checked; its checksums too
    unless `verify_checksums` is off."""
    path = Path(path)
    if not path.exists():
        raise ToolError(f"checkpoint path {path} does not exist")
    if looks_like_checkpoint(path):
        if not is_complete(path):
            raise ToolError(f"checkpoint {path} is incomplete (no {COMPLETE} marker: its save crashed); "
                            "use an earlier step")
        problems = damage(path)
        if problems:
            raise ToolError(f"checkpoint {path} is damaged: {'; '.join(problems)}; use an earlier step")
        found = path
    else:
        found = find_resumable(path, warn=lambda message: print(message, file=sys.stderr))
    if found is None:
        raise ToolError(f"{path} is not a training checkpoint: expected a step_XXXXXXXX directory "
                        f"(with meta.json and {COMPLETE}) or a checkpoint.dir holding one")
    if verify_checksums and found.resolve() not in _VERIFIED:
        problems = checksum_problems(found, CheckpointMeta.read(found).files or {})
        if problems:
            raise ToolError(f"checkpoint {found} is damaged: {'; '.join(problems)}; use an earlier step "
                            "(--no-verify-checksums skips this check)")
        _VERIFIED.add(found.resolve())
    return found


def checkpoint_model(path: Path) -> tuple[CheckpointMeta, ModelConfig]:
    try:
        meta = CheckpointMeta.read(path)
    except CheckpointError as exc:
        raise ToolError(str(exc)) from None
    return meta, ModelConfig.model_validate(meta.model)


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name is None:
        return None
    if name not in DTYPES:
        raise ToolError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def target_layout(model: ModelConfig, *, tp: int = 1, pp: int = 1, vpp: Optional[int] = None, cp: int = 1,
                  ep: int = 1, etp: Optional[int] = None, sequence_parallel: bool = False,
                  world_size: Optional[int] = None) -> tuple[ParallelLayout, int]:
    """A layout (and world size) checked against the model; ToolError names what does not fit."""
    try:
        layout = ParallelLayout(tensor_parallel=tp, pipeline_parallel=pp, virtual_pipeline=vpp,
                                context_parallel=cp, expert_parallel=ep, expert_tensor_parallel=etp,
                                sequence_parallel=sequence_parallel and tp > 1)
    except ValueError as exc:
        raise ToolError(f"invalid layout: {exc}") from None
    return layout, check_layout(model, layout, world_size)


def check_layout(model: ModelConfig, layout: ParallelLayout, world_size: Optional[int] = None) -> int:
    """Validate a layout for the model; returns the world size (default: the smallest that
    tiles both the dense grid TPxCPxPP and the expert grid ETPxEPxPP)."""
    world = world_size if world_size is not None else layout.min_world_size()
    try:
        validate_layout(model, layout, world)
    except LayoutError as exc:
        raise ToolError(f"layout {layout.describe()} does not fit this model: {exc}") from None
    return world


def add_layout_arguments(parser) -> None:
    group = parser.add_argument_group("target layout (validated against the model)")
    group.add_argument("--tp", type=positive_int, default=1, help="tensor parallel size")
    group.add_argument("--pp", type=positive_int, default=1, help="pipeline parallel size")
    group.add_argument("--vpp", type=positive_int, default=None, help="virtual pipeline chunks per PP rank")
    group.add_argument("--cp", type=positive_int, default=1, help="context parallel size")
    group.add_argument("--ep", type=positive_int, default=1, help="expert parallel size (MoE)")
    group.add_argument("--etp", type=positive_int, default=None, help="expert tensor parallel size (default: TP)")
    group.add_argument("--sequence-parallel", action="store_true", help="record sequence parallelism (TP>1)")
    group.add_argument("--world-size", type=positive_int, default=None,
                       help="world size to record (default: one data-parallel replica)")


def add_output_arguments(parser, dtype_help: str) -> None:
    """--dtype, --overwrite and --no-progress, which every converting tool takes."""
    parser.add_argument("--dtype", choices=list(DTYPES), help=dtype_help)
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_input_arguments(parser) -> None:
    """--no-verify-checksums, which every tool reading a checkpoint takes."""
    parser.add_argument("--no-verify-checksums", action="store_true",
                        help="skip re-reading every file to check its checksum (sizes are still checked)")


def layout_from_args(model: ModelConfig, args) -> tuple[ParallelLayout, int]:
    return target_layout(model, tp=args.tp, pp=args.pp, vpp=args.vpp, cp=args.cp, ep=args.ep, etp=args.etp,
                         sequence_parallel=args.sequence_parallel, world_size=args.world_size)


# --- output directories: all or nothing ---------------------------------------------


def _holds_something(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


@contextlib.contextmanager
def staged_output(dst: Path, *, overwrite: bool, protect: tuple[Path, ...] = (), what: str = "output") -> Iterator[Path]:
    """Yield a temporary sibling of `dst` to write into; move it into place only on success.

    On any error the temporary directory is removed, so no partial output is left behind;
    an existing non-empty `dst` is refused unless `overwrite` (then replaced at the end).
    `protect`: inputs that `dst` must not be, contain, or sit inside.
    """
    dst = Path(dst).absolute()
    problem = writable_dir_problem(str(dst.parent))
    if problem:
        raise ToolError(f"cannot write the {what} directory {dst}: {problem}")
    for src in protect:
        src = Path(src).resolve()
        real = dst.resolve()
        if real == src or src.is_relative_to(real) or real.is_relative_to(src):
            raise ToolError(f"the {what} directory {dst} overlaps the input {src}; choose another path")
    if _holds_something(dst) and not overwrite:
        raise ToolError(f"{dst} already exists and is not empty; pass --overwrite to replace it "
                        "or choose another output path")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = dst.parent / f".{dst.name}.old-{os.getpid()}"
    if dst.exists():
        os.replace(dst, old)
    os.replace(tmp, dst)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()


# --- training-checkpoint metadata ----------------------------------------------------


def write_training_meta(out: Path, *, model: ModelConfig, layout: ParallelLayout, world_size: int,
                        step: int, consumed_samples: int, has_optimizer: bool, config: ExperimentConfig,
                        provenance: dict) -> None:
    """meta.json + config.yaml as training writes them, then COMPLETE (last)."""
    config = config.model_copy(update={"model": model, "parallel": layout})
    (out / CONFIG).write_text(dump_yaml(config))
    CheckpointMeta(
        step=step, consumed_samples=consumed_samples,
        consumed_tokens=consumed_samples * config.schedule.seq_length, world_size=world_size,
        layout=layout.model_dump(), layout_name=layout.describe(world_size), model=model.model_dump(),
        has_optimizer=has_optimizer, converted_by=provenance, files=collect_file_table(out),
        # Whose state it is (a resume with the other optimizer is refused); none without state.
        optimizer=config.optimizer.name if has_optimizer else None,
    ).write(out)
    mark_complete(out)


def read_experiment_config(path: Path, model: ModelConfig) -> ExperimentConfig:
    """The checkpoint's resolved config.yaml (a default one around the model if absent)."""
    file = Path(path) / CONFIG
    if not file.is_file():
        return ExperimentConfig(model=model)
    try:
        return ExperimentConfig.model_validate_json(json.dumps(yaml.safe_load(file.read_text())))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as exc:  # ValidationError is a ValueError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ToolError(f"{file} is not a readable experiment config ({first}); the checkpoint is damaged, or "
                        "was written by an incompatible version") from None


# --- progress ------------------------------------------------------------------------


def byte_progress(enabled: bool) -> Progress:
    """A progress bar over bytes written, on stderr (stdout stays machine-readable)."""
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        TimeRemainingColumn(), console=Console(stderr=True), disable=not enabled, transient=False,
    )


def run_cli(main_body) -> int:
    """Run a CLI body through data_pipeline.checks.run_cli: bad-input errors (ours and the
    format readers') print `error: ...` and exit 2; a full disk is one line, exit 1."""
    from checkpoints_tools.dcp_io import CheckpointFormatError
    from checkpoints_tools.hf_format import HFConfigError
    from checkpoints_tools.safetensors_io import HFFormatError

    from data_pipeline.checks import run_cli as run

    return run(main_body, bad_input=(ToolError, CheckpointFormatError, HFConfigError, HFFormatError))
