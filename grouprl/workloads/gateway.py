"""Agent programs through an OpenAI-compatible gateway: `workload: {type: gateway}`.

Each sampling round starts the gateway (grouprl/rollouts/gateway/server.py) over the sampling
policy on 127.0.0.1, runs the user's agent program (gateway.program, loaded with
runtime/user_inputs.py) rollout.group_size times per example, each episode under its own id, and
turns the recorded calls into rows (rollouts/gateway/episodes.py): the policy's sampled tokens
are the actions, everything else (prompts, tool results, user turns) is masked out, and the
recorded sampling log-probs are the old / engine log-probs. The reward is the program's return
value or gateway.reward_fn over the episode; advantages are the group advantages of
algorithm.advantage over the episodes of an example (one reward per episode), and the loss is the
token loss of workloads/tokens.py. The gateway's weight version starts at 0 and is bumped after
every update (after_update), so every call records the weights that sampled it.

Evaluation runs the program once per held-out example (the run's sampling: the gateway serves no
other) and reports the mean reward; `accuracy` is the mean success (the program's `success`, else
reward > 0).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from grouprl.config.gateway import GatewayConfig
from grouprl.rollouts.gateway.episodes import episodes_rollout, run_episodes
from grouprl.rollouts.gateway.server import Gateway
from grouprl.runtime.throughput import StepWork
from grouprl.runtime.user_inputs import import_user_module, split_user_spec
from grouprl.types import LossOutput, Rollout
from grouprl.workloads.base import Capabilities, Collected, Parts, register
from grouprl.workloads.text import causal_lm_policy, sampling_params, step_mismatch
from grouprl.workloads.tokens import prepare, token_micro_loss, token_work


def load_callable(spec: str, option: str) -> Any:
    """The function named by 'module:function' / 'file.py:function' (option: the config key)."""
    module_part, attr = split_user_spec(spec, option)
    fn = getattr(import_user_module(module_part, f"{option} {spec!r}"), attr, None)
    if not callable(fn):
        raise AttributeError(f"{option}={spec!r}: {module_part!r} has no function {attr!r}")
    return fn


@register
class GatewayWorkload:
    """See the module docstring."""

    name: ClassVar[str] = "gateway"
    capabilities: ClassVar[Capabilities] = Capabilities()
    settings: ClassVar[type] = GatewayConfig

    def __init__(self, parts: Parts) -> None:
        self.cfg, self.policy, self.dist = parts.cfg, parts.policy, parts.dist
        self.gw: GatewayConfig = parts.cfg.workload_settings
        self.params = sampling_params(parts.cfg)
        self.program = load_callable(self.gw.program, "gateway.program")
        self.reward_fn = (
            load_callable(self.gw.reward_fn, "gateway.reward_fn") if self.gw.reward_fn else None
        )
        self.weight_version = 0  # bumped after every update

    @classmethod
    def build_policy(cls, cfg: Any, device: torch.device) -> Any:
        return causal_lm_policy(cfg, device)

    @classmethod
    def build_rewards(cls, cfg: Any, task: Any) -> tuple[dict, dict[str, float]]:
        """The episode's reward (program or gateway.reward_fn) is the one reward."""
        if cfg.rewards:
            raise ValueError(
                "workload gateway takes its rewards from the agent program or gateway.reward_fn; "
                "remove `rewards`"
            )
        return {}, {"return": 1.0}

    def max_len(self) -> int:
        return self.gw.max_episode_tokens  # a whole episode's tokens

    def _episodes(self, policy: Any, examples: list[dict], group_size: int, first: int):
        g = self.gw
        with Gateway(
            policy, self.params, model_name=g.model_name,
            max_episode_tokens=g.max_episode_tokens, request_timeout_s=g.request_timeout_s,
            tool_format=g.tool_format, weight_version=self.weight_version, max_batch=g.max_batch,
        ) as gateway:  # fmt: skip
            return run_episodes(
                gateway, self.program, examples, group_size, first_group_id=first,
                concurrency=g.concurrency, timeout_s=g.episode_timeout_s, reward_fn=self.reward_fn,
            )  # fmt: skip

    def collect(
        self, policy: Any, examples: list[dict], *, first_group_id: int, step: int
    ) -> Collected:
        finished = self._episodes(policy, examples, self.cfg.rollout.group_size, first_group_id)
        rollout = episodes_rollout(finished, policy.tokenizer, self.gw.on_rewrite)
        return Collected(rollout)  # scored 0: no reward function of `rewards:` saw them

    def postprocess(self, rollout: Rollout) -> tuple[Rollout | None, dict[str, float]]:
        info, n = rollout.info, max(len(rollout), 1)
        return rollout, {
            "episode/reward": float(rollout.rewards["return"].mean()),
            "episode/success": sum(map(bool, info["success"])) / n,
            "episode/calls": sum(info["calls"]) / n,
            "episode/split_rows": sum(s > 1 for s in info["segments"]) / n,
            "episode/weight_version": float(min(info["weight_version"])),
        }

    def step_work(self, rollout: Rollout) -> StepWork:
        return token_work(self.cfg, self.policy, rollout)  # runtime/throughput.py: FLOPs, MFU

    def prepare(self, scorer: Any, rollout: Rollout, weights: dict[str, float]) -> dict[str, float]:
        return prepare(self.cfg, scorer, rollout, weights)  # group advantages of the returns

    def micro_loss(
        self, sub: Rollout, counts: dict[str, Any], *, single_pass: bool
    ) -> tuple[LossOutput, Tensor]:
        return token_micro_loss(self.cfg, self.policy, sub, counts, single_pass=single_pass)

    def after_update(self, step: int, rollout: Rollout) -> dict[str, float]:
        self.weight_version += 1
        return step_mismatch(self.cfg, rollout)

    @torch.no_grad()
    def evaluate(self, examples: list[dict], *, step: int) -> tuple[dict[str, float], list[dict]]:
        finished = self._episodes(self.policy, examples, 1, 0)
        n = max(len(finished), 1)
        metrics = {
            "accuracy": sum(f.success for f in finished) / n,
            "reward": sum(f.reward for f in finished) / n,
            "calls": sum(len(f.log.calls) for f in finished) / n,
        }
        rows = [
            {
                "episode": f.log.id,
                "reward": f.reward,
                "transcript": "\n".join(f"[{c.finish_reason}] {c.text}" for c in f.log.calls),
            }
            for f in finished[:3]
        ]
        return metrics, rows

    def accuracy_key(self) -> str:
        return "accuracy"
