"""Layering over a recipe's config: a YAML file, then `key=value` strings, checked key by key
against the schema (unknown keys name the closest valid one) and then by pydantic (one line
per problem).

    config = apply_overrides(get_recipe("tiny-llama"), yaml_file="my.yaml",
                             overrides=["schedule.train_steps=50", "model=tiny-gpt"])
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ValidationError

from models.config import get_flavor
from models.suggest import did_you_mean
from pretrain.config.schema import ConfigError, ExperimentConfig


def _parse_value(key: str, text: str) -> Any:
    # YAML 1.1 reads "3e-4" as a string; numbers first, then YAML for lists/bools/null.
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}={text!r} is not valid YAML ({_yaml_problem(exc)}); quote the "
                          "value for the shell, e.g. data.blend='[[1.0, data/web]]'") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line from a YAML error: the problem and where it is."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def _set_path(tree: dict, path: str, value: Any, schema: type[BaseModel]) -> None:
    """Set tree[a][b]... = value, checking every key of the path against the schema."""
    parts = path.split(".")
    node, model = tree, schema
    for i, part in enumerate(parts):
        fields = list(model.model_fields)
        if part not in fields:
            where = ".".join(parts[:i]) or "top level"
            raise ConfigError(f"unknown config key {path!r} ({part!r} at {where}){did_you_mean(part, fields, cutoff=0.5, fallback='keys')}")
        if i == len(parts) - 1:
            node[part] = value
            return
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            raise ConfigError(f"config key {'.'.join(parts[:i + 1])!r} is a value, not a section")
        node = node.setdefault(part, {})
        model = annotation


def _flatten(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    items = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            items.extend(_flatten(value, path + "."))
        else:
            items.append((path, value))
    return items


def _read_yaml_file(yaml_file: str) -> dict:
    path = Path(yaml_file)
    if not path.is_file():
        raise ConfigError(f"config file {yaml_file!r} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {yaml_file!r} is not valid YAML: {_yaml_problem(exc)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {yaml_file!r} cannot be read: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {yaml_file!r} must hold a mapping of sections")
    return loaded


def _model_flavor(value: Any) -> dict:
    """`model=<flavor>`: the whole model section from a named flavor (models.config.FLAVORS)."""
    if not isinstance(value, str):
        raise ConfigError(f"model={value!r}: give a flavor name (e.g. model=tiny-gpt) or set single fields "
                          "(model.num_layers=2)")
    try:
        return get_flavor(value).model_dump(mode="python")
    except ValueError as exc:
        raise ConfigError(f"model={value}: {exc}") from None


def apply_overrides(
    config: ExperimentConfig, *, yaml_file: Optional[str] = None, overrides: list[str] = ()
) -> ExperimentConfig:
    """Layer a YAML file, then `key=value` strings, over a recipe's config.

    `model=<flavor>` (in either) replaces the whole model section with a named flavor;
    `model.<field>=...` after it changes single fields of that flavor.
    """
    tree = config.model_dump(mode="python")
    pairs: list[tuple[str, Any]] = []
    if yaml_file:
        pairs.extend(_flatten(_read_yaml_file(yaml_file)))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. schedule.train_steps=50)")
        key, text = item.split("=", 1)
        pairs.append((key.strip(), _parse_value(key.strip(), text)))
    for key, value in pairs:
        if key == "model" and not isinstance(value, dict):
            tree["model"] = _model_flavor(value)
        else:
            _set_path(tree, key, value, ExperimentConfig)
    try:
        # JSON validation: strict types, yet lists are accepted for tuples (blend entries).
        return ExperimentConfig.model_validate_json(json.dumps(tree))
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc)) from None


def _format_validation(exc: ValidationError) -> str:
    """One line, every problem in it, the first one first: `invalid config: KEY: what (got
    VALUE); ...`. A check of a whole section (its input is the section) shows no input: it
    names its own keys, and the section printed in full was ~1,000 characters."""
    problems = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        if not loc or (err["type"] == "value_error" and loc in message):  # our checks name their keys
            problems.append(message)
        elif isinstance(value, dict):
            problems.append(f"{loc}: {message}")
        else:
            shown = repr(value)
            problems.append(f"{loc}: {message} (got {shown if len(shown) <= 80 else shown[:77] + '...'})")
    return "invalid config: " + "; ".join(problems)
