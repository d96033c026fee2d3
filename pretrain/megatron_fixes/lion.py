"""Megatron-Core's Lion: optimizer="lion" is Lion on every parameter, with lion_beta1/lion_beta2.

What upstream does (megatron-core 0.19.2): `get_megatron_optimizer` sends every optimizer other
than adam/sgd to `_get_megatron_emerging_optimizer` (optimizer/__init__.py). "lion" is in its
registry (optimizer/emerging_optimizers.py registers every emerging_optimizers class it does not
wrap itself) with the generic entry: (1) the default per-parameter override meant for Muon,
{'optimizer': 'adam'} for embedding/output layer and every non-2-D parameter, so norms, biases,
embeddings and the output layer get Adam, not Lion; (2) `_default_adam_based_eopt_config_to_kwargs`,
which passes betas=(adam_beta1, adam_beta2), so OptimizerConfig.lion_beta1/lion_beta2 are
ignored. Megatron-Core's own Lion branch (`_get_megatron_optimizer_based_on_param_groups`,
`config.optimizer == 'lion'`: every parameter, betas=(lion_beta1, lion_beta2)) is reached only
as Muon's scalar optimizer.

Why it matters: `optimizer.name=lion` must be the Lion of the paper and of that branch, and
`optimizer.lion_beta1/lion_beta2` must do something.

What we do instead: the registry entry for "lion" gets no default override (every parameter on
Lion; the caller's standard overrides still exempt biases and 1-D parameters from weight decay)
and builds its kwargs from lr, (lion_beta1, lion_beta2), weight_decay, as that branch does.
Known for 0.19.2; the guard pins the two upstream functions and checks the entry is the generic one.
"""

from __future__ import annotations

from pretrain.megatron_fixes._guard import UpstreamChanged, expect_sources

SOURCES = {
    "megatron.core.optimizer.emerging_optimizers:_default_adam_based_eopt_config_to_kwargs": "38750e0109b93bf4",
    "megatron.core.optimizer:_get_megatron_emerging_optimizer": "bb01859837461bdd",
}


def apply() -> None:
    from megatron.core.optimizer import emerging_optimizers

    expect_sources("lion", SOURCES)
    entry = emerging_optimizers._EMERGING_OPTIMIZERS.get("lion")
    if entry is None:
        raise UpstreamChanged("megatron_fixes.lion: Megatron-Core's emerging-optimizer registry has no 'lion'; "
                              "read pretrain/megatron_fixes/lion.py against the new upstream")
    if entry.config_to_kwargs is _lion_config_to_kwargs:
        return  # applied already
    keys = [getattr(key.predicate, "name", None) for key in entry.default_param_overrides]
    if (entry.config_to_kwargs is not None or keys != ["nonlinear_or_embedding"]
            or list(entry.default_param_overrides.values()) != [{"optimizer": "adam"}]):
        raise UpstreamChanged(f"megatron_fixes.lion: the 'lion' registry entry is not the generic one the fix "
                              f"expects (config_to_kwargs={entry.config_to_kwargs}, overrides "
                              f"{entry.default_param_overrides}); read pretrain/megatron_fixes/lion.py against "
                              "the new upstream")
    entry.config_to_kwargs = _lion_config_to_kwargs
    entry.default_param_overrides = {}


def _lion_config_to_kwargs(config, model_chunks, pg_collection) -> dict:
    # What optimizer/__init__.py's own `config.optimizer == 'lion'` branch passes.
    return dict(lr=config.lr, betas=(config.lion_beta1, config.lion_beta2), weight_decay=config.weight_decay)
