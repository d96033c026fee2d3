"""Guards: each fix states the exact upstream source it was written against.

A fix that replaces or wraps a Megatron-Core (or torch) function relies on what that function
does. `expect_source(fix, obj, digest)` hashes `inspect.getsource(obj)` and raises
`UpstreamChanged` when it differs from the digest recorded with the fix, so a new
Megatron-Core that rewrote the function fails at start-up, naming the fix to re-check,
instead of silently training with a stale patch.

To re-pin after reading the new upstream code: `python -m pretrain.megatron_fixes --digests`
prints the current digest of every guarded object.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect

KNOWN_MEGATRON_CORE = ("0.19.2",)


class UpstreamChanged(RuntimeError):
    """A patched upstream object is not the one a fix was written for."""


def megatron_core_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def resolve(target: str):
    """'package.module:Class.attr' -> the object."""
    module_name, _, attr_path = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr_path.split(".") if attr_path else []:
        obj = getattr(obj, part)
    return obj


def source_digest(obj) -> str:
    source = inspect.getsource(inspect.unwrap(obj))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def expect_source(fix: str, target: str, digest: str) -> None:
    """Raise UpstreamChanged unless `target`'s source hashes to `digest`."""
    try:
        got = source_digest(resolve(target))
    except (AttributeError, ImportError) as exc:
        raise UpstreamChanged(
            f"megatron_fixes.{fix}: {target} no longer exists in megatron-core "
            f"{megatron_core_version()} (written for {', '.join(KNOWN_MEGATRON_CORE)}): {exc}. "
            f"Read pretrain/megatron_fixes/{fix}.py and decide whether the fix is still needed"
        ) from None
    if got != digest:
        raise UpstreamChanged(
            f"megatron_fixes.{fix}: {target} changed upstream (source digest {got}, the fix was "
            f"written for {digest}, megatron-core {', '.join(KNOWN_MEGATRON_CORE)}; installed "
            f"{megatron_core_version()}). Read the new source against pretrain/megatron_fixes/{fix}.py; "
            "if the fix still holds (or is no longer needed), update it and its digest "
            "(python -m pretrain.megatron_fixes --digests)"
        )


def expect_sources(fix: str, sources: dict[str, str]) -> None:
    for target, digest in sources.items():
        expect_source(fix, target, digest)


def expect_signature(fix: str, target: str, parameters: tuple[str, ...]) -> None:
    """For wrappers of torch functions: the wrapper forwards these parameters by position."""
    obj = resolve(target)
    got = tuple(inspect.signature(inspect.unwrap(obj)).parameters)
    if got != parameters:
        raise UpstreamChanged(
            f"megatron_fixes.{fix}: {target} now takes {got}, the wrapper was written for "
            f"{parameters}; update pretrain/megatron_fixes/{fix}.py"
        )


def expect_absent(fix: str, owner: str, attr: str) -> None:
    """The fix adds or overrides `attr` on `owner` assuming upstream does not define it there."""
    obj = resolve(owner)
    if attr in vars(obj):
        raise UpstreamChanged(
            f"megatron_fixes.{fix}: {owner} now defines {attr} itself (megatron-core "
            f"{megatron_core_version()}); re-check pretrain/megatron_fixes/{fix}.py"
        )
