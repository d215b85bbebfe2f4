"""Sokoban-lite: one box, one target, a small walled room; generated solvable, seen as text.

Puzzles are made by playing backwards from the solved state (box on target): the player walks
and *pulls* the box with a seeded RNG. Every reverse move undoes to a legal forward move (a pull
undoes to a push), so every generated puzzle is solvable. This is the idea behind the generator of
gym-sokoban that RAGEN (arXiv 2504.20073) and verl-agent (arXiv 2505.10978) train on; here it is
reduced to one box and a few random inner walls, with no extra package.

Text view (one row per line): # wall, _ floor, T target, B box, P player, * box on target,
+ player on target. Actions: `<action>left|down|right|up</action>` (FrozenLake's order); walking
into a wall, or pushing the box into a wall or off the room, leaves the state unchanged (a valid
action that does nothing). Reward 1 when the box reaches the target (episode ends), minus
`step_penalty` on every valid move. A box pushed into a dead corner is not detected: the episode
runs until `max_steps` (truncation).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import gymnasium
import numpy as np
from gymnasium import spaces

from grouprl.envs.gym import TextEnvWrapper

Cell = tuple[int, int]
ACTIONS = ["left", "down", "right", "up"]
MOVES: dict[str, Cell] = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
WALL, FLOOR, TARGET, BOX, PLAYER, BOX_ON_TARGET, PLAYER_ON_TARGET = range(7)
CHARS = "#_TBP*+"  # CHARS[code] is the text of a cell code
PULL_PROB = 0.8  # chance that a reverse move with the box behind the player pulls it along


def _add(a: Cell, b: Cell) -> Cell:
    return a[0] + b[0], a[1] + b[1]


@dataclass(frozen=True)
class Puzzle:
    """One Sokoban-lite state. walls: blocked cells (the room border included)."""

    size: int
    walls: frozenset[Cell]
    target: Cell
    box: Cell
    player: Cell

    def grid(self) -> np.ndarray:  # Int8[size, size] cell codes
        g = np.full((self.size, self.size), FLOOR, dtype=np.int8)  # [S, S]
        for cell in self.walls:
            g[cell] = WALL
        g[self.target] = TARGET
        g[self.box] = BOX_ON_TARGET if self.box == self.target else BOX
        g[self.player] = PLAYER_ON_TARGET if self.player == self.target else PLAYER
        return g

    def text(self) -> str:
        return "\n".join("".join(CHARS[v] for v in row) for row in self.grid().tolist())

    @property
    def solved(self) -> bool:
        return self.box == self.target


def move(walls: frozenset[Cell], box: Cell, player: Cell, action: str) -> tuple[Cell, Cell]:
    """Forward move: returns (box, player) after `action`; a blocked move changes nothing."""
    d = MOVES[action]
    nxt = _add(player, d)
    if nxt in walls:
        return box, player
    if nxt == box:
        beyond = _add(box, d)
        if beyond in walls:
            return box, player
        return beyond, nxt
    return box, nxt


def solve(puzzle: Puzzle) -> list[str] | None:
    """Breadth-first shortest action list that puts the box on the target (None if unsolvable)."""
    start = (puzzle.box, puzzle.player)
    prev: dict[tuple[Cell, Cell], tuple[tuple[Cell, Cell], str] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if state[0] == puzzle.target:
            path = []
            while prev[state] is not None:
                state, action = prev[state]
                path.append(action)
            return path[::-1]
        for action in ACTIONS:
            nxt = move(puzzle.walls, *state, action)
            if nxt not in prev:
                prev[nxt] = (state, action)
                queue.append(nxt)
    return None


def _connected(free: set[Cell]) -> bool:
    start = next(iter(free))
    seen, queue = {start}, deque([start])
    while queue:
        cell = queue.popleft()
        for d in MOVES.values():
            nxt = _add(cell, d)
            if nxt in free and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return len(seen) == len(free)


def generate_puzzle(
    rng: np.random.Generator,
    size: int = 6,
    n_walls: int = 1,
    reverse_steps: int = 12,
    max_tries: int = 1000,
) -> Puzzle:
    """A solvable puzzle: room of size x size (border walls), `n_walls` inner walls, reverse play.

    The box starts on the target with the player beside it; `reverse_steps` random reverse moves
    follow (a move with the box right behind the player pulls it with probability PULL_PROB).
    Tries again (same RNG stream, so still deterministic) while the box ends on the target.
    """
    interior = [(r, c) for r in range(1, size - 1) for c in range(1, size - 1)]
    if size < 4 or not 0 <= n_walls <= len(interior) - 3:
        raise ValueError(f"need size >= 4 and 0 <= n_walls <= {len(interior) - 3}")
    border = {(r, c) for r in range(size) for c in range(size)} - set(interior)
    for _ in range(max_tries):
        picks = rng.choice(len(interior), size=n_walls, replace=False)
        walls = frozenset(border | {interior[i] for i in picks.tolist()})
        free = set(interior) - walls
        if not _connected(free):
            continue
        cells = sorted(free)
        box = cells[int(rng.integers(len(cells)))]
        beside = [_add(box, d) for d in MOVES.values() if _add(box, d) in free]
        if not beside:
            continue
        target, player = box, beside[int(rng.integers(len(beside)))]
        for _ in range(reverse_steps):
            d = MOVES[ACTIONS[int(rng.integers(4))]]
            nxt = _add(player, d)
            if nxt in walls or nxt == box:
                continue
            behind = (player[0] - d[0], player[1] - d[1])
            if box == behind and rng.random() < PULL_PROB:
                box = player  # pull: the box follows the player one cell
            player = nxt
        if box != target:
            return Puzzle(size=size, walls=walls, target=target, box=box, player=player)
    raise RuntimeError(f"no puzzle with the box off its target in {max_tries} tries; raise it")


class SokobanLiteEnv(gymnasium.Env):
    """The numeric env: Discrete(4) actions (left, down, right, up), Int8[size, size] grid codes."""

    metadata = {"render_modes": []}

    def __init__(
        self, size: int = 6, n_walls: int = 1, reverse_steps: int = 12, step_penalty: float = 0.0
    ) -> None:
        generate_puzzle(np.random.default_rng(0), size, n_walls, reverse_steps)  # fail early
        self.size, self.n_walls, self.reverse_steps = size, n_walls, reverse_steps
        self.step_penalty = float(step_penalty)
        self.observation_space = spaces.Box(0, len(CHARS) - 1, (size, size), dtype=np.int8)
        self.action_space = spaces.Discrete(4)
        self.puzzle: Puzzle | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.puzzle = generate_puzzle(self.np_random, self.size, self.n_walls, self.reverse_steps)
        return self.puzzle.grid(), {}

    def step(self, action: int):
        p = self.puzzle
        box, player = move(p.walls, p.box, p.player, ACTIONS[int(action)])
        self.puzzle = Puzzle(p.size, p.walls, p.target, box, player)
        solved = self.puzzle.solved
        reward = float(solved) - self.step_penalty
        return self.puzzle.grid(), reward, solved, False, {}


def render_sokoban(obs: np.ndarray, env: gymnasium.Env) -> str:
    """Rows of cell characters from the grid codes `obs` ([size, size])."""
    return "\n".join("".join(CHARS[v] for v in row) for row in np.asarray(obs).tolist())


class TextSokobanEnv(TextEnvWrapper):
    """Sokoban-lite as a text env (registered as "grouprl/Sokoban-v0").

    size:          room side including the border walls (6 -> a 4x4 interior)
    n_walls:       random inner walls (the free cells always stay connected)
    reverse_steps: length of the reverse play that scrambles the solved room (difficulty)
    step_penalty:  subtracted from the reward of every valid move (e.g. 0.01)
    max_steps:     truncate after this many turns (invalid turns included)
    The anchor (GiGPO state key) is the observation text: it fixes the box and player cells.
    """

    def __init__(
        self,
        size: int = 6,
        n_walls: int = 1,
        reverse_steps: int = 12,
        step_penalty: float = 0.0,
        max_steps: int = 20,
        render_mode: str | None = None,
    ) -> None:
        prompt = (
            "Sokoban. The grid shows # wall, _ floor, T target, B box, P you, * box on target, "
            "+ you on target. Push the box onto the target: walking into the box pushes it one "
            "cell. Reply with one move: <action>left</action>, <action>down</action>, "
            "<action>right</action> or <action>up</action>."
        )
        super().__init__(
            SokobanLiteEnv(size, n_walls, reverse_steps, step_penalty),
            render_sokoban,
            ACTIONS,
            system_prompt=prompt,
            max_steps=max_steps,
            max_obs_chars=size * (size + 1),
            render_mode=render_mode,
        )

    @property
    def puzzle(self) -> Puzzle | None:
        return self.env.unwrapped.puzzle

    def optimal_actions(self) -> list[str] | None:
        """Shortest move list from the current state (None if the box is stuck), e.g. for SFT."""
        if self.puzzle is None:
            raise RuntimeError("call reset() first")
        return solve(self.puzzle)
