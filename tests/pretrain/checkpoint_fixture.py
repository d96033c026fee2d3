"""Write a checkpoint fixture: a tiny model's step-2 checkpoint and the losses of steps 3-4
of the same run, uninterrupted (what a resume must reproduce bitwise).

    .venv/bin/python -m tests.pretrain.checkpoint_fixture tests/pretrain/fixtures/checkpoint_v1

Run once per checkpoint format version (pretrain/checkpointing/format.py FORMAT_VERSION), by
the change that introduces the version, into a new `checkpoint_v<N>` folder; never rewrite an
existing fixture (it stands for the checkpoints users already have). tests/pretrain/
test_checkpoint_compat.py resumes every fixture (README, "Checkpoint format versions").
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

RECIPE = "tiny-llama"
STEPS, SAVED = 4, 2
# ~7k parameters (fp32 + Adam: ~310 KB in all): hidden 8, 2 layers, the byte tokenizer's 259
# ids (mock data) padded to 384.
OVERRIDES = [
    "model.hidden_size=8", "model.num_layers=2", "model.ffn_hidden_size=16", "model.num_attention_heads=2",
    "model.num_query_groups=1", "model.vocab_size=259", "model.max_seq_length=32",
    "schedule.seq_length=16", "schedule.micro_batch_size=2", "schedule.global_batch_size=4",
    f"schedule.train_steps={STEPS}", "schedule.warmup_steps=1", "schedule.eval_interval=0",
    "optimizer.lr=1e-2", "data.demo=false", "data.mock=true", "runtime.spec=portable", "runtime.dtype=fp32",
    "logging.tensorboard=false", "logging.log_interval=1", f"checkpoint.save_interval={SAVED}",
]


def make(out: Path) -> dict:
    from pretrain.checkpointing.format import FORMAT_VERSION, step_dir_name
    from tests.distributed import run_ranks
    from tests.pretrain.workers import logged_losses

    out = Path(out)
    if out.exists():
        raise SystemExit(f"{out} exists; fixtures are never rewritten (add checkpoint_v<N+1> instead)")
    with tempfile.TemporaryDirectory() as tmp:
        overrides = OVERRIDES + [f"checkpoint.dir={tmp}/ckpt", f"logging.run_dir={tmp}/run"]
        losses = logged_losses(run_ranks(1, "tests.pretrain.workers:train", recipe=RECIPE, overrides=overrides))
        assert len(losses) == STEPS
        out.mkdir(parents=True)
        shutil.copytree(Path(tmp) / "ckpt" / step_dir_name(SAVED), out / step_dir_name(SAVED))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    spec = {
        "format_version": FORMAT_VERSION, "written_by_commit": commit, "recipe": RECIPE, "overrides": OVERRIDES,
        "checkpoint": step_dir_name(SAVED), "resumed_steps": list(range(SAVED + 1, STEPS + 1)),
        # float.__repr__ round-trips: the JSON holds the exact losses.
        "resumed_losses": losses[SAVED:],
    }
    (out / "continuation.json").write_text(json.dumps(spec, indent=1) + "\n")
    return spec


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(json.dumps(make(Path(sys.argv[1]))))
