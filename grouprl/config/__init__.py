"""The run's configuration: typed sections (pydantic), YAML loading with dotted overrides, presets.

Public API: `load_config(path, overrides)`, `validate(raw)`, `apply_overrides(raw, items)`,
`Config`, `ConfigError`, `config_json(cfg)`. The sections live in their own modules; presets in
`grouprl.config.presets`.
"""

from grouprl.config.loading import (
    Config,
    ConfigError,
    apply_overrides,
    config_json,
    load_config,
    save_run_config,
    validate,
)

__all__ = [
    "Config",
    "ConfigError",
    "apply_overrides",
    "config_json",
    "load_config",
    "save_run_config",
    "validate",
]
