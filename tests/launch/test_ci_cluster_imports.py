"""The test clusters' modules import one way: ci_cluster (the CLI) -> ci_multinode -> ci_daemons,
with no circle (function-level imports included), and the CLI starts without a cluster."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.distributed import REPO

LAUNCHERS = REPO / "launch" / "launchers"


def _imported_modules(name: str) -> set[str]:
    """Every launch.launchers module `name` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse((LAUNCHERS / f"{name}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == "launch.launchers":  # `from launch.launchers import ci_multinode`
                found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m.removeprefix("launch.launchers.") for m in found if m.startswith("launch.launchers.")}


def test_no_import_circle_between_the_cluster_modules():
    assert _imported_modules("ci_daemons") == set()
    assert _imported_modules("ci_multinode") == {"ci_daemons"}
    assert "ci_multinode" in _imported_modules("ci_cluster")


def test_each_module_imports_alone_and_the_cli_answers_help():
    for name in ("ci_daemons", "ci_multinode", "ci_cluster"):  # each first in a fresh interpreter
        subprocess.run([sys.executable, "-c", f"import launch.launchers.{name}"], cwd=REPO, check=True)
    out = subprocess.run([sys.executable, "-m", "launch.launchers.ci_cluster", "--help"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert "restart-slurmd" in out and "--nodes" in out
