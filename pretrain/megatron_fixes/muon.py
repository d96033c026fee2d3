"""Megatron-Core's Muon: which parameters it leaves to AdamW.

What upstream does (megatron-core 0.19.2, `optimizer/emerging_optimizers.py`): the registry
entry for "muon" carries one default per-parameter override, {'optimizer': 'adam'} for
`_is_nonlinear_or_embedding` (embedding/output layer, or not 2-D), which
`_get_megatron_emerging_optimizer` (optimizer/__init__.py) deep-copies and adds to the caller's
overrides. A caller cannot add its own {'optimizer': 'adam'} override:
`check_config_overrides_consistency` refuses `optimizer` in any override ("TODO: Remove
`optimizer` from this eventually").

Why it matters: the MoE router's weight is 2-D ([experts, hidden]), so upstream gives it Muon.
It is a per-expert score table, not a hidden map; Kimi K2, GLM-4.5 and torchtitan keep it on
AdamW, and so do we (pretrain/muon.py's `is_adamw_param`, also the key of the AdamW LR override).
Likewise learned absolute position embeddings: 2-D, but not tagged as embedding parameters.

What we do instead: replace that entry's default override with one keyed by
`is_adamw_param` (upstream's rule plus the router), same value. Known for 0.19.2; the guard pins
both upstream functions and checks the entry holds exactly the override described above.
"""

from __future__ import annotations

from pretrain.megatron_fixes._guard import UpstreamChanged, expect_sources

SOURCES = {
    "megatron.core.optimizer.emerging_optimizers:_is_nonlinear_or_embedding": "c236984cd03ba4a0",
    "megatron.core.optimizer:_get_megatron_emerging_optimizer": "bb01859837461bdd",
}


def apply() -> None:
    _route_router_to_adamw()


def _route_router_to_adamw() -> None:
    from megatron.core.optimizer import emerging_optimizers
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate

    from pretrain.muon import is_adamw_param

    expect_sources("muon", SOURCES)
    entry = emerging_optimizers._EMERGING_OPTIMIZERS["muon"]
    defaults = entry.default_param_overrides
    keys = [getattr(key.predicate, "name", None) or getattr(key.with_name_predicate, "name", None) for key in defaults]
    if keys == ["adamw_params"]:
        return  # applied already
    if keys != ["nonlinear_or_embedding"] or list(defaults.values()) != [{"optimizer": "adam"}]:
        raise UpstreamChanged(f"megatron_fixes.muon: the 'muon' registry entry's default overrides are "
                              f"{defaults}, the fix expects one {{'optimizer': 'adam'}} for nonlinear_or_embedding; "
                              "read pretrain/megatron_fixes/muon.py against the new upstream")
    key = ParamKey(with_name_predicate=ParamWithNamePredicate(name="adamw_params", fn=is_adamw_param))
    entry.default_param_overrides = {key: {"optimizer": "adam"}}
