"""Cooldown branches: a WSD cooldown started from a stable-phase checkpoint of another run.

A warmup-stable-decay run holds the LR at its maximum until the cooldown, so its checkpoint at
step k (inside the stable phase) is also the state at step k of every shorter WSD run with the
same warmup and maximum: a cooldown of c steps from there, in a new run directory, gives the
run of k + c steps whose cooldown is the last c steps, bit for bit (same layout), and the
stable run stays untouched and resumable. One long stable run then serves every token budget.

    # the stable run: WSD to the largest budget, a checkpoint every 1000 steps
    python -m pretrain --recipe tiny-llama schedule.decay_style=wsd schedule.train_steps=10000 \\
        schedule.wsd_decay_steps=2000 checkpoint.dir=runs/stable/ckpt checkpoint.save_interval=1000 \\
        logging.run_dir=runs/stable
    # the 5000-step run: a 1000-step cooldown from the stable run's step 4000
    python -m pretrain --recipe tiny-llama schedule.decay_style=wsd schedule.train_steps=5000 \\
        schedule.wsd_decay_steps=1000 checkpoint.branch_from=runs/stable/ckpt/step_00004000 \\
        checkpoint.dir=runs/b5000/ckpt logging.run_dir=runs/b5000

The branch loads model, optimizer state, RNG and step from the checkpoint (the data stream
restarts at step x global batch, as on any resume); the LR schedule is this config's, not the
saved one (Megatron-LM's --override-opt-param-scheduler, for this load only). `check_branch`
refuses, before any process group, whatever would make the branch something else than the
cooldown of that run: a checkpoint already inside its run's cooldown or from a decaying
schedule, another warmup / LR / optimizer / batch / data, a cooldown that does not start at the
checkpoint's step, or the stable run's own directories.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import yaml
from pydantic import ValidationError

from pretrain.checkpointing.format import CONFIG, CheckpointError, CheckpointMeta
from pretrain.config import ExperimentConfig, ScheduleConfig

# What fixes the trajectory up to the branch point besides the model (check_compatible) and
# the schedule's shape (checked below): a branch whose values differ continues another run.
MUST_MATCH = (
    "optimizer.lr", "optimizer.min_lr", "optimizer.weight_decay", "optimizer.adam_beta1",
    "optimizer.adam_beta2", "optimizer.adam_eps", "optimizer.clip_grad", "schedule.warmup_steps",
    "schedule.global_batch_size", "schedule.seq_length", "runtime.seed", "data.blend", "data.demo",
    "data.mock", "data.split", "data.tokenizer", "optimizer.name", "optimizer.muon",
)
# The schedules whose LR is at its maximum after warmup: the only ones a cooldown can branch from.
STABLE_STYLES = ("wsd", "constant")


def _refuse(path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint.branch_from={path}: {why}")


def _dotted(tree: dict, key: str):
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def check_request(config: ExperimentConfig) -> None:
    """The branch's own settings, before any checkpoint is read."""
    ckpt, sched = config.checkpoint, config.schedule
    if str(ckpt.resume) != "auto":
        raise _refuse(ckpt.branch_from, f"checkpoint.resume={ckpt.resume} contradicts it (a branch starts from "
                      "branch_from, then resumes its own checkpoints): leave checkpoint.resume=auto")
    root = ckpt.dir
    # Checked first: resume=auto would otherwise take the stable run's checkpoints for the branch's own.
    if root is not None and Path(root).resolve() == Path(ckpt.branch_from).resolve().parent:
        raise _refuse(ckpt.branch_from, f"checkpoint.dir={root} is the stable run's own: the branch would resume "
                      "and save into it; give the branch a new checkpoint.dir")
    if sched.decay_style != "wsd":
        raise _refuse(ckpt.branch_from, f"a branch is a cooldown, but schedule.decay_style={sched.decay_style}; "
                      "set schedule.decay_style=wsd with schedule.wsd_decay_steps=<cooldown steps>")
    if sched.decay_steps is not None and sched.decay_steps != sched.train_steps:
        raise _refuse(ckpt.branch_from, f"schedule.decay_steps={sched.decay_steps} differs from schedule.train_steps="
                      f"{sched.train_steps}: the branch would end {'inside' if sched.decay_steps > sched.train_steps else 'after'} "
                      "its cooldown; unset schedule.decay_steps")


