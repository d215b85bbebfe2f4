"""Prompt sampling with a resumable position: seeded reshuffle each pass over the training set."""

from __future__ import annotations

import random
from typing import Any


class PromptSampler:
    """Yields training examples in a seeded random order, reshuffled at every pass.

    Its whole state is (pass index, position): a resumed run continues with the exact examples an
    uninterrupted run would have drawn.
    """

    def __init__(self, examples: list[dict], seed: int) -> None:
        if not examples:
            raise ValueError("the task's training split is empty: nothing to sample prompts from")
        self.examples = examples
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append(self.examples[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "size": len(self.examples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != len(self.examples):
            raise ValueError(
                f"the checkpoint was made with {state['size']} training examples, the task now has "
                f"{len(self.examples)}: resume needs the same task options"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffled(self.epoch)
