"""`rollout.budget`: where a step's rollouts go, from each prompt's pass-rate history.

One typed model per variant, picked by `type` (grouprl/rollouts/budget/ holds the code):
  none      every drawn prompt gets rollout.group_size samples (the default)
  greso     GRESO's pre-rollout selector (arXiv 2506.02177): prompts that were all-pass / all-fail
            in their recent consecutive visits are skipped with a probability that grows with the
            streak; skipped prompts are replaced by further draws
  allocate  G per prompt by uncertainty, sqrt(p (1 - p)) of a smoothed pass rate, under the fixed
            total prompts_per_step x group_size (floor min_group_size, largest-remainder rounding)
  greso_allocate  both: GRESO picks the prompts, the allocator sets their G (one history)
Text workload only (the `budget` capability, grouprl/workloads/base.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from grouprl.config.section import Section


class _History(Section):
    """The pass-rate history every budget keeps (grouprl/rollouts/budget/history.py)."""

    key_column: str | None = Field(
        None,
        description="Example column that identifies a prompt in the history (None: the prompt "
        "itself; a chat prompt by its JSON text).",
    )
    pass_threshold: float = Field(
        1.0,
        description="A sample passes when its correctness reward (accuracy if present, else the "
        "first reward) is >= this; a failed (NaN) reward counts as a fail.",
    )
    window: int = Field(8, ge=1, description="Visits per prompt kept in the history.")


class NoBudget(Section):
    type: Literal["none"] = Field("none", description="Every prompt: rollout.group_size samples.")


class GresoBudget(_History):
    """GRESO (arXiv 2506.02177); defaults from the official train-scripts and ray_trainer.py."""

    type: Literal["greso"] = Field("greso", description="Skip predicted zero-variance prompts.")
    p_easy: float = Field(
        0.5, gt=0, lt=1, description="Initial exploration probability of all-pass prompts."
    )
    p_hard: float = Field(
        0.5, gt=0, lt=1, description="Initial exploration probability of all-fail prompts."
    )
    target_zero_variance: float = Field(
        0.25, ge=0, le=1, description="Target share of zero-variance groups among those sampled."
    )
    easy_share: float = Field(
        1 / 3,
        ge=0,
        le=1,
        description="Part of the target given to all-pass groups (the rest: all-fail).",
    )
    p_step: float = Field(0.01, gt=0, description="Change of p_easy / p_hard per step.")
    p_min: float = Field(0.05, gt=0, lt=1, description="Lowest exploration probability.")
    p_max: float = Field(0.95, gt=0, lt=1, description="Highest exploration probability.")
    min_keep: float = Field(
        0.01, gt=0, le=1, description="Floor of a prompt's keep probability p^streak."
    )
    max_draws: int = Field(
        20,
        ge=1,
        description="Draws per slot before the selector stops skipping (then the next draws are "
        "kept, counted in budget/forced_prompts).",
    )

    @model_validator(mode="after")
    def _range(self) -> GresoBudget:
        if self.p_min > self.p_max:
            raise ValueError(
                f"rollout.budget.p_min={self.p_min} > p_max={self.p_max}: no exploration "
                "probability fits"
            )
        return self


class AllocateBudget(_History):
    """G_i proportional to sqrt(p_i (1 - p_i)); see grouprl/rollouts/budget/allocate.py."""

    type: Literal["allocate"] = Field("allocate", description="G per prompt by uncertainty.")
    min_group_size: int = Field(2, ge=1, description="Fewest samples any prompt gets.")
    prior_passes: float = Field(
        1.0, gt=0, description="Beta prior a of the smoothed pass rate (passes)."
    )
    prior_fails: float = Field(
        1.0, gt=0, description="Beta prior b of the smoothed pass rate (fails)."
    )


class GresoAllocateBudget(GresoBudget, AllocateBudget):
    """GRESO's selector, then the allocator's G per selected prompt (knobs of both)."""

    type: Literal["greso_allocate"] = Field(
        "greso_allocate", description="Skip predicted zero-variance prompts, then G by uncertainty."
    )


BudgetConfig = Annotated[
    NoBudget | GresoBudget | AllocateBudget | GresoAllocateBudget, Field(discriminator="type")
]
