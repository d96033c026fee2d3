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


# `bash dev.sh test` runs the suite in two lanes (pytest-xdist, `-n 2 --dist loadscope` with the
# scheduler below): these modules in one, everything else in the other. They spend most of
# their time waiting (Slurm scheduling, daemons, sleeps, one process at a time:
# tests.suite_profile's idle column), so the other lane's training uses the core they leave.
# The multi-node cluster tests are all in this lane, one at a time, as is everything that uses
# the shared Slurm cluster; the modules sharing a session fixture (tests/checkpoints_tools'
# trained models) stay in one lane.
WAITING_LANE = frozenset({
    "tests/launch/test_slurm_jobs.py", "tests/launch/test_multinode.py", "tests/launch/test_multinode_faults.py",
    "tests/launch/test_multinode_elastic.py", "tests/data_pipeline/test_slurm_preprocess.py",
    "tests/launch/test_sweep.py", "tests/launch/test_scaling_pipeline.py", "tests/pretrain/test_watchdog.py",
    "tests/pretrain/test_observe.py", "tests/pretrain/test_signals.py", "tests/launch/test_local.py",
    "tests/test_docs_blocks.py",
})


def pytest_configure(config):
    missing = sorted(path for path in WAITING_LANE if not (REPO / path).is_file())
    if missing:  # a renamed module would silently change lanes
        raise pytest.UsageError(f"tests/conftest.py's WAITING_LANE names missing modules: {', '.join(missing)}")


def pytest_xdist_make_scheduler(config, log):
    """xdist's loadscope with two scopes: the waiting lane and the rest (pytest 9.2's node ids
    no longer carry xdist_group's suffix, so `--dist loadgroup` cannot express this)."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "waiting" if nodeid.split("::")[0] in WAITING_LANE else "training"

    return LaneScheduling(config, log)


def pytest_collection_modifyitems(session, config, items):
    vllm = [item for item in items if item.path.name in VLLM_TESTS]
    if not vllm or config.option.collectonly:
        return
    items[:] = [item for item in items if item.path.name not in VLLM_TESTS] + vllm
    # Under xdist every worker collects every test: one of them starts the installer.
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":
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
