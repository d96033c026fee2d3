"""Check the commands written in the README and docs/ against the code: every `--flag` of a
`python -m MODULE` command appears in that module's `--help`, every `--recipe NAME` is a
recipe, and every `section.key=value` override names a key of the experiment config's schema.

    python -m tests.docs_check README.md docs/*.md     # exit 1 and one line per problem

Run by tests/test_docs.py. All modules' `--help` run in this one process (runpy), so the
shared imports (torch, Megatron-Core) are paid once.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import shlex
import sys
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel

FENCE = re.compile(r"^\s*```")
COMMAND = re.compile(r"python3? -m ([A-Za-z_][\w.]*\w)(.*)")
OVERRIDE = re.compile(r"^([a-z_]+)((?:\.[a-z_0-9]+)+)=")
FLAG = re.compile(r"^(--[a-z][a-z0-9-]*)")


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    module: str
    args: tuple[str, ...]


def _code_lines(path: Path):
    """(line number, text) of every line inside fenced code blocks, backslash continuations
    joined onto their first line."""
    inside, pending, start = False, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def commands(path: Path) -> list[Command]:
    found = []
    for number, line in _code_lines(path):
        line = line.split(" #", 1)[0]  # a trailing comment is prose
        for segment in re.split(r"&&|\|\||;|\|", line):
            match = COMMAND.search(segment)
            if not match:
                continue
            try:
                args = tuple(shlex.split(match.group(2)))
            except ValueError:
                args = tuple(match.group(2).split())
            found.append(Command(f"{path}:{number}", match.group(1), args))
    return found


@lru_cache(maxsize=None)
def help_text(module: str, subcommand: str = "") -> str:
    """The `--help` output of the module (or of its subcommand), run in this process; '' when
    it has none."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [module, *([subcommand] if subcommand else []), "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    except SystemExit:
        pass
    except Exception as exc:  # noqa: BLE001 - reported as a problem below
        return f"<error: {type(exc).__name__}: {exc}>"
    finally:
        sys.argv = argv
    return out.getvalue()


def _schema_has(section: str, rest: str) -> bool:
    from pretrain.config.schema import ExperimentConfig

    model: type[BaseModel] = ExperimentConfig
    for name in [section, *rest.strip(".").split(".")]:
        fields = model.model_fields if isinstance(model, type) and issubclass(model, BaseModel) else {}
        if name not in fields:
            return False
        model = fields[name].annotation
    return True


def _value_after(args: tuple[str, ...], flag: str):
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def problems(paths: list[Path]) -> list[str]:
    from pretrain.config.schema import ExperimentConfig

    from pretrain.recipes import RECIPES

    sections = set(ExperimentConfig.model_fields)
    out = []
    for path in paths:
        for command in commands(path):
            recipe = _value_after(command.args, "--recipe")
            if recipe is not None and recipe not in RECIPES and not recipe.isupper():  # NAME = a placeholder
                out.append(f"{command.where}: --recipe {recipe} is not a recipe ({', '.join(RECIPES)})")
            text = help_text(command.module)
            first = command.args[0] if command.args else ""
            if re.search(r"\{[\w,-]*\b" + re.escape(first) + r"\b[\w,-]*\}", text) and first.isidentifier():
                text = help_text(command.module, first)  # `python -m launch.scaling design ...`
            if text.startswith("<error") or not text.strip():
                out.append(f"{command.where}: python -m {command.module} --help failed: {text or 'no output'}")
                continue
            for arg in command.args:
                flag = FLAG.match(arg)
                if flag and re.search(re.escape(flag.group(1)) + r"\b", text) is None:
                    out.append(f"{command.where}: python -m {command.module} has no option {flag.group(1)}")
                key = OVERRIDE.match(arg)
                if key and key.group(1) in sections and not _schema_has(key.group(1), key.group(2)):
                    out.append(f"{command.where}: {key.group(1)}{key.group(2)} is not a config key")
    return out


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv]
    found = problems(paths)
    for line in found:
        print(line)
    checked = sum(len(commands(path)) for path in paths)
    print(f"{len(found)} problem(s) in {checked} commands of {len(paths)} files: {', '.join(argv)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
