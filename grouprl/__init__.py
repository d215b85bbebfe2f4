"""grouprl: group-relative RL for generative models (text, images and video, agents).

The Python API: `Trainer(config, policy=..., reward_fns=..., dataset=..., env=...)` with
`.train()` and `.evaluate()` (grouprl/train.py), and `load_config(path, overrides)`
(grouprl/config). docs/python_api.py walks through it.
"""

from grouprl.config.loading import load_config
from grouprl.train import Trainer

__all__ = ["Trainer", "load_config"]
