"""Rollout hooks: what to do with a group that carries no signal, one registry for every method.

A group whose G samples all fail has advantage 0 under every group-relative estimator: its
rollouts are spent and nothing is learned. A hook looks at each sampling round after it is scored
(before dynamic sampling filters it) and changes the rows of such groups:

  hint    hint.py    re-sample the group with a hint: a prefix of the reference solution or a
                     prepared hint, in the prompt or as the forced start of the completion
                     (NuRL arXiv 2509.25666, GHPO arXiv 2507.10628)
  replay  replay.py  replace rows of the group by past successes of the same prompt, trained with
                     their stored sampling log-probs as behaviour policy (RePO arXiv 2506.09340,
                     AR3PO's response reuse arXiv 2509.25808)

Hooks run in the order `rollout.hooks` lists them; a group a hint rescued is no longer all-fail
when replay looks at it. Every changed row is marked in `Rollout.row_source`. Hooks are
deterministic given the batch (and the seeded sampling), so several trainer processes, which all
see the whole gathered batch, make the same changes. Their state (replay's buffer) is saved in
checkpoints as plain JSON values and restored exactly.

A hook is a class with `type` (its config's discriminator), a constructor taking its config,
`apply(rollout, ctx) -> rollout`, `metrics() -> dict` (this step's, then reset) and
`state_dict()` / `load_state_dict()`; `ROLLOUT_HOOKS` maps the type to the class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from grouprl.rollouts.hooks.hint import HintHook
from grouprl.rollouts.hooks.replay import ReplayHook
from grouprl.types import ROW_SAMPLED, Rollout

# (examples, one forced completion start per example or None, samples per example) -> the scored
# rows of those examples, one group per example in order, under group ids of the caller's choosing
Resample = Callable[[list[dict], list[str] | None, int], Rollout]


@dataclass
class HookContext:
    """What a hook may use besides the batch.

    step:     the 0-based step being sampled (hint schedules)
    weights:  reward name -> weight of the combined reward (what passes / fails)
    resample: sample and score more rows (the workload's collect)
    """

    step: int
    weights: dict[str, float]
    resample: Resample


class RolloutHook(Protocol):
    type: str

    def apply(self, rollout: Rollout, ctx: HookContext) -> Rollout: ...

    def metrics(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


ROLLOUT_HOOKS: dict[str, type] = {"hint": HintHook, "replay": ReplayHook}


class SignalHooks:
    """The configured hooks in order (`rollout.hooks`); empty: the batch passes untouched."""

    def __init__(self, configs: list[Any]) -> None:
        self.hooks: list[RolloutHook] = [ROLLOUT_HOOKS[c.type](c) for c in configs]

    def __bool__(self) -> bool:
        return bool(self.hooks)

    def apply(self, rollout: Rollout, ctx: HookContext) -> Rollout:
        if not self.hooks:
            return rollout
        if rollout.row_source is None:
            rollout.row_source = torch.full((len(rollout),), ROW_SAMPLED, dtype=torch.long)  # [N]
        for hook in self.hooks:
            rollout = hook.apply(rollout, ctx)
        return rollout

    def metrics(self) -> dict[str, float]:
        """This step's metrics of every hook, `hooks/<type>/<name>`; the counters restart."""
        return {f"hooks/{h.type}/{k}": v for h in self.hooks for k, v in h.metrics().items()}

    def state_dict(self) -> dict[str, Any]:
        return {h.type: h.state_dict() for h in self.hooks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Each hook's saved state; a hook the checkpoint did not have starts empty, a saved one
        the config no longer lists is dropped (both are config changes a resume reports)."""
        for h in self.hooks:
            if h.type in state:
                h.load_state_dict(state[h.type])
