"""Named algorithms = settings of the `algorithm:` config section (objectives are orthogonal pieces).

A preset fills the algorithm fields it cares about; every field it leaves out takes the config
default. Field names are exactly those of the `algorithm:` section (grouprl/config/algorithm.py);
`surrogate` is a mapping {type: ..., knobs} (grouprl/config/surrogates.py).

The presets themselves, with their sources and deviations: text.py (language models and agents)
and flow.py (images and video).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from grouprl.config.presets.flow import FLOW_PRESETS
from grouprl.config.presets.text import TEXT_PRESETS


@dataclass(frozen=True)
class Preset:
    """A named algorithm: where it comes from, one sentence on what it is, and its settings."""

    name: str
    arxiv: str
    summary: str
    settings: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # read-only view, so no caller can edit a shared preset in place
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))


PRESETS: dict[str, Preset] = {spec["name"]: Preset(**spec) for spec in TEXT_PRESETS}

# image / video presets (flow_grpo, dance_grpo, ddpo, diffusion_nft ...), documented in presets/flow.py
PRESETS.update({spec["name"]: Preset(**spec) for spec in FLOW_PRESETS})


def preset_settings(name: str, *, sections: bool = False) -> dict[str, object]:
    """A fresh copy of the preset's `algorithm:` settings, or with sections=True its settings for
    other sections, keyed "section.field" (e.g. two_grpo's "rollout.group_size").

    An unknown name raises, naming the nearest preset.
    """
    if not isinstance(name, str) or name not in PRESETS:  # a YAML list or mapping is no name
        close = difflib.get_close_matches(str(name), list(PRESETS), n=1, cutoff=0.0)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown preset {name!r}: allowed are {', '.join(sorted(PRESETS))}{hint}")
    return {
        k: dict(v) if isinstance(v, dict) else v  # a fresh surrogate mapping per call
        for k, v in PRESETS[name].settings.items()
        if ("." in k) == sections
    }
