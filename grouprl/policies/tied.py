"""Parameters by identity: a module's distinct parameters once, and the other names of tied
ones (a tied LM head is the input embedding's parameter under a second name).

What the weight streams of sharded trainers (FSDP2 / ZeRO-3, runtime/distributed/backends.py)
announce and what the vLLM push sends (policies/text/engines/vllm_push.py): each tensor travels
once, and the receiver learns every name it goes under. Modality-free, so the runtime may use it.
"""

from __future__ import annotations

from typing import Any

import torch

# first name of a tied tensor -> its other names
Aliases = dict[str, list[str]]


def unique_parameters(module: torch.nn.Module) -> tuple[list[tuple[str, Any]], Aliases]:
    """(name, parameter) of each distinct parameter of a (sharded) module by object identity, and
    the aliases of the tied ones: the names a parameter stream (FSDP2 / ZeRO-3) announces."""
    first: dict[int, str] = {}
    items: list[tuple[str, Any]] = []
    aliases: Aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases.setdefault(first[id(p)], []).append(name)
            continue
        first[id(p)] = name
        items.append((name, p))
    return items, aliases
