"""What a vision-language engine takes: encoded prompts (token ids + images), one per completion.

The text engines' contract (policies/text/engines/base.py: SamplingParams -> GenerationOutput)
with a VisionPrompt in place of a token-id list. The G copies of a group are the SAME VisionPrompt
object in consecutive positions, so an engine can encode a group's images once.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from grouprl.policies.text.engines.base import GenerationOutput, SamplingParams
from grouprl.policies.vision.processing import VisionPrompt


@runtime_checkable
class VisionEngine(Protocol):
    def generate(
        self,
        prompts: list[VisionPrompt],
        params: SamplingParams,
        *,
        greedy: bool = False,
        seeds: list[int] | None = None,
    ) -> GenerationOutput:
        """One completion per prompt (repeat prompts for groups)."""
        ...

    def load_weights(self, weights: Any) -> None:
        """Bring the engine's weights up to date with the trainer's."""
        ...


def runs(prompts: list[VisionPrompt]) -> tuple[list[VisionPrompt], list[int]]:
    """Consecutive copies of one prompt object -> (distinct prompts, run lengths)."""
    uniq: list[VisionPrompt] = []
    counts: list[int] = []
    for p in prompts:
        if uniq and p is uniq[-1]:
            counts[-1] += 1
        else:
            uniq.append(p)
            counts.append(1)
    return uniq, counts
