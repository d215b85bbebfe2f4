"""A tiny name -> function registry, so new variants are one decorated function, not an if-ladder.

ADVANTAGES = Registry("advantage estimator")

@ADVANTAGES.register("grpo")
def grpo(...): ...

ADVANTAGES["grpo"]   # the function; an unknown name raises ValueError naming the allowed names
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry:
    """Maps option strings to implementations; lookups of unknown names fail loudly and helpfully."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # used in error messages, e.g. "advantage estimator"
        self._entries: dict[str, Callable[..., Any]] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: store `fn` under `name` (a duplicate name is a programming error)."""

        def deco(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = fn
            return fn

        return deco

    def __getitem__(self, name: str) -> Callable[..., Any]:
        if name in self._entries:
            return self._entries[name]
        allowed = ", ".join(sorted(self._entries))
        close = difflib.get_close_matches(str(name), list(self._entries), n=1, cutoff=0.0)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown {self.kind} {name!r}: allowed are {allowed}{hint}")

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._entries)
