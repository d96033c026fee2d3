"""The checkpoint format, defined once: read and written by training and by checkpoints_tools.

Under a `checkpoint.dir`:

    step_00000020/          a complete checkpoint
        __R_S.distcp ...    dist_checkpointing (torch_dist) shards, .metadata, metadata.json;
                            the non-sharded objects (the LR scheduler's numbers) are the
                            object `common_state` inside the shards (format 2, Megatron-Core
                            0.17+; format 1 kept them in a `common.pt` file, still read)
        rng/rank_<r>.pt     per-rank RNG states (training checkpoints only)
        meta.json           CheckpointMeta: step, consumed samples/tokens, layout, model,
                            precision (dtype, FP8 recipe), and every other file's size and
                            xxh3-64 checksum
        config.yaml         the resolved experiment config
        COMPLETE            written last (fsynced); a directory without it is not a checkpoint
    latest                  name of the newest checkpoint (replaced atomically, after COMPLETE)
    .tmp.step_00000030/     a save in progress (ignored; removed by the next save of that step)

`find_resumable(root)` is what `checkpoint.resume=auto` and the tools use: the checkpoint
`latest` names if it is complete, else (a stale or damaged pointer) the newest complete one,
with a warning.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, Optional

from pretrain.checkpointing.metadata import UnsafeCheckpoint, read_metadata_safely

# The format-version policy (docs/checkpoints.md, "Checkpoint format versions"): a change that alters what
# a checkpoint holds or how it is read raises FORMAT_VERSION and adds a fixture
# (tests/pretrain/fixtures/checkpoint_v<N>). This code resumes every version from
# OLDEST_READABLE on, bitwise; an older one is refused with the command that converts it,
# which CONVERSIONS must name for every version below OLDEST_READABLE.
FORMAT_VERSION = 2
OLDEST_READABLE = 1
CONVERSIONS: dict[int, str] = {}  # format version -> the command that converts it to a readable one
COMPLETE = "COMPLETE"
META = "meta.json"
CONFIG = "config.yaml"
LATEST = "latest"
RNG_DIR = "rng"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which and why."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of_name(name: str) -> Optional[int]:
    """The step a `step_NNNNNNNN` name stands for (None for any other name): read from the name,
    since a damaged checkpoint's meta.json may be unreadable."""
    digits = name[len("step_"):] if name.startswith("step_") else ""
    return int(digits) if digits.isdigit() else None


def tmp_dir_name(step: int) -> str:
    return f".tmp.{step_dir_name(step)}"


def rng_file(directory: Path, rank: int) -> Path:
    return Path(directory) / RNG_DIR / f"rank_{rank}.pt"


def model_state_key(index: int, num_chunks: int) -> str:
    """`model` for one chunk, `model0`, `model1`, ... for virtual pipeline chunks (the nested
    keys Megatron-LM uses: chunks share local key names, so flattening would drop some)."""
    return f"model{index}" if num_chunks > 1 else "model"


@dataclasses.dataclass
class CheckpointMeta:
    """meta.json. `model` and `layout` are ModelConfig / ParallelLayout dumps, so a reader
    needs no training code to know what the checkpoint holds."""

    step: int
    consumed_samples: int
    world_size: int
    layout: dict
    layout_name: str
    model: dict
    consumed_tokens: Optional[int] = None
    has_optimizer: bool = True  # False: model-only (serving copies, HF imports)
    format_version: int = FORMAT_VERSION
    converted_by: Optional[dict] = None  # checkpoints_tools provenance
    # {relative path: {"bytes": n, "xxh3_64": hex}} of every file but meta.json and COMPLETE
    # (pretrain.checkpointing.integrity); None in checkpoints written before it existed.
    files: Optional[dict] = None
    # The numerics the run trained with: models.runtime.RuntimeOptions.precision() (dtype, FP8
    # format, recipe and its settings). None in checkpoints written before it existed, and
    # in the tools' conversions. A resume with different settings warns.
    precision: Optional[dict] = None
    # Experiment tracker runs of the training ({"mlflow": run id, "wandb": run id}), so a
    # resume continues them. Absent in older checkpoints (read as None).
    tracker_runs: Optional[dict] = None
    # optimizer.name of the run that wrote the optimizer state ("adamw", "muon"). None in
    # checkpoints written before it existed, all of them AdamW (`optimizer_name`).
    optimizer: Optional[str] = None

    @property
    def optimizer_name(self) -> str:
        return self.optimizer or "adamw"

    @classmethod
    def read(cls, directory: Path) -> "CheckpointMeta":
        path = Path(directory) / META
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{directory} is not a checkpoint (no {META})") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path} is unreadable ({exc}); the checkpoint is damaged: "
                                  "use an earlier step") from None
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = {"step", "world_size", "layout", "layout_name", "model"} - set(data)
        if not isinstance(data, dict) or missing:
            raise CheckpointError(f"{path} lacks {', '.join(sorted(missing)) or 'a JSON object'}; "
                                  "the checkpoint is damaged: use an earlier step")
        version = data.get("format_version", FORMAT_VERSION)
        if version > FORMAT_VERSION:
            raise CheckpointError(f"{path} has format version {version}, newer than this "
                                  f"code reads ({FORMAT_VERSION}); update the code")
        if version < OLDEST_READABLE:
            raise CheckpointError(f"{path} has format version {version}; this code reads versions "
                                  f"{OLDEST_READABLE}-{FORMAT_VERSION}: convert it first with "
                                  f"{CONVERSIONS.get(version, '(no conversion known: use the code that wrote it)')}")
        data.setdefault("consumed_samples", 0)
        return cls(**{k: v for k, v in data.items() if k in fields})

    def write(self, directory: Path) -> None:
        fsync_write(Path(directory) / META, json.dumps(dataclasses.asdict(self), indent=1))


