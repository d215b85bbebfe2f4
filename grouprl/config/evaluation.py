"""The `eval:` section: when and how much held-out evaluation."""

from __future__ import annotations

from pydantic import Field

from grouprl.config.section import Section


class EvalConfig(Section):
    every: int = Field(0, ge=0, description="Evaluate every k steps (0: only before and after).")
    max_examples: int | None = Field(None, ge=1, description="Held-out examples used.")
    pass_k: int = Field(0, ge=0, description="Also report pass@k with k samples (0: off).")
    batch_size: int = Field(256, ge=1, description="Prompts per generation batch.")
