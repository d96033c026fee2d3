"""The stack's version: `[project] version` in pyproject.toml, the one place it is written
(CHANGELOG.md's newest section names the same; tests/pretrain/test_version.py keeps them equal).

    python -m pretrain --version
"""

from __future__ import annotations

import platform
import tomllib
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "mcore-stack"
_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def stack_version() -> str:
    # A checkout reads pyproject.toml itself: an editable install's metadata keeps the version
    # of its last `pip install -e`, stale after a bump. An installed wheel has no pyproject.toml
    # beside it; its metadata is pyproject's version, copied at build time.
    if _PYPROJECT.is_file():
        project = tomllib.loads(_PYPROJECT.read_text()).get("project", {})
        if project.get("name") == DISTRIBUTION:
            return project["version"]
    return metadata.version(DISTRIBUTION)


def describe() -> str:
    """The --version line: ours, then the versions that decide the numerics (for bug reports)."""
    parts = []
    for name in ("megatron-core", "torch", "transformer-engine"):
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            if name != "transformer-engine":  # optional: the gpu extra
                parts.append(f"{name} not installed")
    return f"{DISTRIBUTION} {stack_version()} ({', '.join(parts)}, Python {platform.python_version()})"
