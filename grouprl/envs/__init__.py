"""Where rewards come from: single-turn tasks (tasks/) and reward functions (rewards/)."""

from grouprl.envs.rewards import REWARDS, build_reward, load_reward_fn, score_completions
from grouprl.envs.tasks import TASKS, TaskData, build_task

__all__ = [
    "REWARDS",
    "TASKS",
    "TaskData",
    "build_reward",
    "build_task",
    "load_reward_fn",
    "score_completions",
]