def check_metadata(directory: Path) -> None:
    """Read the torch_dist `.metadata` the safe way (pretrain.checkpointing.metadata):
    CheckpointError if it is missing, damaged, or refers to anything but checkpoint metadata
    (a file crafted to run code when unpickled)."""
    import pickle


    path = Path(directory) / ".metadata"
    try:
        read_metadata_safely(path)
    except FileNotFoundError:
        raise CheckpointError(f"{directory} has no .metadata: its shards are incomplete; use an earlier step") from None
    except UnsafeCheckpoint as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{path} is damaged ({type(exc).__name__}: {exc}); use an earlier step") from None


def fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def mark_complete(directory: Path) -> None:
    """Write the COMPLETE marker (fsynced); call after every other file of the checkpoint."""
    fsync_write(Path(directory) / COMPLETE, "complete\n")


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file() and (path / META).is_file()


def looks_like_checkpoint(path: Path) -> bool:
    return (path / META).is_file() or (path / COMPLETE).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def incomplete_checkpoints(root: Path) -> list[Path]:
    root = Path(root)
    return sorted(p for p in root.glob("step_*") if p.is_dir() and not is_complete(p)) if root.is_dir() else []


def read_latest(root: Path) -> Optional[str]:
    """The directory name `latest` holds, or None without a pointer."""
    try:
        return (Path(root) / LATEST).read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError):
        return None  # unreadable: treated as stale


def write_latest(root: Path, name: str) -> None:
    """Point `latest` at `name` atomically (the old pointer stays valid until the rename)."""
    tmp = Path(root) / (LATEST + ".tmp")
    fsync_write(tmp, name + "\n")
    os.replace(tmp, Path(root) / LATEST)


def damage(directory: Path) -> list[str]:
    """What is wrong with a complete-looking checkpoint, found cheaply (no shard is read):
    meta.json unreadable, .metadata unsafe or damaged, files missing or of the wrong size."""
    from pretrain.checkpointing.integrity import size_problems

    try:
        meta = CheckpointMeta.read(directory)
        check_metadata(directory)
    except CheckpointError as exc:
        return [str(exc)]
    return size_problems(directory, meta.files)


def usable_checkpoints(root: Path, warn: Callable[[str], None] = lambda m: None) -> list[Path]:
    """Complete, undamaged checkpoints in the order `resume=auto` tries them: the one `latest`
    names, then the others newest first. Says why it passes over any."""
    root = Path(root)
    for bad in incomplete_checkpoints(root):
        warn(f"warning: skipping incomplete checkpoint {bad} (no {COMPLETE} marker: crash mid-save)")
    complete = complete_checkpoints(root)
    order = complete[::-1]
    name = read_latest(root)
    if name is not None:
        pointed = root / name
        if pointed in complete:
            order = [pointed] + [p for p in order if p != pointed]
        else:
            fallback = f"the newest complete one, {complete[-1].name}" if complete else "nothing"
            warn(f"warning: {root / LATEST} names {name!r}, which is not a complete checkpoint; using {fallback}")
    usable = []
    for path in order:
        problems = damage(path)
        if problems:
            warn(f"warning: skipping damaged checkpoint {path}: {'; '.join(problems)}")
        else:
            usable.append(path)
    return usable


def find_resumable(root: Path, warn: Callable[[str], None] = lambda m: None) -> Optional[Path]:
    """The checkpoint `latest` names if it is complete and undamaged, else the newest such
    one (with a warning saying why), else None."""
    usable = usable_checkpoints(root, warn)
    return usable[0] if usable else None
