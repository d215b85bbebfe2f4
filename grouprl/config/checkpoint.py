"""The `checkpoint:` section: how often to save and how many to keep."""

from __future__ import annotations

from pydantic import Field

from grouprl.config.section import Section


class CheckpointConfig(Section):
    every: int = Field(0, ge=0, description="Save every k steps (0: only at the end).")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept.")
