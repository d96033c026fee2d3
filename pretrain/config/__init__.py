"""The experiment config, in three modules by job:

- `schema`: the typed, strict sub-configs (`ExperimentConfig` and its sections), the facts
  derived from them (`data_parallel_sharding`, `num_microbatches`, `sample_counts`) and
  `dump_yaml` (the form `--dry-run` prints and every checkpoint saves).
- `overrides`: `apply_overrides` layers a YAML file and `key=value` strings over a recipe.
- `validation`: every check across sections and against the world size, the machine, the
  paths and the data, before any process group (`validate_before_start` runs them in order).

A config's walk through set-up is one way: recipe (pretrain.recipes) -> `apply_overrides` ->
`validate_before_start` -> the run. The names below are the package's public API.
"""

from pretrain.config.overrides import apply_overrides
from pretrain.config.schema import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    ExperimentConfig,
    LoggingConfig,
    MuonConfig,
    OptimizerConfig,
    ProfileConfig,
    RuntimeConfig,
    ScheduleConfig,
    TrackingConfig,
    WatchdogConfig,
    data_parallel_sharding,
    demo_prefix,
    dump_yaml,
    microbatches,
    num_microbatches,
    sample_counts,
)
from pretrain.config.validation import (
    check_document_masking,
    check_spec_support,
    validate_before_start,
    validate_beyond_layout,
    validate_data,
    validate_for_machine,
    validate_for_world,
    validate_inputs,
    validate_paths,
)

__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "ExperimentConfig", "LoggingConfig", "MuonConfig", "OptimizerConfig",
    "ProfileConfig", "RuntimeConfig", "ScheduleConfig", "TrackingConfig", "WatchdogConfig", "apply_overrides",
    "check_document_masking", "check_spec_support", "data_parallel_sharding", "demo_prefix", "dump_yaml", "microbatches",
    "num_microbatches", "sample_counts", "validate_before_start", "validate_beyond_layout", "validate_data",
    "validate_for_machine", "validate_for_world", "validate_inputs", "validate_paths",
]
