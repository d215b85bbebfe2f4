"""grouprl: group-relative RL for generative models (text, images and video, agents).

The Python API: `Trainer(config, policy=..., reward_fns=..., dataset=..., env=...)` with
`.train()` and `.evaluate()` (grouprl/api.py), and `load_config(path, overrides)`
(grouprl/config). docs/python_api.py walks through it.
"""

from grouprl.api import Trainer
from grouprl.config.loading import load_config

__all__ = ["Trainer", "load_config"]
