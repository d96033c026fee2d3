"""The docs stay true to the code: the configuration reference is the schema's, the site
builds with no broken link or anchor, and the commands written in the README and docs/ use
options and config keys that exist (tests/docs_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pretrain.config import reference
from tests.docs_check import problems

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_reference_is_generated_from_the_schema():
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == reference.render(), (
        "docs/configuration.md is stale: python -m pretrain.config.reference > docs/configuration.md")


def test_reference_check_flags_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(reference.render().replace("optimizer.lr", "optimizer.learning_rate"))
    assert reference.main(["--check", str(stale)]) == 1
    assert "regenerate it: python -m pretrain.config.reference" in capsys.readouterr().err
    stale.write_text(reference.render())
    assert reference.main(["--check", str(stale)]) == 0


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    # NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2 is not a build problem.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, env=env, timeout=300)


def test_site_builds_strict(tmp_path):
    proc = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def test_site_build_fails_on_a_broken_link(tmp_path):
    """The strict build is what catches a broken link: shown on a copy of the site."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\nSee [the missing page](missing.md#nowhere).\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text((ROOT / "mkdocs.yml").read_text().split("\nnav:")[0] + "\n")
    proc = _mkdocs_build(config, tmp_path / "site")
    assert proc.returncode != 0 and "missing.md" in proc.stdout + proc.stderr


def test_commands_in_readme_and_docs_use_real_options_and_keys():
    # In a process of its own: it runs every module's --help, whose imports and globals
    # (warning filters, loggers) should not leak into the suite's process.
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    proc = subprocess.run([sys.executable, "-m", "tests.docs_check", *map(str, pages)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "0 problem(s)" in proc.stdout


def test_docs_check_finds_a_bad_flag_and_a_bad_key(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\npython -m pretrain --recipe tiny-llama --no-such-flag \\\n"
                    "    schedule.train_stepz=3 optimizer.lr=1e-3\n"
                    "python -m launch.plan --recipe llama-9b --gpus 8  # a comment --not-a-flag\n"
                    "python -m launch.scaling fit r.csv --approach 3 --bogus\n```\n")
    found = problems([page])
    assert found[:2] == [f"{page}:2: python -m pretrain has no option --no-such-flag",
                         f"{page}:2: schedule.train_stepz is not a config key"]
    assert len(found) == 4 and found[2].startswith(f"{page}:4: --recipe llama-9b is not a recipe (tiny-llama, ")
    # a subcommand's options are read from its own --help (--approach is fit's, not the module's)
    assert found[3] == f"{page}:5: python -m launch.scaling has no option --bogus"
