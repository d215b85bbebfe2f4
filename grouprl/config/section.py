"""`Section`: the base of every config section (unknown keys fail, assignments are validated)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: extra keys are errors (the loader names the allowed ones), and assigning
    a field re-validates it."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
