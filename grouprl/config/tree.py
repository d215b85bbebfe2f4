"""`rollout.tree`: sample each group as a tree whose shared prefixes are generated once.

none   G independent samples per prompt (the default)
fixed  branching [b_1, ..., b_d] children per node at each depth, branch_at [t_1 < ... <
       t_{d-1}] the completion offsets (tokens) where depth k + 1 starts; G = b_1 * ... * b_d
       leaves (grouprl/rollouts/fork.py)
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
    branch_at: list[int] = Field(
        default_factory=list,
        description="Completion offsets (tokens) where depths 2..d start, increasing.",
    )

    @model_validator(mode="after")
    def _shape(self) -> FixedTree:
        if not self.branching or any(b < 1 for b in self.branching):
            raise ValueError(f"rollout.tree.branching={self.branching}: one count >= 1 per depth")
        if len(self.branch_at) != len(self.branching) - 1:
            raise ValueError(
                f"rollout.tree.branch_at={self.branch_at} needs {len(self.branching) - 1} "
                f"offsets, one per depth after the first of branching={self.branching}"
            )
        return self

    @property
    def leaves(self) -> int:
        return math.prod(self.branching)


TreeConfig = Annotated[NoTree | FixedTree, Field(discriminator="type")]
