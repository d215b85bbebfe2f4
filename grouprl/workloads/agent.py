"""Multi-turn agents: episodes in gymnasium-style text environments, tools, per-turn credit.

An action is a token of one of the agent's own turns (environment and tool tokens are masked out),
so the loss is the token loss of workloads/tokens.py. The environment gives the rewards (the
episode return; no reward functions), credit is per turn (objectives/gigpo.py: GiGPO, episode
GRPO ...), and StarPO-S may keep only the groups whose returns vary most. Glue:
rollouts/episodes.py (collect / advantages / evaluate over envs/gym.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from grouprl.config.loop import AgentConfig
from grouprl.rollouts import episodes
from grouprl.rollouts.prepare import prepare
from grouprl.types import LossOutput, Rollout
from grouprl.workloads.base import Capabilities, Collected, register
from grouprl.workloads.text import causal_lm_policy, sampling_params
from grouprl.workloads.tokens import token_micro_loss


@register
@dataclass
class AgentWorkload:
    """See the module docstring."""

    name: ClassVar[str] = "agent"
    capabilities: ClassVar[Capabilities] = Capabilities(multi_process=True, per_sample_seeding=True)
    settings: ClassVar[type] = AgentConfig

    cfg: Any
    policy: Any
    reward_fns: dict
    weights: dict[str, float]
    dist: Any

    @classmethod
    def build_policy(cls, cfg: Any, device: torch.device) -> Any:
        return causal_lm_policy(cfg, device)

    @classmethod
    def build_rewards(cls, cfg: Any, task: Any) -> tuple[dict, dict[str, float]]:
        """The environment's episode return is the one reward."""
        if cfg.rewards:
            raise ValueError("task 'env' takes its rewards from the environment; remove `rewards`")
        return {}, {"return": 1.0}

    @classmethod
    def build(cls, cfg: Any, *, policy: Any, reward_fns: dict, weights: dict, dist: Any):
        return cls(cfg, policy, reward_fns, weights, dist)

    def __post_init__(self) -> None:
        self.params = sampling_params(self.cfg)

    def max_len(self) -> int:
        return self.cfg.agent.max_total_tokens  # a whole episode's tokens

    def collect(
        self, policy: Any, examples: list[dict], *, first_group_id: int, step: int
    ) -> Collected:
        def episodes_of(part: list[dict], first: int) -> tuple[Rollout, dict]:
            got = episodes.collect(
                self.cfg, policy, part, self.params,
                group_size=self.cfg.rollout.group_size, first_group_id=first,
            )  # fmt: skip
            return got, {}  # no reward-function errors: the environment gives the rewards

        rollout, _ = self.dist.gather_groups(examples, first_group_id, episodes_of)
        return Collected(rollout)  # scored 0: no reward function saw the episodes

    def postprocess(self, rollout: Rollout) -> tuple[Rollout | None, dict[str, float]]:
        metrics = episodes.episode_metrics(rollout)  # over every episode, before the filter
        return episodes.keep_informative(self.cfg, rollout), metrics

    def prepare(self, scorer: Any, rollout: Rollout, weights: dict[str, float]) -> dict[str, float]:
        return prepare(self.cfg, scorer, rollout, weights, credit=self._credit)

    def _credit(self, rollout: Rollout) -> Tensor:
        return episodes.advantages(self.cfg, rollout)  # [N, T]

    def micro_loss(
        self, sub: Rollout, counts: dict[str, Any], *, single_pass: bool
    ) -> tuple[LossOutput, Tensor]:
        return token_micro_loss(self.cfg, self.policy, sub, counts, single_pass=single_pass)

    def after_update(self, step: int, rollout: Rollout) -> dict[str, float]:
        return {}

    def evaluate(self, examples: list[dict], *, step: int) -> tuple[dict[str, float], list[dict]]:
        return episodes.evaluate(self.cfg, self.policy, examples, self.params)

    def accuracy_key(self) -> str:
        return "success"
