"""Images and video: a flow-matching or DDPM denoiser as a policy over denoising steps.

An action is one stochastic denoising step x_t -> x_{t-1} (a Gaussian transition), so an image is
a K-step trajectory with log-probs [N, K]; reward functions score the decoded images. collect /
evaluate: workloads/images/sampling.py; prepare, the loss of one micro-batch (Flow-GRPO, DanceGRPO, MixGRPO,
GRPO-Guard, and the likelihood-free DiffusionNFT / AWM) and the after-update hooks (old / EMA
weights): workloads/images/loss.py. One process (no multi_process capability), global-RNG noise.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from grouprl.config.diffusion import DiffusionConfig
from grouprl.runtime.build import build_rewards
from grouprl.runtime.throughput import StepWork
from grouprl.types import LossOutput, Rollout
from grouprl.workloads.base import Capabilities, Collected, Parts, register
from grouprl.workloads.images import loss as image_loss
from grouprl.workloads.images import sampling as images
from grouprl.workloads.text import accuracy_key


@register
class ImagesWorkload:
    """See the module docstring."""

    name: ClassVar[str] = "images"
    capabilities: ClassVar[Capabilities] = Capabilities(
        multi_process=True, per_sample_seeding=True, curriculum=True, tree_rollouts=True
    )
    settings: ClassVar[type] = DiffusionConfig

    def __init__(self, parts: Parts) -> None:
        self.cfg, self.policy, self.dist = parts.cfg, parts.policy, parts.dist
        self.reward_fns, self.weights = parts.reward_fns, parts.weights
        if self.dist.world > 1 and images.likelihood_free(self.cfg):
            raise ValueError(
                f"diffusion.objective {self.cfg.diffusion.objective.type!r} with "
                f"{self.dist.world} processes is not supported (its forward-noising denoiser "
                "calls bypass DDP's gradient synchronisation); use policy_gradient, or one process"
            )

    @classmethod
    def build_policy(cls, cfg: Any, device: torch.device) -> Any:
        from grouprl.workloads.images.policy import build_flow_policy  # diffusers: image runs only

        return build_flow_policy(cfg, device)

    @classmethod
    def build_rewards(cls, cfg: Any, task: Any) -> tuple[dict, dict[str, float]]:
        return build_rewards(cfg, task, required=False)

    def max_len(self) -> int:
        return self.cfg.diffusion.rollout_steps  # the denoising steps of one image

    def collect(
        self, policy: Any, examples: list[dict], *, first_group_id: int, step: int
    ) -> Collected:
        cfg, first_errors = self.cfg, {}
        a = cfg.algorithm
        seed = cfg.run.seed if cfg.rollout.seeding == "per_sample" else None

        def make(part: list[dict], first: int) -> tuple[Rollout, dict]:
            return images.collect(
                cfg, policy, part, self.reward_fns, first_group_id=first,
                optimizer_step=step * a.epochs * a.minibatches,  # MixGRPO's window position
                first_errors=first_errors, seed=seed,
            )  # fmt: skip

        rollout, errors = self.dist.gather_groups(examples, first_group_id, make)
        return Collected(rollout, len(rollout), errors, first_errors)

    def postprocess(self, rollout: Rollout) -> tuple[Rollout | None, dict[str, float]]:
        return rollout, {}

    def step_work(self, rollout: Rollout) -> StepWork:
        return StepWork(
            params=None,
            why="a flow / diffusion denoiser's FLOPs per denoising step depend on its architecture, resolution and guidance (no 2 N per action count)",
        )

    def prepare(self, scorer: Any, rollout: Rollout, weights: dict[str, float]) -> dict[str, float]:
        return image_loss.prepare(self.cfg, scorer, rollout, weights)

    def micro_loss(
        self, sub: Rollout, counts: dict[str, Any], *, single_pass: bool
    ) -> tuple[LossOutput, Tensor]:
        return image_loss.micro_loss(self.cfg, self.policy, sub, counts, single_pass)

    def after_update(self, step: int, rollout: Rollout) -> dict[str, float]:
        return image_loss.after_update(self.cfg, self.policy, step)  # NFT old / AWM EMA weights

    def evaluate(self, examples: list[dict], *, step: int) -> tuple[dict[str, float], list[dict]]:
        # fixed prompts and seeds; the image grid goes to run_dir/images/
        return images.evaluate(
            self.cfg, self.policy, examples, self.reward_fns, self.weights, step=step,
            dist=self.dist,
        )  # fmt: skip

    def accuracy_key(self) -> str:
        return accuracy_key(self.reward_fns)
