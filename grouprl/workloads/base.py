"""The seam between the training loop and a modality: the `Workload` protocol and its registry.

The loop (grouprl/train.py) knows a Workload, a Policy, the objectives and the runtime, and never
asks which modality it runs. A workload turns examples into a scored `Rollout` (collect), fills
what the loss needs (prepare), gives the loss of one micro-batch (micro_loss), and evaluates.
A new modality is a new module with a class satisfying `Workload`, plus one `register` call:

    @register
    class MyWorkload:
        name = "mine"
        capabilities = Capabilities(multi_process=True)
        settings = MySettings            # a pydantic model: the config section `mine:`, or None
        def __init__(self, parts: Parts): ...   # the built cfg, policy, rewards, processes
        ...

What a workload cannot do is declared in `capabilities`; `refuse_unsupported` (the one place that
reads them) turns a config asking for it into one error naming the option and the workload.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Protocol

import torch
from pydantic import BaseModel
from torch import Tensor

from grouprl.policies.base import Policy
from grouprl.types import LossOutput, Rollout


@dataclass(frozen=True)
class Capabilities:
    """What a workload supports; the loop refuses a config that asks for anything else.

    multi_process:       several trainer processes (accelerate launch) each sample a share
    async_rollouts:      train.async_mode one_step_off / bounded (a background worker samples ahead)
    per_sample_seeding:  rollout.seeding per_sample (each sample's generator seeded by its ids)
    curriculum:          curriculum.type dump (the sampler learns from |advantage| per source;
                         needs `rollout.examples`)
    prompt_guard:        rollout.max_prompt_tokens (over-long single-turn prompts filtered /
                         truncated before training)
    signal_hooks:        rollout.hooks (hint / replay for groups without signal: collect takes
                         `group_sizes` and `response_prefixes`, the payload is a TokenBatch)
    tree_rollouts:       rollout.tree (each group sampled as a tree, rollouts/fork.py)
    budget:              rollout.budget greso / allocate (prompts skipped from their pass
                         history; `collect` takes `group_sizes`, one G per example)
    distillation:        algorithm.distill (a teacher's log-probs of the sampled tokens filled in
                         prepare, the distillation term in the loss)
    """

    multi_process: bool = False
    async_rollouts: bool = False
    per_sample_seeding: bool = False
    curriculum: bool = False
    prompt_guard: bool = False
    signal_hooks: bool = False
    tree_rollouts: bool = False
    budget: bool = False
    distillation: bool = False


@dataclass
class Collected:
    """One sampling round: the scored rollout plus what the reward-health check counts.

    rollout:      the groups of this round (rows of a group are consecutive)
    scored:       samples the reward functions saw (0 when the environment gives the rewards)
    errors:       reward name -> samples whose reward raised this round
    first_errors: reward name -> the text of its first failure this round
    """

    rollout: Rollout
    scored: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    first_errors: dict[str, str] = field(default_factory=dict)


@dataclass
class Parts:
    """What the loop builds before the workload, which works over them.

    cfg:        the run's Config
    policy:     the trained policy (wrapped for several processes when there are several)
    reward_fns: name -> batched reward function (isolated ones run in workers); {} when the
                environment gives the rewards
    weights:    name -> weight in the combined reward
    dist:       this process's place among the trainer processes (runtime/distributed)
    """

    cfg: Any
    policy: Policy
    reward_fns: dict
    weights: dict[str, float]
    dist: Any


class Workload(Protocol):
    """One modality's part of a training step (see the module docstring)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    settings: ClassVar[type[BaseModel] | None]  # the config section of this workload, or None

    @classmethod
    def build_policy(cls, cfg: Any, device: torch.device) -> Policy:
        """The policy of `model:` (text: a causal LM; images: a flow / DDPM denoiser ...)."""
        ...

    @classmethod
    def build_rewards(cls, cfg: Any, task: Any) -> tuple[dict, dict[str, float]]:
        """Reward functions (name -> batched function) and their weights for this task."""
        ...

    def __init__(self, parts: Parts) -> None:
        """The workload over the parts the loop built (see Parts)."""
        ...

    def max_len(self) -> int:
        """L_max of the constant normalisers (Dr.GRPO's token-sum / L_max): one completion, a
        whole episode, the denoising steps of an image."""
        ...

    def collect(
        self, policy: Policy, examples: list[dict], *, first_group_id: int, step: int
    ) -> Collected:
        """One sampling round: `rollout.group_size` samples per example, scored. policy: the
        weights that sample (the trainer's, or the one_step_off worker's snapshot); group ids
        first_group_id, first_group_id + 1, ... one per example; step: 0-based step index.
        Workloads with the `budget` capability also take `group_sizes` (one G per example)."""
        ...

    def postprocess(self, rollout: Rollout) -> tuple[Rollout | None, dict[str, float]]:
        """After all sampling rounds of a step: filter / summarise the batch (agents: keep the
        informative groups, episode metrics)."""
        ...

    def prepare(self, scorer: Any, rollout: Rollout, weights: dict[str, float]) -> dict[str, float]:
        """No grad: old / reference log-probs, advantages, loss weights on `rollout`; metrics.
        scorer: the policy, or a view scoring each process's share of the rows."""
        ...

    def micro_loss(
        self, sub: Rollout, counts: dict[str, Any], *, single_pass: bool
    ) -> tuple[LossOutput, Tensor]:
        """The loss of one micro-batch and the log-probs it took as pi_old ([n, T]): in a
        single-pass update these are the current weights' detached scores, kept on the rollout."""
        ...

    def after_update(self, step: int, rollout: Rollout) -> dict[str, float]:
        """After a step's updates (engine-vs-trainer mismatch; DiffusionNFT's old weights, AWM's
        EMA follow)."""
        ...

    def evaluate(self, examples: list[dict], *, step: int) -> tuple[dict[str, float], list[dict]]:
        """Held-out metrics and per-example rows for the sample log."""
        ...

    def accuracy_key(self) -> str:
        """The eval metric the before/after summary reports."""
        ...


WORKLOADS: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: add a workload to WORKLOADS under its `name` (a name is taken once)."""
    name = cls.name
    if name in WORKLOADS and WORKLOADS[name] is not cls:
        raise ValueError(f"workload {name!r} is registered already ({WORKLOADS[name].__module__})")
    WORKLOADS[name] = cls
    return cls


# capability -> (the option that asks for it, is it asked for by this config / process count)
_ASKS = {
    "multi_process": ("several processes (accelerate launch)", lambda cfg, world: world > 1),
    "async_rollouts": (
        "train.async_mode one_step_off / bounded",
        lambda cfg, world: cfg.train.async_mode != "off",
    ),
    "per_sample_seeding": (
        "rollout.seeding per_sample",
        lambda cfg, world: cfg.rollout.seeding == "per_sample",
    ),
    "curriculum": ("curriculum.type dump", lambda cfg, world: cfg.curriculum.type != "none"),
    "prompt_guard": (
        "rollout.max_prompt_tokens",
        lambda cfg, world: cfg.rollout.max_prompt_tokens is not None,
    ),
    "signal_hooks": ("rollout.hooks", lambda cfg, world: bool(cfg.rollout.hooks)),
    "tree_rollouts": ("rollout.tree", lambda cfg, world: cfg.rollout.tree.type != "none"),
    "budget": ("rollout.budget", lambda cfg, world: cfg.rollout.budget.type != "none"),
    "distillation": (
        "algorithm.distill",
        lambda cfg, world: getattr(cfg.algorithm, "distill", None) is not None,
    ),
}
assert set(_ASKS) == {f.name for f in fields(Capabilities)}  # every capability is checked


def refuse_unsupported(workload: type, cfg: Any, world: int = 1) -> None:
    """The one place capabilities are read: a config (or a process count) asking for something
    the workload does not declare is one error naming every such option and the workload."""
    caps = workload.capabilities
    asked = [what for cap, (what, asks) in _ASKS.items()
             if asks(cfg, world) and not getattr(caps, cap)]  # fmt: skip
    if asked:
        raise ValueError(
            f"workload {workload.name!r} does not support {', '.join(asked)}; remove "
            f"{'it' if len(asked) == 1 else 'them'} from the config"
        )
