"""Where rewards come from: single-turn tasks (tasks/) and reward functions (rewards/), and the
text envs of multi-turn agents.

Importing this package registers grouprl's gymnasium ids (grouprl/FrozenLake-v0, ...), as env
packages do, so `import grouprl.envs; gymnasium.make("grouprl/FrozenLake-v0")` works; the ids'
entry points are strings, imported only by `gymnasium.make`.
"""

from grouprl.envs.gym import ENV_IDS, register_envs
from grouprl.envs.rewards import REWARDS, build_reward, load_reward_fn, score_completions
from grouprl.envs.tasks import TASKS, TaskData, build_task

register_envs()  # idempotent (grouprl.envs.gym also registers on import)

__all__ = [
    "ENV_IDS",
    "REWARDS",
    "TASKS",
    "TaskData",
    "build_reward",
    "build_task",
    "load_reward_fn",
    "register_envs",
    "score_completions",
]
