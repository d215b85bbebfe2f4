"""Text FrozenLake: gymnasium's FrozenLake-v1 seen as a small text grid.

The agent reads the map as rows of letters (S start, F frozen, H hole, G goal) with its own cell
shown as P, e.g. "PFFF\\nFHFH\\nFFFH\\nHFFG", and answers `<action>left|down|right|up</action>`.
Reward 1 on reaching G, else 0; falling into a hole ends the episode. RAGEN (arXiv 2504.20073)
uses FrozenLake as a multi-turn agent task; this version keeps the observation to the grid alone
so a tiny character-level model can read it.

Deviations from gymnasium's env: not slippery by default (`is_slippery=True` restores its dynamics);
truncation after `max_steps` agent turns (default 20; invalid turns count) instead of TimeLimit(100);
`random_map=True` draws a solvable map per reset from the reset seed (one map per group).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Literal

import gymnasium
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv, generate_random_map

from grouprl.envs.gym import TextEnvWrapper

ACTIONS = ["left", "down", "right", "up"]  # gymnasium's FrozenLake action order 0..3
MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}


def _rows(env: gymnasium.Env) -> tuple[str, ...]:
    """The map as row strings (gymnasium keeps it as a bytes array)."""
    return tuple(b"".join(row).decode() for row in env.unwrapped.desc)


def render_frozenlake(obs: int, env: gymnasium.Env) -> str:
    """The grid with the agent's cell shown as P (`obs` is FrozenLake's flat state index)."""
    rows = [list(r) for r in _rows(env)]
    r, c = divmod(int(obs), len(rows[0]))
    rows[r][c] = "P"
    return "\n".join("".join(row) for row in rows)


def frozenlake_anchor(obs: int, env: gymnasium.Env) -> tuple[tuple[str, ...], tuple[int, int]]:
    """Exact state key for GiGPO: (map rows, (row, col) of the agent)."""
    rows = _rows(env)
    return rows, divmod(int(obs), len(rows[0]))


def shortest_path(rows: tuple[str, ...] | list[str], start: tuple[int, int]) -> list[str] | None:
    """Breadth-first shortest action list from `start` to G avoiding holes (non-slippery moves).

    A move off the grid leaves the agent in place, so it never lies on a shortest path.
    Returns None when G cannot be reached.
    """
    n_rows, n_cols = len(rows), len(rows[0])
    prev: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if rows[cell[0]][cell[1]] == "G":
            path = []
            while prev[cell] is not None:
                cell, move = prev[cell]
                path.append(move)
            return path[::-1]
        if rows[cell[0]][cell[1]] == "H":
            continue
        for name in ACTIONS:
            dr, dc = MOVES[name]
            nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= nxt[0] < n_rows and 0 <= nxt[1] < n_cols and nxt not in prev:
                prev[nxt] = (cell, name)
                queue.append(nxt)
    return None


class TextFrozenLakeEnv(TextEnvWrapper):
    """gymnasium FrozenLake-v1 as a text env (registered as "grouprl/FrozenLake-v0").

    is_slippery: gymnasium's slippery ice (the move goes sideways with probability 2/3)
    map_name:    gymnasium's fixed "4x4" (default) or "8x8" map; ignored when random_map
    random_map:  draw a new solvable size x size map at each reset from the reset seed
    size:        side of the random map
    frozen_prob: probability that a random-map tile is frozen (not a hole)
    max_steps:   truncate after this many turns (invalid turns included)
    system_prompt: replaces the default instructions (e.g. a short one for a tiny model: every
                 prompt character is a token the model reads on every turn)
    """

    def __init__(
        self,
        is_slippery: bool = False,
        map_name: Literal["4x4", "8x8"] = "4x4",
        random_map: bool = False,
        size: int = 4,
        frozen_prob: float = 0.8,
        max_steps: int = 20,
        system_prompt: str | None = None,
        render_mode: str | None = None,
    ) -> None:
        if map_name not in ("4x4", "8x8"):
            raise ValueError(f"map_name must be '4x4' or '8x8', got {map_name!r}")
        if size < 2:
            raise ValueError(f"size must be >= 2, got {size}")
        self.is_slippery, self.random_map = is_slippery, random_map
        self.size, self.frozen_prob = size, frozen_prob
        desc = generate_random_map(size, frozen_prob, seed=0) if random_map else None
        inner = FrozenLakeEnv(desc=desc, map_name=map_name, is_slippery=is_slippery)
        rows = _rows(inner)  # random maps keep this shape, so the Text space bound holds for all
        slip = " The ice is slippery: a move may go sideways." if is_slippery else ""
        prompt = (
            "FrozenLake. The grid shows S start, F frozen ice, H hole, G goal and P you. "
            f"Walk to G without stepping into a hole.{slip} Reply with one move: "
            "<action>left</action>, <action>down</action>, <action>right</action> or "
            "<action>up</action>."
        )
        super().__init__(
            inner,
            render_frozenlake,
            ACTIONS,
            system_prompt=prompt if system_prompt is None else system_prompt,
            anchor_fn=frozenlake_anchor,
            max_steps=max_steps,
            max_obs_chars=len(rows) * (len(rows[0]) + 1),
            render_mode=render_mode,
        )

    def _reset_inner(self, seed: int, options: dict | None) -> tuple[Any, dict]:
        if self.random_map:  # the map follows the reset seed, so one seed = one map for the group
            desc = generate_random_map(self.size, self.frozen_prob, seed=seed)
            self.env = FrozenLakeEnv(desc=desc, is_slippery=self.is_slippery)
        return self.env.reset(seed=seed, options=options)

    def optimal_actions(self) -> list[str] | None:
        """Shortest move list from the current cell to G (non-slippery dynamics), e.g. for SFT."""
        r, c = divmod(int(self.env.unwrapped.s), self.env.unwrapped.ncol)
        return shortest_path(_rows(self.env), (r, c))
