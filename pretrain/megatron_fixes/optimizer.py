"""The distributed optimizer's checkpoint paths, with torch's AdamW (no Transformer Engine
or Apex: always on CPU). Known for megatron-core 0.19.2 (written for 0.16.1); each method
below is pinned by the digest of the upstream source it was last read against. 0.19 changed
five of the six: the state copies now skip non-tensor entries and follow the optimizer's
state keys (for Lion), and `load_state_dict` matches parameter groups by an identifier tuple.
torch's AdamW keeps `step` as a tensor, so fixes 1-3 still hold as written. All four are class-level overrides of
`megatron.core.optimizer.distrib_optimizer.DistributedOptimizer`, installed by `apply()`.

1. `sharded_state_dict(is_loading=True)` of an optimizer that has never stepped. Upstream
   `state_dict()` (called inside it) reads a per-parameter `step` from the inner AdamW and
   asserts there is exactly one value, which fails before the first step: loading a
   checkpoint into a freshly built optimizer was impossible. We give the empty inner
   optimizer a placeholder state while the state dict is built, then empty it again,
   because `load_state_dict` allocates the real state only when it is empty.
2. `_set_main_param_and_optimizer_states` while loading the `fully_reshardable` format.
   torch's AdamW keeps a per-parameter `step`, which Megatron saves in the common state, not
   with the parameter shards, but this method copies every key of the live state and fails
   on `step`. A key missing from the loaded shard now keeps the value `load_state_dict`
   just restored.
3. `load_state_dict`: the no-TE/Apex branch assigns ONE tensor as `step` to every
   parameter; torch's AdamW increments it in place, so after a resume each parameter's
   update would see step + (its index) and the resumed run diverges. Each parameter gets
   its own copy.
4. `sharded_param_state_fully_reshardable(is_loading=False)`: Megatron builds the save state
   with three whole-state copies per save (5.5 s of a 100M model's 7.5 s async-save stall);
   `optimizer_save` builds the identical state dict without them. Loading keeps upstream's
   implementation.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from pretrain.megatron_fixes._guard import expect_sources

_TARGET = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
SOURCES = {
    f"{_TARGET}.state_dict": "fe621ae6a622b587",  # asserts a single `step` value (fix 1)
    f"{_TARGET}.sharded_state_dict": "8beb5164ba90f3f9",
    f"{_TARGET}._set_main_param_and_optimizer_states": "40cab784659711a8",
    f"{_TARGET}.load_state_dict": "7e5f988b86b48501",
    f"{_TARGET}.sharded_param_state_fully_reshardable": "6df6392a0ebb4c79",
    f"{_TARGET}._get_main_param_and_optimizer_states": "716bb81f0fcd1852",  # read by optimizer_save
}
_FAST_SAVE = [True]


def _torch_adamw(opt):
    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, torch.optim.AdamW) else None


def _sharded_state_dict(original):
    @functools.wraps(original)
    def sharded_state_dict(self, model_sharded_state_dict={}, is_loading=False, sharding_type=None,
                           metadata=None):
        inner = _torch_adamw(self)
        fresh = is_loading and inner is not None and len(inner.state) == 0
        if fresh:
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p.data),
                                          exp_avg_sq=torch.zeros_like(p.data))
        try:
            return original(self, model_sharded_state_dict, is_loading, sharding_type, metadata)
        finally:
            if fresh:
                inner.state.clear()

    return sharded_state_dict


def _set_main_param_and_optimizer_states(original):
    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        if _torch_adamw(self) is not None:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            live = self.optimizer.state[main_param]
            tensors = {**{k: v for k, v in live.items() if k not in tensors}, **tensors}
        return original(self, model_param, tensors)

    return set_states


def _load_state_dict(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        inner = _torch_adamw(self)
        if inner is not None:
            for state in inner.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].detach().clone()
        return result

    return load_state_dict


def _sharded_param_state_fully_reshardable(original):
    @functools.wraps(original)
    def sharded_param_state(self, model_sharded_state_dict, is_loading=False, metadata=None):
        if is_loading or not _FAST_SAVE[0]:
            return original(self, model_sharded_state_dict, is_loading, metadata)
        from pretrain.megatron_fixes.optimizer_save import sharded_param_state_for_save

        return sharded_param_state_for_save(self, model_sharded_state_dict)

    return sharded_param_state


@contextlib.contextmanager
def megatron_reshardable_save():
    """Within: saves build the optimizer state with Megatron's own implementation (for the
    test that compares it with ours)."""
    _FAST_SAVE[0] = False
    try:
        yield
    finally:
        _FAST_SAVE[0] = True


def apply() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    expect_sources("optimizer", SOURCES)
    for name, wrap in (("sharded_state_dict", _sharded_state_dict),
                       ("_set_main_param_and_optimizer_states", _set_main_param_and_optimizer_states),
                       ("load_state_dict", _load_state_dict),
                       ("sharded_param_state_fully_reshardable", _sharded_param_state_fully_reshardable)):
        setattr(DistributedOptimizer, name, wrap(getattr(DistributedOptimizer, name)))
