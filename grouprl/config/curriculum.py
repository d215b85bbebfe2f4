"""The `curriculum:` section: how prompts are drawn (uniform, or DUMP's UCB over sources)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grouprl.config.section import Section


class CurriculumConfig(Section):
    type: Literal["none", "dump"] = Field(
        "none", description="none: uniform prompts; dump: UCB over data sources (arXiv 2504.09710)."
    )
    source_column: str = Field("source", description="Example column naming its data source.")
    window: int = Field(300, ge=1, description="DUMP: |advantage| values kept per source.")
    c: float = Field(1.0, ge=0, description="DUMP: UCB exploration coefficient.")
    temperature: float = Field(0.1, gt=0, description="DUMP: softmax temperature over sources.")
