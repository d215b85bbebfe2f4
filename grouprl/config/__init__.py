"""The run's configuration: typed sections (pydantic), YAML loading with dotted overrides, presets.

Public API: `load_config(path, overrides)`, `validate(raw)`, `apply_overrides(raw, items)`,
`Config`, `ConfigError`, `config_json(cfg)`. One module per section (run, workload, model, task,
rewards, rollout, algorithm + surrogates, curriculum, agent, diffusion, training, evaluation,
checkpoint); root.py assembles them, checks.py holds the combination checks, migration.py reads
older spellings, loading.py the YAML; presets in `grouprl.config.presets`.
"""

from grouprl.config.agent import AgentConfig
from grouprl.config.algorithm import AlgorithmConfig
from grouprl.config.diffusion import DiffusionConfig
from grouprl.config.loading import (
    ConfigError,
    apply_overrides,
    config_json,
    load_config,
    save_run_config,
    validate,
)
from grouprl.config.migration import ConfigDeprecation
from grouprl.config.root import Config
from grouprl.config.surrogates import SURROGATE_MODELS

__all__ = [
    "SURROGATE_MODELS",
    "AgentConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigDeprecation",
    "ConfigError",
    "DiffusionConfig",
    "apply_overrides",
    "config_json",
    "load_config",
    "save_run_config",
    "validate",
]
