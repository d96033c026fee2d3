"""Which checkpoint a run resumes from, and what happens to the checkpoints around it.

Before any process group (`plan_resume`): the checkpoint `checkpoint.resume` names (or, for
`auto`, the candidates in order: `latest`'s, then newest first), each passed over with a
warning if it is incomplete or damaged in a way a stat finds (format.damage); an explicit
path that fails is an error. `auto` with no usable checkpoint where checkpoints were saved
(a damaged one, or a `latest` naming one that is gone) is an error too, never a fresh start:
a requeued job would retrain from step 0 and overwrite the evidence. Only a folder holding
nothing but interrupted saves (a crash during the first save) starts fresh: nothing is lost.
Checkpoints NEWER than the resume point would be overwritten or mixed with this run's saves:
`checkpoint.on_newer=refuse` (default) stops here, naming them; `move_aside` moves them into `<checkpoint.dir>/superseded-<time>/`.

With `checkpoint.branch_from` (a cooldown branch, pretrain.checkpointing.branch) and `auto`
finding nothing in checkpoint.dir, the branch point is the one candidate, checked there.

After the process group exists (`settle`): the checksums of the chosen checkpoint are
verified (`checkpoint.verify_checksums`, default on), its files spread over the ranks; a
damaged `auto` choice falls back to the next candidate with a warning and is moved aside
as `damaged.<name>` so no later run trips over it; when none is left, the run is refused as
above (nothing is moved). A fallback says which step it resumes from and how many are lost.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from pretrain.checkpointing.format import (
    CheckpointError,
    LATEST,
    CheckpointMeta,
    complete_checkpoints,
    damage,
    is_complete,
    looks_like_checkpoint,
    read_latest,
    step_dir_name,
    step_of_name,
    usable_checkpoints,
)
from pretrain.checkpointing.branch import check_branch, check_request
from pretrain.checkpointing.integrity import checksum_problems
from pretrain.config import ExperimentConfig


@dataclasses.dataclass
class ResumePlan:
    candidates: list[Path]  # in order of preference; empty: start fresh
    explicit: bool  # named by the user: never replaced by another
    newer: list[Path]  # complete checkpoints past the first candidate's step (or any, fresh)
    passed_over: list[Path]  # damaged ones `auto` skipped
    branch: bool = False  # the candidate is checkpoint.branch_from's: this config's LR schedule

    @property
    def first(self) -> Optional[Path]:
        return self.candidates[0] if self.candidates else None


def _explicit_path(config: ExperimentConfig, root: Optional[Path]) -> Path:
    spec = str(config.checkpoint.resume)
    path = Path(spec)
    if spec.isdigit():
        if root is None:
            raise CheckpointError(f"checkpoint.resume={spec} is a step number but checkpoint.dir is unset")
        path = root / step_dir_name(int(spec))
    return _usable(path)


def _usable(path: Path) -> Path:
    """A checkpoint named by the user: it exists, is complete and undamaged (as a stat finds)."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; use checkpoint.resume=auto or a valid path")
    if not looks_like_checkpoint(path):
        raise CheckpointError(f"{path} is not a checkpoint (no meta.json / COMPLETE marker)")
    if not is_complete(path):
        raise CheckpointError(f"checkpoint {path} is incomplete (the save crashed before COMPLETE); "
                              "resume from an earlier step or use checkpoint.resume=auto")
    problems = damage(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems)}; resume from an earlier "
                              "step (checkpoint.resume=auto picks the newest undamaged one)")
    return path


def _refuse_fresh_start(root: Path, damaged: dict[Path, str]) -> None:
    """`auto` found nothing usable: CheckpointError when `root` shows checkpoints were saved
    (a damaged one; or `latest`, written only after a checkpoint completed, naming one that is
    not there), so the run does not quietly restart from step 0; returns when there is none."""
    found = [f"{path.name} is damaged ({why})" for path, why in damaged.items()]
    name = read_latest(root)
    if name is not None and not is_complete(root / name):
        found.append(f"{LATEST} names {name!r}, which is {'incomplete' if (root / name).exists() else 'missing'}")
    if not found:
        return
    # resume=none alone would be refused too while complete (damaged) checkpoints remain: they
    # look newer than step 0 (on_newer).
    fresh = "checkpoint.resume=none" + (" checkpoint.on_newer=move_aside (moves them into superseded-<time>/)"
                                        if damaged else "")
    raise CheckpointError(
        f"checkpoint.resume=auto: no usable checkpoint in {root}: {'; '.join(found)}. Not starting from step 0, "
        f"which would silently retrain what they held; to start fresh on purpose: {fresh}, or another "
        "checkpoint.dir; to resume one explicitly: checkpoint.resume=PATH")


def _report_fallback(root: Path, chosen: Path, damaged: list[Path], log: Callable[[str], None]) -> None:
    """`auto` resumes from an older checkpoint than the newest saved: which step, and the steps lost."""
    names = [p.name for p in damaged] + [read_latest(root) or ""]
    newest = max((s for s in map(step_of_name, names) if s is not None), default=None)
    step = CheckpointMeta.read(chosen).step
    if newest is not None and newest > step:
        log(f"warning: resuming from step {step} ({chosen}), not from step {newest}: "
            f"{newest - step} steps are lost and will be trained again")


