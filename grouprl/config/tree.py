"""`rollout.tree`: sample each group as a tree whose shared prefixes are generated once.

none   G independent samples per prompt (the default)
fixed  branching [b_1, ..., b_d] children per node at each depth, branch_at [t_1 < ... <
       t_{d-1}] the completion offsets (tokens) where depth k + 1 starts; G = b_1 * ... * b_d
       leaves (grouprl/rollouts/fork.py). For an image / video policy (workload images) branch_at
       and segment_tokens count DENOISING STEPS (0-based step index where depth k + 1 starts, of
       diffusion.rollout_steps; None: the steps split into d equal windows):
       grouprl/policies/flow/fork.py. For the agent workload the tree's nodes are turns:
       branch_at counts TURNS (before turn t_k every episode forks; default agent.max_turns in d
       equal parts) and segment_tokens is refused (grouprl/rollouts/agent_fork.py)
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, model_validator

from grouprl.config.section import Section


class NoTree(Section):
    type: Literal["none"] = Field("none", description="Independent samples.")


class FixedTree(Section):
    """Branch points at fixed completion offsets (TreeRPO-style segments)."""

    type: Literal["fixed"] = Field("fixed", description="Branch at fixed token offsets.")
    branching: list[int] = Field(
        description="Children per node at each depth; their product is the group size."
    )
    branch_at: list[int] | None = Field(
        None,
        description="Completion offsets (tokens) where depths 2..d start, increasing (None: "
        "max_new_tokens split into d equal segments). Agent workload: turn counts (None: "
        "agent.max_turns split into d equal parts).",
    )
    segment_tokens: int | None = Field(
        None,
        ge=1,
        description="Instead of branch_at: every depth but the last is this many tokens "
        "(TreeRPO's L_step), i.e. branch_at = [L, 2L, ...]. Not for the agent workload "
        "(its trees branch at turns).",
    )

    prune_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Images (BranchGRPO pruning): the floor(fraction * G) lowest-reward leaves of "
        "each tree are masked out of the loss (no backward); sampling is unchanged.",
    )

    @model_validator(mode="before")
    @classmethod
    def _segments(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("segment_tokens") is not None:
            if data.get("branch_at"):
                raise ValueError(
                    "rollout.tree: set branch_at or segment_tokens, not both (segment_tokens L "
                    "means branch_at [L, 2L, ...])"
                )
            depth, step = len(data.get("branching") or []), data["segment_tokens"]
            if isinstance(step, int) and step >= 1:
                data = {**data, "branch_at": [step * k for k in range(1, depth)]}
        return data

    @model_validator(mode="after")
    def _shape(self) -> FixedTree:
        if not self.branching or any(b < 1 for b in self.branching):
            raise ValueError(f"rollout.tree.branching={self.branching}: one count >= 1 per depth")
        if self.branch_at is not None and len(self.branch_at) != len(self.branching) - 1:
            raise ValueError(
                f"rollout.tree.branch_at={self.branch_at} needs {len(self.branching) - 1} "
                f"offsets, one per depth after the first of branching={self.branching}"
            )
        return self

    @property
    def leaves(self) -> int:
        return math.prod(self.branching)

    def offsets(self, max_new_tokens: int) -> list[int]:
        """branch_at, or max_new_tokens split into equal segments (the last takes the rest)."""
        if self.branch_at is not None:
            return list(self.branch_at)
        step = max_new_tokens // len(self.branching)
        return [step * k for k in range(1, len(self.branching))]


class EntropyTree(Section):
    """Branch before high-entropy tokens (text; grouprl/rollouts/fork.py sample_entropy_tree)."""

    type: Literal["entropy"] = Field("entropy", description="Branch at uncertain tokens.")
    branching: list[int] = Field(
        description="Children per node at each depth; their product is the group size."
    )
    threshold: float = Field(
        1.0, gt=0, description="Next-token entropy (nats) above which a segment ends."
    )
    min_tokens: int = Field(1, ge=0, description="Tokens a segment has at least before it may end.")

    @model_validator(mode="after")
    def _shape(self) -> EntropyTree:
        if not self.branching or any(b < 1 for b in self.branching):
            raise ValueError(f"rollout.tree.branching={self.branching}: one count >= 1 per depth")
        return self

    @property
    def leaves(self) -> int:
        return math.prod(self.branching)


TreeConfig = Annotated[NoTree | FixedTree | EntropyTree, Field(discriminator="type")]
