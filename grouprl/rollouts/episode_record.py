"""One multi-turn episode's growing record (`Episode`), and a batch of them as one Rollout
(`assemble`): the token rows padded (prompts left, completions right), the sampled-token mask,
engine log-probs and turn index per token, rewards per turn, and the transcripts.
multi_turn.py runs the episodes and fills these records.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from grouprl.types import Rollout, TokenBatch


@dataclass
class Episode:
    """One episode's growing record (completion = every token after the initial prompt)."""

    env: Any
    group: int
    seed: int
    messages: list[dict]
    prompt: list[int]
    anchor: Hashable  # of the state the next action is taken in
    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    step: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    anchors: list[Hashable] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    invalid: int = 0
    cut_turns: int = 0
    success: bool = False
    end: str = ""  # "terminated" | "env_truncated" | "max_turns" | "context"
    index: int = 0  # within its group
    # tree rollouts (rollouts/agent_fork.py); a flat episode is a depth-1 tree of its group
    key: tuple[int, int] | None = (
        None  # (a, b) of its turn seeds (a, b, turn); None: (group, index)
    )
    path: list[int] = field(default_factory=list)  # tree node ids from the root (empty: flat)
    depth: list[int] = field(default_factory=list)  # the tree depth of each completion token
    replay: list[tuple[str, Any]] = field(
        default_factory=list
    )  # (action, observation) per env step

    def __len__(self) -> int:
        return len(self.prompt) + len(self.ids)

    def extend(self, ids: list[int], logp: list[float] | None, step: int) -> None:
        self.ids += ids
        self.sampled += [logp is not None] * len(ids)
        self.logp += logp if logp is not None else [0.0] * len(ids)
        self.step += [step] * len(ids)
        self.depth += [max(len(self.path) - 1, 1)] * len(ids)

    def seed_key(self) -> tuple[int, int]:
        return self.key if self.key is not None else (self.group, self.index)


def _pad(rows: list[torch.Tensor], value: float, side: str) -> torch.Tensor:
    return pad_sequence(rows, batch_first=True, padding_value=value, padding_side=side)


def assemble(episodes: list[Episode], tok: Any, max_turns: int) -> Rollout:
    """The batch of finished episodes as one Rollout (layout: multi_turn.collect_episodes)."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    p_ids = _pad([torch.tensor(e.prompt) for e in episodes], pad, "left")  # [N, P]
    p_mask = _pad([torch.ones(len(e.prompt), dtype=torch.bool) for e in episodes], 0, "left")
    c_ids = _pad([torch.tensor(e.ids) for e in episodes], pad, "right")  # [N, T]
    c_mask = _pad([torch.ones(len(e.ids), dtype=torch.bool) for e in episodes], 0, "right")
    mask = _pad([torch.tensor(e.sampled) for e in episodes], 0, "right")  # [N, T] assistant only
    logp = _pad([torch.tensor(e.logp, dtype=torch.float32) for e in episodes], 0.0, "right")
    step_ids = _pad([torch.tensor(e.step) for e in episodes], -1, "right")  # [N, T]
    step_rewards = torch.full((len(episodes), max_turns), math.nan)  # [N, max_turns]
    for i, e in enumerate(episodes):
        step_rewards[i, : len(e.rewards)] = torch.tensor(e.rewards)
    truncated = torch.tensor([e.end != "terminated" for e in episodes])  # [N]
    returns = torch.tensor([sum(e.rewards) for e in episodes], dtype=torch.float32)  # [N]
    for e, r in zip(episodes, returns.tolist()):
        e.log.append(
            f"**end**: {e.end}, success {e.success}, return {r:+.3f}, turns {len(e.rewards)}, "
            f"invalid actions {e.invalid}\n"
        )
    return Rollout(
        group_ids=torch.tensor([e.group for e in episodes]),  # [N]
        rewards={"return": returns},
        actions=TokenBatch(p_ids, p_mask, c_ids, c_mask, truncated),
        old_logp=logp.clone(),  # [N, T]
        mask=mask,  # [N, T]
        engine_logp=logp,  # [N, T]; 0 on env tokens
        step_ids=step_ids,  # [N, T]; -1 on env tokens and padding
        step_rewards=step_rewards,  # [N, max_turns]; NaN after the episode ended
        anchor_keys=[e.anchors for e in episodes],
        info={
            "transcript": ["\n".join(e.log) for e in episodes],
            "success": [e.success for e in episodes],
            "turns": [len(e.rewards) for e in episodes],
            "invalid_actions": [e.invalid for e in episodes],
            "cut_turns": [e.cut_turns for e in episodes],
            "end_reason": [e.end for e in episodes],
            "seed": [e.seed for e in episodes],
            "messages": [e.messages for e in episodes],
            "prompt": [e.messages[: len(e.messages) - 2 * len(e.rewards)] for e in episodes],
            "completion": tok.batch_decode([e.ids for e in episodes], skip_special_tokens=True),
        },
    )
