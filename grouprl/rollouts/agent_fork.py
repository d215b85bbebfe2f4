"""Tree rollouts of multi-turn agents: a group of episodes sampled as a tree whose nodes are TURNS.

Tree-GRPO (arXiv 2509.21240) samples an agent's group as a tree search over whole agent steps, so
shared prefixes of turns are generated (and their env steps run) once. Here the tree has a fixed
shape, like the text fork (rollouts/fork.py): `branching = [b_1, ..., b_d]` children per node at
each depth and `branch_at = [t_1 < ... < t_{d-1}]` the TURN counts where depth k + 1 starts
(rollout.tree fixed; branch_at counts turns for the agent workload, not tokens). A group starts as
b_1 episodes; before turn t_k every episode is forked into b_{k+1} children that continue it
independently, so a group has G = b_1 * ... * b_d leaf episodes, the Rollout's rows.

A node is the episode state after some turns: the env state plus the token history. Forking
copies the record (tokens, messages, rewards, anchors) and re-creates the env by REPLAY: a fresh
env from the same factory, reset with the episode's seed, stepped with the recorded actions
(only the turns the env answered; turns answered by the rollout's tools do not step it). Replay
is exact for every env whose dynamics are a function of (reset seed, actions), gymnasium's
contract for seeded resets (a slippery FrozenLake's draws come from the seeded np_random), and
works for envs that live in their own process (copy.deepcopy cannot copy those). Each replayed
observation is compared with the recorded one, and a mismatch fails loudly (the env is not
deterministic given its seed). An episode that ended before a branch point is copied into all
its branches (not sampled again): marginally still a sample of the policy, as in the text fork.

Seeds (rollout.seeding per_sample): turn t of an episode with seed key (a, b) samples from
generator (seed, a, b, t); the b_1 root children of group g have keys (g, j), exactly the flat
episodes' (group, index), so a tree of depth 1 IS the flat group; child j of a deeper node n has
key (-1 - n, j) (never a group id). A tree does not depend on the batch around it.

What the Rollout records (as the text fork; node ids = group id * NODES_PER_TREE + index):
  tree_path     Long[N, D+1]  node ids along each row's path, -1 past a finished path's depth
  tree_segment  Long[N, T]    the depth (1..D) of the turn holding each completion slot; the
                              environment tokens that follow a turn belong to its node (they are
                              masked), -1 on padding
  generated     Long[N]       policy tokens (mask True) this row sampled itself: a shared node's
                              turns count at the first row through it
Deviations from Tree-GRPO: its trees grow by random expansion (M trees, L rounds that each expand
N sampled nodes to a full completion); ours have a fixed shape with branch points at fixed turn
counts, as rollouts/fork.py has for text.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from grouprl.rollouts.episode_record import Episode
from grouprl.rollouts.fork import NODES_PER_TREE, check_tree


def check_turn_tree(branching: list[int], branch_at: list[int], max_turns: int) -> None:
    """One error naming the options when an agent tree's shape cannot work."""
    check_tree(branching, branch_at, max_turns, unit="turn counts", limit_option="agent.max_turns")


def root_episodes(env_of: Callable[[], Any], group: int, seed: int, b: int) -> list[Episode]:
    """The b_1 first-depth episodes of one group's tree (keys (group, j), paths [root, node])."""
    root = group * NODES_PER_TREE
    return [
        Episode(env_of(), group, seed, [], [], None, index=j, path=[root, root + 1 + j])
        for j in range(b)
    ]


class Forker:
    """Forks the episodes of a batch of trees at a branch point (see the module docstring).
    env_of: makes a fresh env (the rollout's factory); counters: next node index per group."""

    def __init__(self, env_of: Callable[[], Any], first_counts: dict[int, int]) -> None:
        self.env_of, self.counters = env_of, dict(first_counts)

    def fork(self, episodes: list[Episode], b: int) -> list[Episode]:
        """Each episode replaced (in place, so rows stay in tree order) by b children: a live one
        by b independent continuations, a finished one by b copies of itself."""
        out: list[Episode] = []
        for e in episodes:
            if e.end:
                out += [_copy_record(e, e.env) for _ in range(b)]
                continue
            node = e.path[-1]
            for j in range(b):
                child = _copy_record(e, self._replay(e))
                index = self.counters[e.group]
                self.counters[e.group] += 1
                child.path = [*e.path, e.group * NODES_PER_TREE + index]
                child.key = (-1 - node, j)
                out.append(child)
            close = getattr(e.env, "close", None)  # the children hold envs of their own now (a
            if callable(close):  # process env would otherwise outlive its episode)
                close()
        return out

    def _replay(self, e: Episode) -> Any:
        env = self.env_of()
        env.reset(seed=e.seed)
        for turn, (action, seen) in enumerate(e.replay):
            obs = env.step(action)[0]
            if obs != seen:
                raise RuntimeError(
                    f"rollout.tree: replaying episode seed {e.seed} gave a different observation "
                    f"at its env step {turn} ({obs!r} != {seen!r}); agent tree rollouts re-create "
                    "an env by seed and actions, so the env must be deterministic given both"
                )
        return env


def _copy_record(e: Episode, env: Any) -> Episode:
    """A copy of the episode's record (its own lists and messages) holding `env`."""
    held, e.env = e.env, None
    try:
        child = copy.deepcopy(e)
    finally:
        e.env = held
    child.env = env
    return child


def tree_fields(episodes: list[Episode], depth: int) -> dict[str, torch.Tensor]:
    """tree_path Long[N, D+1], tree_segment Long[N, T] and generated Long[N] of the leaves."""
    width = max((len(e.ids) for e in episodes), default=0)
    path = torch.full((len(episodes), depth + 1), -1, dtype=torch.long)  # [N, D+1]
    segment = torch.full((len(episodes), width), -1, dtype=torch.long)  # [N, T]
    seen: set[int] = set()
    generated = []
    for i, e in enumerate(episodes):
        path[i, : len(e.path)] = torch.tensor(e.path)
        segment[i, : len(e.depth)] = torch.tensor(e.depth, dtype=torch.long)
        own = 0
        for d, node in enumerate(e.path[1:], start=1):
            if node not in seen:
                seen.add(node)
                own += sum(s and k == d for s, k in zip(e.sampled, e.depth))
        generated.append(own)
    return {
        "tree_path": path,
        "tree_segment": segment,
        "generated": torch.tensor(generated, dtype=torch.long),  # [N]
    }
