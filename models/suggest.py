"""`did_you_mean`: the one "did you mean ...?" hint of every error that names an unknown key,
flavor, recipe, device or sweep field (models/ is the lowest folder every other one may import).

    raise ValueError(f"unknown key {key!r}{did_you_mean(key, valid, fallback='keys')}")
"""

from __future__ import annotations

import difflib
from typing import Iterable, Optional


def did_you_mean(word: str, choices: Iterable[str], *, sentence: bool = False, cutoff: float = 0.6,
                 fallback: Optional[str] = None) -> str:
    """The hint to append to an error about `word`: "; did you mean 'x'?" for the closest of
    `choices` (" Did you mean 'x'?" with `sentence`, after a full stop), else "; valid
    <fallback>: a, b, c" when `fallback` names the choices, else ""."""
    choices = list(choices)
    match = difflib.get_close_matches(word, choices, n=1, cutoff=cutoff)
    if match:
        return f" Did you mean {match[0]!r}?" if sentence else f"; did you mean {match[0]!r}?"
    return f"; valid {fallback}: {', '.join(choices)}" if fallback else ""
