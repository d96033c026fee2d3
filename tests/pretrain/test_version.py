"""One version, written once: CHANGELOG.md's newest section, pyproject.toml's [project] version
and `python -m pretrain --version` agree."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from tests.distributed import REPO

SECTION = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?$", re.M)


def _changelog_sections() -> list[tuple[str, str | None]]:
    return [(m["version"], m["date"]) for m in SECTION.finditer((REPO / "CHANGELOG.md").read_text())]


def test_changelog_pyproject_and_cli_name_one_version():
    sections = [(v, d) for v, d in _changelog_sections() if v != "Unreleased"]
    assert sections, "CHANGELOG.md has no '## [X.Y.Z] - YYYY-MM-DD' section"
    newest = sections[0][0]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    printed = subprocess.run([sys.executable, "-m", "pretrain", "--version"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    assert printed[:2] == [project["name"], project["version"]], printed
    assert newest == project["version"], f"CHANGELOG.md's newest section is {newest}, pyproject.toml says " \
                                         f"{project['version']}: bump both together"


def test_changelog_sections_are_dated_and_newest_first():
    sections = [(v, d) for v, d in _changelog_sections() if v != "Unreleased"]
    assert all(d is not None for _, d in sections), sections
    keys = [tuple(int(x) for x in v.split(".")) for v, _ in sections]
    assert len(sections) >= 2 and keys == sorted(keys, reverse=True), sections
    assert [d for _, d in sections] == sorted((d for _, d in sections), reverse=True), sections
