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
        ...

What a workload cannot do is declared in `capabilities`; `refuse_unsupported` (the one place that
reads them) turns a config asking for it into one error naming the option and the workload.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel
from torch import Tensor

from grouprl.types import LossOutput, Rollout


@dataclass(frozen=True)
class Capabilities:
    """What a workload supports; the loop refuses a config that asks for anything else.

    multi_process:       several trainer processes (accelerate launch) each sample a share
    async_rollouts:      train.async_mode one_step_off (a background worker samples step k+1)
    per_sample_seeding:  rollout.seeding per_sample (each sample's generator seeded by its ids)
    dynamic_sampling:    algorithm.dynamic_sampling zero_variance (resample all-equal groups)
    curriculum:          curriculum.type dump (the sampler learns from |advantage| per source)
    prompt_guard:        rollout.prompt_guard (over-long prompts filtered / truncated)
    """

    multi_process: bool = False
    async_rollouts: bool = False
    per_sample_seeding: bool = False
    dynamic_sampling: bool = False
    curriculum: bool = False
    prompt_guard: bool = False


@dataclass
class Collected:
    """One sampling round: the scored rollout plus per-round counts for the reward-health check.

    rollout: the groups of this round (rows of a group are consecutive)
    scored:  samples the reward functions saw (0 when the environment gives the rewards)
    errors:  reward name -> samples whose reward raised this round
    """

    rollout: Rollout
    scored: int = 0
    errors: dict[str, int] | None = None


class Workload(Protocol):
    """One modality's part of a training step (see the module docstring)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    settings: ClassVar[type[BaseModel] | None]  # the config section named `name`, or None

    @classmethod
    def build(cls, cfg: Any, parts: Any) -> Workload:
        """The workload of this config over the built parts (task, rewards, policy, processes)."""
        ...

    def max_len(self) -> int:
        """L_max of the constant normalisers (Dr.GRPO's token-sum / L_max): one completion, a
        whole episode, the denoising steps of an image."""
        ...

    def whole_groups(self) -> bool:
        """True when a minibatch must hold whole groups (a group-level loss such as TPO)."""
        ...

    def collect(self, examples: list[dict], *, first_group_id: int, step: int) -> Collected: ...

    def postprocess(self, rollout: Rollout) -> tuple[Rollout | None, dict[str, float]]:
        """After all sampling rounds of a step: filter / summarise the batch (agents: keep the
        informative groups, episode metrics)."""
        ...

    def prepare(self, scorer: Any, rollout: Rollout, weights: dict[str, float]) -> dict[str, float]:
        """No grad: old / reference log-probs, advantages, loss weights on `rollout`; metrics."""
        ...

    def micro_loss(
        self, sub: Rollout, counts: dict[str, Any], *, single_pass: bool
    ) -> tuple[LossOutput, Tensor]:
        """The loss of one micro-batch and the log-probs it took as pi_old ([n, T]): in a
        single-pass update these are the current weights' detached scores, kept on the rollout."""
        ...

    def after_update(self, step: int) -> dict[str, float]:
        """After a step's updates (DiffusionNFT's old weights, AWM's EMA follow)."""
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


def capability_names() -> list[str]:
    return [f.name for f in fields(Capabilities)]
