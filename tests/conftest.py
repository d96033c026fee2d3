"""Options and ordering of the whole suite (pytest reads hooks from this root conftest)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# vLLM's environment (`bash dev.sh vllm-env`, ~3.5 GB of wheels) takes ~150 s to create on a
# fresh machine, nearly all of it waiting on downloads and disk. Its tests run last and the
# environment is created in the background from the start, so that wait overlaps the suite.
# test_docs_blocks.py runs the README's serving block, whose last steps use it too.
VLLM_TESTS = ("test_verify_vllm.py", "test_docs_blocks.py")
_background: dict[str, object] = {}


def pytest_addoption(parser):
    group = parser.getgroup("config fuzzer (tests/pretrain/test_config_fuzz.py)")
    group.addoption("--fuzz-cases", type=int, default=0,
                    help="long mode: this many random configs (default: the quick seeded subset)")
    group.addoption("--fuzz-seed", type=int, default=2026, help="the fuzzer's seed")


def pytest_collection_modifyitems(session, config, items):
    vllm = [item for item in items if item.path.name in VLLM_TESTS]
    if not vllm or config.option.collectonly:
        return
    items[:] = [item for item in items if item.path.name not in VLLM_TESTS] + vllm
    _start_vllm_env()


def _start_vllm_env() -> None:
    """dev.sh's lock makes the fixture's own `bash dev.sh vllm-env` wait for this one (or return
    at once when the environment exists); a failure here is reported by that call."""
    log = tempfile.NamedTemporaryFile(prefix="vllm-env-", suffix=".log", delete=False)
    # nice: the install yields the cores to the tests it overlaps.
    _background["proc"] = subprocess.Popen(["nice", "-n", "10", "bash", str(REPO / "dev.sh"), "vllm-env"],
                                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           cwd=REPO, start_new_session=True)
    _background["log"] = log.name


def pytest_sessionfinish(session, exitstatus):
    """A run that stops before the vLLM tests (-x, Ctrl-C) leaves no installer behind; dev.sh
    writes its marker only after `import vllm` worked, so the next run finishes the job."""
    proc = _background.pop("proc", None)
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()


@pytest.fixture(scope="module")
def module_tmp_factory(tmp_path_factory, request):
    """`tmp_path_factory` for a module's fixtures, whose folders go when the module's tests are
    done, unless one of them failed (then they stay for the post-mortem, like a failed test's
    `tmp_path`). The suite writes ~100 MB per training test (checkpoints, Megatron's index
    cache of its 100k-document mock corpus); kept to the end of the session, the folders of
    860 tests filled a CI machine's disk."""
    made: list[Path] = []
    failed_before = request.session.testsfailed

    class _Factory:
        def mktemp(self, basename: str) -> Path:
            path = tmp_path_factory.mktemp(basename)
            made.append(path)
            return path

    yield _Factory()
    if request.session.testsfailed == failed_before:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