def plan_resume(config: ExperimentConfig, log: Callable[[str], None]) -> ResumePlan:
    """Before any process group: the candidates, and the newer checkpoints they would clash with."""
    spec = str(config.checkpoint.resume)
    root = Path(config.checkpoint.dir) if config.checkpoint.dir else None
    passed_over: list[Path] = []
    if config.checkpoint.branch_from is not None:
        check_request(config)  # a branch's own settings (resume=auto only), before any folder is read
    if spec == "none":
        candidates, explicit = [], False
    elif spec == "auto":
        warnings: list[str] = []  # shown unless the error below says it all in one line
        candidates = usable_checkpoints(root, warnings.append) if root is not None else []
        complete = complete_checkpoints(root) if root is not None else []
        passed_over = [p for p in complete if p not in candidates]
        explicit = False
        if root is not None and not candidates:
            _refuse_fresh_start(root, {p: "; ".join(damage(p)) for p in passed_over})
        for line in warnings:
            log(line)
        if config.checkpoint.branch_from is not None:
            candidates, explicit = _branch_candidates(config, candidates, log)
    else:
        candidates, explicit = [_explicit_path(config, root)], True
    start = CheckpointMeta.read(candidates[0]).step if candidates else 0
    newer = [p for p in (complete_checkpoints(root) if root is not None else [])
             if p not in passed_over and CheckpointMeta.read(p).step > start]
    if newer and config.checkpoint.on_newer == "refuse":
        where = f"from step {start} ({candidates[0]})" if candidates else "from scratch"
        raise CheckpointError(
            f"{root} holds checkpoints newer than this run starts {where}: "
            f"{', '.join(p.name for p in newer)}; this run would overwrite or interleave with them. "
            "Resume from the newest (checkpoint.resume=auto), use another checkpoint.dir, or set "
            "checkpoint.on_newer=move_aside to move them into a superseded-<time>/ folder")
    branch = config.checkpoint.branch_from is not None and explicit
    return ResumePlan(candidates=candidates, explicit=explicit, newer=newer, passed_over=passed_over, branch=branch)


def _branch_candidates(config: ExperimentConfig, own: list[Path], log) -> tuple[list[Path], bool]:
    """`checkpoint.branch_from` while checkpoint.dir has nothing to resume: the branch point,
    checked (explicit: never replaced by another); with checkpoints of its own the branch
    resumes those, so a requeued branch continues instead of starting over."""
    if own:
        log(f"resuming the branch from its own checkpoint {own[0]} (checkpoint.branch_from is used only "
            "while checkpoint.dir has none)")
        return own, False
    try:
        path = _usable(Path(config.checkpoint.branch_from))
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint.branch_from: {exc}") from None
    check_branch(config, path, log)
    return [path], True


def _checksum_problems_everywhere(path: Path) -> list[str]:
    """Every rank hashes its share of the files; all ranks get every problem found."""
    table = CheckpointMeta.read(path).files
    if not table:
        return []  # written before checksums existed: the size check is all there is
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = checksum_problems(path, table, sorted(table)[rank::world])
    found: list = [None] * world
    dist.all_gather_object(found, mine)
    return [p for problems in found for p in problems]


def _move_aside(paths: list[Path], destination: Callable[[Path], Path], log) -> None:
    """Rank 0 renames each path to destination(path); every rank waits for it."""
    if paths and dist.get_rank() == 0:
        for path in paths:
            target = destination(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            path.rename(target)
            log(f"moved {path} to {target}")
    dist.barrier()


def settle(plan: ResumePlan, config: ExperimentConfig, log: Callable[[str], None]) -> Optional[Path]:
    """After the process group exists: verify checksums, fall back past damaged candidates,
    move damaged and (with on_newer=move_aside) newer checkpoints aside; the checkpoint to load."""
    root = Path(config.checkpoint.dir) if config.checkpoint.dir else None
    damaged = list(plan.passed_over)
    reasons = {p: "; ".join(damage(p)) for p in damaged}
    chosen = None
    for path in plan.candidates:
        problems = _checksum_problems_everywhere(path) if config.checkpoint.verify_checksums else []
        reasons[path] = "; ".join(problems)
        if not problems:
            chosen = path
            break
        if plan.explicit:
            raise CheckpointError(f"checkpoint {path} is damaged: {'; '.join(problems)}; resume from an "
                                  "earlier step (checkpoint.resume=auto picks the newest undamaged one)")
        next_one = "; falling back to an earlier one" if path != plan.candidates[-1] else ""
        log(f"warning: checkpoint {path} is damaged ({'; '.join(problems)}){next_one}")
        damaged.append(path)
    if root is not None and plan.candidates and chosen is None:
        _refuse_fresh_start(root, {p: reasons[p] for p in damaged})  # every candidate failed its checksums
    if root is not None and chosen is not None and not plan.explicit:
        _report_fallback(root, chosen, damaged, log)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if root is not None:
        # Renamed out of the step_* namespace: no later run or tool takes them for checkpoints.
        _move_aside([p for p in damaged if p.parent == root], lambda p: root / f"damaged.{p.name}.{stamp}", log)
        _move_aside([p for p in plan.newer if p not in damaged], lambda p: root / f"superseded-{stamp}" / p.name, log)
    return chosen