def _saved_config(path: Path) -> dict:
    try:
        saved = yaml.safe_load((path / CONFIG).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise _refuse(path, f"its {CONFIG} is unreadable ({exc}): the branch cannot check the run it continues") from None
    if not isinstance(saved, dict):
        raise _refuse(path, f"its {CONFIG} is not a config")
    return saved


def _saved_value(saved: dict, key: str):
    """The saved config's value; a key it lacks (a run from before the key existed, e.g.
    optimizer.name) holds that field's default, the behaviour before it."""
    section, _, name = key.partition(".")
    if isinstance(saved.get(section), dict) and name in saved[section]:
        return saved[section][name]
    model = ExperimentConfig.model_fields[section].annotation
    default = model.model_fields[name].get_default(call_default_factory=True)
    return json.loads(default.model_dump_json()) if hasattr(default, "model_dump_json") else default


def _check_same_trajectory(config: ExperimentConfig, saved: dict, path: Path) -> None:
    mine = json.loads(config.model_dump_json())
    diffs = [f"{key} {_saved_value(saved, key)!r} there vs {_dotted(mine, key)!r} here"
             for key in MUST_MATCH if _saved_value(saved, key) != _dotted(mine, key)]
    if diffs:
        raise _refuse(path, "the branch must continue the run that saved it with the same settings, but "
                      f"{'; '.join(diffs)}")


def _check_stable_at(saved: dict, step: int, path: Path, log: Callable[[str], None]) -> None:
    """The saved run's LR was at its maximum through `step` (past warmup, before any decay)."""
    try:
        sched = ScheduleConfig.model_validate(saved.get("schedule") or {})
    except ValidationError as exc:
        raise _refuse(path, f"its {CONFIG} has an unreadable schedule ({exc.errors()[0]['msg']})") from None
    if sched.decay_style not in STABLE_STYLES:
        raise _refuse(path, f"its run has schedule.decay_style={sched.decay_style}, whose LR decays from the warmup "
                      f"on: at step {step} it was already below the maximum; branch from a wsd or constant-LR run")
    if sched.decay_style == "wsd":
        start = (sched.decay_steps or sched.train_steps) - sched.wsd_cooldown_steps
        if step > start:
            raise _refuse(path, f"step {step} is inside its run's cooldown (steps {start + 1}-"
                          f"{sched.decay_steps or sched.train_steps}); branch from a checkpoint at or before step {start}")
    saved_lr, saved_min = _dotted(saved, "optimizer.lr"), _dotted(saved, "optimizer.min_lr")
    if sched.decay_style == "constant" and saved_min + 1.0 * (saved_lr - saved_min) != saved_lr:
        # Megatron's WSD computes the stable LR as min + 1.0 x (max - min), constant returns max.
        log(f"warning: checkpoint.branch_from={path}: its constant LR {saved_lr!r} and a wsd run's stable LR "
            f"{saved_min + (saved_lr - saved_min)!r} differ in the last bit: the branch continues that constant-LR "
            "run, not bit for bit the wsd run of the same length")


def _check_cooldown_starts_at(config: ExperimentConfig, step: int, path: Path) -> None:
    sched = config.schedule
    cooldown = sched.wsd_cooldown_steps
    start = sched.train_steps - cooldown
    if start != step:
        raise _refuse(path, f"the checkpoint is at step {step}, but schedule.train_steps={sched.train_steps} with a "
                      f"{cooldown}-step cooldown starts the cooldown after step {start}; for a cooldown of "
                      f"{cooldown} steps from step {step}: schedule.train_steps={step + cooldown} "
                      f"schedule.wsd_decay_steps={cooldown}")


def _check_new_dirs(config: ExperimentConfig, saved: dict, path: Path) -> None:
    """The branch's metrics go nowhere the stable run's do (for checkpoint.dir: check_request)."""
    theirs = _dotted(saved, "logging.run_dir")
    if theirs is not None and Path(theirs).resolve() == Path(config.logging.run_dir).resolve():
        raise _refuse(path, f"logging.run_dir={config.logging.run_dir} is the stable run's own: its metrics would "
                      "mix with the branch's; give the branch a new logging.run_dir")


def check_branch(config: ExperimentConfig, path: Path, log: Callable[[str], None]) -> CheckpointMeta:
    """Refuse (CheckpointError, one line) a branch from `path` that would not be the cooldown of
    the run that saved it; the checkpoint's metadata otherwise. No process group needed."""
    meta = CheckpointMeta.read(path)
    if not meta.has_optimizer:
        raise _refuse(path, "it holds no optimizer state (a model-only copy): a branch continues the optimizer "
                      "too; branch from a training checkpoint")
    saved = _saved_config(path)
    check_against(config, saved, meta.step, path, log)
    _check_new_dirs(config, saved, path)
    return meta


def check_against(config: ExperimentConfig, saved: dict, step: int, path, log: Callable[[str], None]) -> None:
    """Whether `config` is a cooldown branch at `step` of the run whose resolved config is
    `saved` (a config.yaml as a dict): CheckpointError naming `path` if not. Needs no
    checkpoint: launch.sweep plans its branches with it before anything runs."""
    check_request(config)
    _check_same_trajectory(config, saved, path)
    _check_stable_at(saved, step, path, log)
    _check_cooldown_starts_at(config, step, path)
