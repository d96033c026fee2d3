"""The configuration reference (docs/configuration.md), generated from the schema itself so it
cannot drift: every key of `ExperimentConfig` with its type, default, constraints and the
comment written above (or beside) its field in the source.

    python -m pretrain.config.reference > docs/configuration.md   # regenerate
    python -m pretrain.config.reference --check docs/configuration.md   # exit 1 if stale

The descriptions are the schema's own comments (read with `ast` + `tokenize`), not pydantic
`description=` strings: the comments are where this codebase explains each key, and moving
them into strings would duplicate them.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import sys
import textwrap
import tokenize
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from pretrain.config.schema import ExperimentConfig

HEADER = """# Configuration reference

Generated from `pretrain/config/schema.py` and the sub-configs it uses by
`python -m pretrain.config.reference`; the suite fails when this page and the schema differ.
Every key is set in a recipe, a YAML file (`--config`) or on the command line as
`section.key=value` (e.g. `optimizer.lr=3e-4`, `parallel.tensor_parallel=2`).
Unknown keys and wrong types are refused (the config is strict).
"""


@lru_cache(maxsize=None)
def _comments(cls: type) -> dict[str, str]:
    """Field name -> its comment: the block of `#` lines right above its annotated assignment,
    then the comment at the end of its line."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    by_line = {}  # 1-based line -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    body = ast.parse(source).body[0].body
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, by_line.get(line, ""))
            line -= 1
        beside = [by_line[n] for n in range(node.lineno, node.end_lineno + 1) if n in by_line
                  and not lines[n - 1].strip().startswith("#")]
        out[node.target.id] = " ".join(part for part in above + beside if part)
    return out


def _comment_of(model: type[BaseModel], name: str) -> str:
    for cls in model.__mro__:  # the class that declares the field (RuntimeConfig inherits some)
        if cls is BaseModel or not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            continue
        if name in cls.__dict__.get("__annotations__", {}):
            return _comments(cls).get(name, "")
    return ""


def _type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Union or (origin is not None and getattr(origin, "__name__", "") == "UnionType"):
        names = [_type_name(a) for a in args if a is not type(None)]
        text = " | ".join(names)
        return f"{text} | None" if type(None) in args else text
    if origin is not None and getattr(origin, "__name__", "") == "Literal" or str(origin) == "typing.Literal":
        return " / ".join(f"`{a}`" for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join(_type_name(a) for a in args if a is not Ellipsis)
        return f"{origin.__name__}[{inner}]"
    if hasattr(annotation, "__metadata__"):  # Annotated (PositiveInt)
        return _type_name(get_args(annotation)[0])
    return getattr(annotation, "__name__", str(annotation))


def _constraints(field) -> str:
    symbols = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    parts = []
    for item in field.metadata:
        for attr, symbol in symbols.items():
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{symbol} {value}")
    return ", ".join(parts)


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default if field.default is not PydanticUndefined else field.default_factory()
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{value!r}`" if value is not None else "`None`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section(model: type[BaseModel], prefix: str, out: list[str], nested: list) -> None:
    doc = inspect.getdoc(model) if model.__doc__ and model.__doc__ is not BaseModel.__doc__ else ""
    out += [f"## `{prefix}`", ""]
    if doc:
        out += [doc, ""]
    out += ["| key | type | default | constraint | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested.append((annotation, f"{prefix}.{name}"))
            type_text = f"section `{prefix}.{name}`"
        else:
            type_text = _type_name(annotation)
        out.append(f"| `{prefix}.{name}` | {_cell(type_text)} | {_cell(_default(field))} | "
                   f"{_cell(_constraints(field))} | {_cell(_comment_of(model, name))} |")
    out.append("")


def render() -> str:
    out = [HEADER]
    top = [(name, f.annotation) for name, f in ExperimentConfig.model_fields.items()]
    out += ["| key | type | default | description |", "|---|---|---|---|"]
    for name, annotation in top:
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            field = ExperimentConfig.model_fields[name]
            out.append(f"| `{name}` | {_type_name(annotation)} | {_default(field)} | "
                       f"{_cell(_comment_of(ExperimentConfig, name))} |")
    out.append("")
    queue = [(a, n) for n, a in top if isinstance(a, type) and issubclass(a, BaseModel)]
    while queue:
        model, prefix = queue.pop(0)
        nested: list = []
        _section(model, prefix, out, nested)
        queue = nested + queue
    return "\n".join(out).rstrip() + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.config.reference",
                                     description="Print the configuration reference (Markdown) from the schema.")
    parser.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from what would be generated")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        path = Path(args.check)
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is stale or missing; regenerate it: python -m pretrain.config.reference > {path}",
                  file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
