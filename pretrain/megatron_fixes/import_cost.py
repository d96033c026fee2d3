"""Start-up cost: the torch.compile wrappers Megatron-Core builds while it is imported.

Megatron-Core's `megatron/core/jit.py` (0.16.1, unchanged in 0.19.2) sets `jit_fuser = torch.compile` when it is
imported (`enable_jit_fuser`), and ~20 functions of its fusions, activations, norms,
attention and MoE modules are decorated `@jit_fuser` as `import megatron.core` runs. Each
decoration builds a dynamo wrapper, and the first one imports torch._dynamo's frame
evaluation and the inductor backend: 2.8 CPU-s of every process that imports megatron.core
(5.4 -> 2.6 CPU-s for megatron.core plus our training modules, 3 runs each, 2-core VM), paid
by every rank and CLI before anything is compiled: torch.compile compiles a function at its
first call, and on CPU our layer specs call none of them.

Here the decoration itself is deferred: while megatron.core's own import runs, `torch.compile`
is `compile_on_first_call`, which returns a wrapper that calls the real `torch.compile` with
the same arguments at the function's first call and the compiled function from then on. So
the same function is compiled with the same options at the same moment as before; only the
wrapper's construction moved. `torch.compile` is restored when megatron.core's import ends,
so nothing else in the process sees the stand-in (modules of megatron.core imported later
still decorate through `jit_fuser`, which keeps the deferring function).

On CPU (`megatron_fixes.cpu` calls `run_eagerly()`), a deferred function runs eagerly at its
first call instead of being compiled: torch.compile's CPU backend traces it and compiles C++
with the machine's compiler at the first call in every process (1.8 CPU-s for the MoE
router's `_apply_expert_bias`, the one our CPU runs reach, a no-op without expert bias), and
a laptop without a compiler would fail there; eager is the same function, unfused. On GPU
they are compiled as upstream does.

`install()` puts a finder on `sys.meta_path` that waits for `megatron.core` (it imports
neither torch nor megatron); the `pretrain` package calls it when it is imported, before any
of our modules imports megatron.core. The guard pins `enable_jit_fuser`, checked by
`megatron_fixes.apply()` at start-up.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import sys

SOURCES = {"megatron.core.jit:enable_jit_fuser": "0714694302faf5a4"}
_EAGER = False  # run_eagerly(): deferred functions are called as they are, never compiled


def run_eagerly() -> None:
    """From now on a deferred function that is first called runs eagerly (CPU)."""
    global _EAGER
    _EAGER = True


def compile_on_first_call(real_compile):
    """A stand-in for `torch.compile` that defers the call to `real_compile` to the first
    call of the function it decorates (decorator with or without options)."""

    def deferred(model=None, **options):
        if model is None:  # @torch.compile(mode=...): the decorator it returns
            return lambda fn: deferred(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = model if _EAGER else real_compile(model, **options)
            return compiled(*args, **kwargs)

        call.deferred_compile = True
        return call

    return deferred


@contextlib.contextmanager
def deferred_torch_compile():
    import torch

    real = torch.compile
    torch.compile = compile_on_first_call(real)
    try:
        yield
    finally:
        torch.compile = real


class _DeferringLoader(importlib.abc.Loader):
    """megatron.core's own loader, its module body run under deferred_torch_compile."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self._loader  # what inspect reads later
        with deferred_torch_compile():
            self._loader.exec_module(module)


class _MegatronCoreFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "megatron.core":
            return None
        sys.meta_path.remove(self)  # once; and the lookup below must not find us again
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferringLoader(spec.loader)
        return spec


def install() -> None:
    """Defer megatron.core's torch.compile wrappers (idempotent; nothing if it is imported)."""
    if "megatron.core" in sys.modules or any(isinstance(f, _MegatronCoreFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _MegatronCoreFinder())


def apply() -> None:
    from pretrain.megatron_fixes._guard import expect_sources

    expect_sources("import_cost", SOURCES)
