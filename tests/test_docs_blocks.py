"""The README's "train -> reshard -> export -> verify -> vLLM" block runs as written: the fenced
block after `<!-- block: serving -->` is read from README.md and run by bash, command for
command, in a fresh folder (its relative `runs/...` paths land there), with one change: the
training of step 1 stops after 4 steps (`schedule.train_steps=4` appended) instead of the demo's
300. `python` is this environment's; `dev.sh` and `.venv-vllm` are linked into the folder, as a
user's checkout has them, so `bash dev.sh vllm-env` and `.venv-vllm/bin/python` resolve as
written.

    PYTHONPATH=$PWD python -m pytest tests/test_docs_blocks.py -q      # 4-8 min on 2 shared cores
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import REPO

MARKER = "<!-- block: serving -->"
SHORT_TRAINING = "schedule.train_steps=4"


def fenced_block(page: Path, marker: str) -> str:
    """The fenced code block right after `marker` (an HTML comment, invisible when rendered)."""
    lines = page.read_text().splitlines()
    assert lines.count(marker) == 1, f"{page}: expected one {marker!r}, found {lines.count(marker)}"
    start = lines.index(marker) + 1
    assert lines[start].startswith("```"), f"{page}:{start + 1}: {marker} must stand right before a fence"
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    return "\n".join(lines[start + 1:end]) + "\n"


def commands(block: str) -> list[str]:
    """The block's commands: comments dropped, backslash continuations joined; a quoted
    multi-line argument (step 6's `python -c "..."`) stays one command."""
    out, pending = [], ""
    for line in block.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line + "\n"
        if pending.rstrip().endswith("\\"):
            continue
        try:
            shlex.split(pending)
        except ValueError:  # an open quote: the command goes on
            continue
        out.append(pending.strip().replace("\\\n", " "))
        pending = ""
    assert not pending, f"unterminated command: {pending!r}"
    return out


def _demo_args() -> list[str]:
    """The `launch.local` arguments `bash dev.sh demo` runs (dev.sh's demo branch)."""
    text = (REPO / "dev.sh").read_text()
    match = re.search(r'-m launch\.local (.*?) "\$@"', text.replace("\\\n", " "), re.S)
    assert match, "dev.sh: no `-m launch.local ... \"$@\"` line in the demo branch"
    return shlex.split(match.group(1))


def test_serving_block_starts_where_the_demo_ends():
    found = commands(fenced_block(REPO / "README.md", MARKER))
    starts = [" ".join(shlex.split(c)[:3]) for c in found[:-1]]
    assert starts == ["python -m launch.local", "python -m checkpoints_tools.reshard", "python -m checkpoints_tools.export_hf",
                      "python -m checkpoints_tools.verify", "bash dev.sh vllm-env",
                      "python -m checkpoints_tools.verify_vllm"], found
    assert found[-1].startswith("VLLM_CPU_KVCACHE_SPACE=1") and ".venv-vllm/bin/python -c" in found[-1]
    # Step 1 is the demo: after `bash dev.sh demo` the block goes on from its checkpoint.
    assert shlex.split(found[0])[3:] == _demo_args()


@pytest.fixture(scope="module")
def served(module_tmp_factory) -> tuple[Path, subprocess.CompletedProcess]:
    # The vLLM environment the block's step 5 makes, made first in the checkout (a no-op when
    # there: the same command the vLLM tests run), so the folder's link points at it.
    proc = subprocess.run(["bash", str(REPO / "dev.sh"), "vllm-env"], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"bash dev.sh vllm-env failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    work = module_tmp_factory.mktemp("serving-block")
    for name in ("dev.sh", ".venv-vllm"):
        (work / name).symlink_to(REPO / name)
    block = fenced_block(REPO / "README.md", MARKER)
    step1 = commands(block)[0]
    assert block.count("checkpoint.on_newer=move_aside\n") == 1, "step 1 no longer ends as the test expects"
    script = block.replace("checkpoint.on_newer=move_aside\n", f"checkpoint.on_newer=move_aside {SHORT_TRAINING}\n")
    assert commands(script)[0] == f"{step1} {SHORT_TRAINING}"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore",
               PS4="+ [$SECONDS s] ")  # bash -x: each command with the seconds since the start
    run = subprocess.run(["bash", "-euxo", "pipefail", "-c", script], cwd=work, env=env,
                         capture_output=True, text=True, timeout=1500)
    return work, run


@pytest.mark.slow
def test_serving_block_runs_as_written(served):
    work, run = served
    assert run.returncode == 0, f"the block failed (exit {run.returncode}):\n{run.stdout[-4000:]}\n{run.stderr[-6000:]}"
    assert (work / "runs/tiny-llama/checkpoints/step_00000004/meta.json").is_file()
    assert (work / "runs/tiny-llama/hf/config.json").is_file()
    # step 4 compared the logits, step 5 vLLM's tokens with transformers', step 6 generated text
    out = run.stdout
    assert "greedy agreement" in out and "PASS" in out, out[-3000:]
    assert out.strip().splitlines()[-1].strip(), "step 6 printed no generated text"
