"""`rollout.hooks`: what to do with groups that carry no signal, one typed entry per hook.

Each entry is picked by `type` (the registry grouprl/rollouts/hooks/ ROLLOUT_HOOKS, where the
methods, their papers and every deviation are described); hooks run in the order listed, on every
sampling round, before dynamic sampling filters the round:

    rollout:
      hooks:
        - {type: hint, text: solution_prefix, column: answer, where: response}
        - {type: replay, per_group: 1}
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from grouprl.config.section import Section


class HintHookConfig(Section):
    """Re-sample an all-fail group with a hint (NuRL arXiv 2509.25666; GHPO arXiv 2507.10628)."""

    type: Literal["hint"] = Field("hint", description="Hints for all-fail groups.")
    text: Literal["column", "solution_prefix"] = Field(
        "solution_prefix",
        description="column: the example's `column` is the hint as it is (NuRL's offline hints); "
        "solution_prefix: the first `fraction` of the reference solution in `column` (GHPO).",
    )
    column: str = Field("solution", description="The example column holding the hint / solution.")
    where: Literal["prompt", "response"] = Field(
        "prompt",
        description="prompt: `template` appended to the prompt (its last user message); "
        "response: the hint is the forced start of the completion, masked out of the loss.",
    )
    template: str = Field(
        "\n\nHint: {hint}", description="How a prompt hint is appended ({hint}: its text)."
    )
    context: Literal["hinted", "original"] = Field(
        "hinted",
        description="Prompt hints: train on the hinted prompt (NuRL, GHPO), or on the original one "
        "with the hinted sampling log-probs as behaviour policy (corrected per token by "
        "algorithm.engine_correction, which must then be on).",
    )
    unit: Literal["words", "characters"] = Field(
        "words", description="What solution_prefix counts: whitespace words or characters."
    )
    start_fraction: float = Field(
        0.5, gt=0, le=1, description="solution_prefix: share of the solution given at step 0."
    )
    end_fraction: float = Field(
        0.0, ge=0, le=1, description="solution_prefix: share given from anneal_steps on."
    )
    anneal_steps: int = Field(
        100, ge=1, description="Steps of the linear anneal from start_fraction to end_fraction."
    )
    keep_sampled: int = Field(
        1,
        ge=0,
        description="Rows of the failed group kept as sampled; the other G - keep_sampled are "
        "re-sampled with the hint (NuRL: 1, i.e. G - 1 hinted rows).",
    )
    success_threshold: float = Field(
        1.0, description="A sample passes when its combined reward is >= this."
    )


class ReplayHookConfig(Section):
    """Past successes of a prompt mixed into its all-fail groups (RePO arXiv 2506.09340; AR3PO's
    response reuse arXiv 2509.25808)."""

    type: Literal["replay"] = Field("replay", description="Replay of past successes.")
    per_group: int = Field(
        1, ge=1, description="Rows of an all-fail group replaced by stored successes (at most)."
    )
    per_prompt: int = Field(4, ge=1, description="Successes kept per prompt.")
    capacity: int = Field(10_000, ge=1, description="Prompts kept; the least recently seen leave.")
    max_age: int | None = Field(
        None, ge=0, description="Steps a success stays usable (None: no limit)."
    )
    eviction: Literal["oldest", "lowest_reward"] = Field(
        "oldest", description="Which success of a full prompt slot leaves for a new one."
    )
    key_column: str | None = Field(
        None, description="The example column naming a prompt (None: the prompt itself)."
    )
    success_threshold: float = Field(
        1.0, description="A sample passes when its combined reward is >= this."
    )

    @model_validator(mode="after")
    def _fits(self) -> ReplayHookConfig:
        if self.per_group > self.per_prompt:
            raise ValueError(
                f"rollout.hooks replay: per_group={self.per_group} > per_prompt="
                f"{self.per_prompt}; a group can replay at most the successes kept per prompt"
            )
        return self


HookConfig = Annotated[HintHookConfig | ReplayHookConfig, Field(discriminator="type")]
