"""Text envs: registration, TextEnvWrapper contract, FrozenLake and Sokoban-lite, check_text_env."""

from __future__ import annotations

import importlib.util
import warnings
from collections import deque

import gymnasium
import numpy as np
import pytest

from grouprl.envs.frozenlake import TextFrozenLakeEnv, shortest_path
from grouprl.envs.gym import (
    ENV_IDS,
    PlainTextEnv,
    TextEnvWrapper,
    check_text_env,
    make_text_env,
    register_envs,
)
from grouprl.envs.sokoban import Puzzle, TextSokobanEnv, generate_puzzle, move, solve

MAP4 = ("SFFF", "FHFH", "FFFH", "HFFG")


def act(name: str) -> str:
    return f"<action>{name}</action>"


# -- registration and make ------------------------------------------------------------------------


@pytest.mark.parametrize("env_id", sorted(ENV_IDS))
def test_registered_ids_make(env_id):
    if (
        env_id == "grouprl/ToolMath-v0"
        and importlib.util.find_spec("grouprl.envs.toolmath") is None
    ):
        pytest.skip("grouprl/envs/toolmath.py is not in the tree yet")
    env = gymnasium.make(env_id)  # the plain gymnasium route (with its passive checker)
    obs, info = env.reset(seed=0)
    assert isinstance(obs, str) and obs and isinstance(info, dict)
    ours = make_text_env(env_id)  # our route: the env itself, attributes readable
    assert isinstance(ours.system_prompt, str) and ours.system_prompt
    assert ours.reset(seed=0)[0] == obs


def test_register_is_idempotent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # gymnasium warns when an id is registered twice
        register_envs()
        register_envs()
    assert all(env_id in gymnasium.registry for env_id in ENV_IDS)


def test_make_text_env_module_class_paths():
    env = make_text_env("grouprl.envs.sokoban:TextSokobanEnv", size=5, max_steps=7)
    assert isinstance(env, TextSokobanEnv) and env.max_steps == 7
    assert env.reset(seed=0)[0].count("\n") == 4  # 5 rows
    plain = make_text_env(f"{__name__}:EchoEnv")
    assert isinstance(plain, PlainTextEnv) and plain.system_prompt == "Say anything."
    assert plain.reset(seed=1) == ("start 1", {"anchor": 0})
    with pytest.raises(ValueError, match="has no 'Nope'"):
        make_text_env("grouprl.envs.sokoban:Nope")


def test_make_text_env_rejects_non_text_env():
    with pytest.raises(TypeError, match="TextEnvWrapper"):
        make_text_env("FrozenLake-v1")


# -- TextEnvWrapper over any discrete gymnasium env -----------------------------------------------


def test_wrapper_validates_action_space_and_names():
    inner = gymnasium.make("FrozenLake-v1")
    with pytest.raises(ValueError, match="4 distinct"):
        TextEnvWrapper(inner, lambda o, e: str(o), ["a", "b"], system_prompt="x")
    with pytest.raises(ValueError, match="4 distinct"):
        TextEnvWrapper(inner, lambda o, e: str(o), ["a", "A", "b", "c"], system_prompt="x")
    with pytest.raises(TypeError, match="Discrete"):
        TextEnvWrapper(gymnasium.make("Pendulum-v1"), str, ["x"], system_prompt="x")


def test_wrapper_over_plain_gymnasium_env():
    # gymnasium's own FrozenLake (TimeLimit 100, slippery) seen through state numbers
    inner = gymnasium.make("FrozenLake-v1", is_slippery=False)
    env = TextEnvWrapper(
        inner, lambda o, e: f"cell {o}", ["W", "S", "E", "N"], system_prompt="Go.", max_steps=3
    )
    obs, info = env.reset(seed=0)
    assert obs == "cell 0" and info["anchor"] == "cell 0"
    assert env.step(act("e"))[:4] == ("cell 1", 0.0, False, False)
    assert env.step("no tag")[:4] == ("cell 1", 0.0, False, False)
    obs, reward, term, trunc, info = env.step(act("s"))  # third turn hits max_steps
    assert (obs, term, trunc, info["success"]) == ("cell 5", True, False, False)  # hole, not trunc
    env.reset(seed=0)
    for _ in range(2):
        assert env.step(act("n"))[3] is False
    assert env.step(act("n"))[3] is True  # bumping the wall 3 times: truncated at max_steps
    with pytest.raises(RuntimeError, match="reset"):
        env.step(act("n"))


# -- FrozenLake -----------------------------------------------------------------------------------


def test_frozenlake_text_view_and_anchor():
    env = TextFrozenLakeEnv()
    obs, info = env.reset(seed=0)
    assert obs == "PFFF\nFHFH\nFFFH\nHFFG"
    assert info["anchor"] == (MAP4, (0, 0)) and info["success"] is False
    obs, reward, term, trunc, info = env.step("I go " + act("right"))
    assert obs == "SPFF\nFHFH\nFFFH\nHFFG" and info["anchor"] == (MAP4, (0, 1))
    assert (reward, term, trunc, info["valid_action"]) == (0.0, False, False, True)
    obs, reward, term, _, info = env.step(act("down"))  # (1, 1) is a hole
    assert obs == "SFFF\nFPFH\nFFFH\nHFFG" and term and reward == 0.0 and not info["success"]


def test_frozenlake_scripted_optimal_path_succeeds():
    path = ["down", "down", "right", "right", "down", "right"]  # (0,0)->(2,0)->(2,2)->(3,3)
    assert len(shortest_path(MAP4, (0, 0))) == 6
    env = TextFrozenLakeEnv()
    env.reset(seed=3)
    assert env.optimal_actions() is not None and len(env.optimal_actions()) == 6
    rewards = []
    for name in path:
        obs, reward, term, trunc, info = env.step(act(name.upper()))  # case does not matter
        rewards.append(reward)
    assert rewards == [0.0] * 5 + [1.0]
    assert term and not trunc and info["success"] and obs == "SFFF\nFHFH\nFFFH\nHFFP"


def test_frozenlake_truncates_at_max_steps():
    env = TextFrozenLakeEnv(max_steps=20)
    env.reset(seed=0)
    flags = [env.step(act("left") if t % 2 else "???")[3] for t in range(20)]
    assert flags == [False] * 19 + [True]  # invalid turns count toward max_steps


def test_frozenlake_random_map_follows_seed():
    a, b = TextFrozenLakeEnv(random_map=True), TextFrozenLakeEnv(random_map=True)
    maps = {a.reset(seed=s)[0] for s in range(8)}
    assert len(maps) > 1  # different seeds, different maps
    for s in range(8):
        obs_a, info_a = a.reset(seed=s)
        obs_b, info_b = b.reset(seed=s)
        assert obs_a == obs_b and info_a["anchor"] == info_b["anchor"]
        assert a.optimal_actions() is not None  # gymnasium draws only solvable maps


def test_slippery_episode_is_fixed_by_the_seed():
    def play(seed):
        env = TextFrozenLakeEnv(is_slippery=True)
        env.reset(seed=seed)
        out = []
        for name in ["right", "down", "right", "down", "right", "down"]:
            obs, _, term, trunc, _ = env.step(act(name))
            out.append(obs)
            if term or trunc:
                break
        return out

    runs = [play(s) for s in range(6)]
    assert runs == [play(s) for s in range(6)]
    assert len({tuple(r) for r in runs}) > 1  # the ice really is slippery


@pytest.mark.parametrize("env_cls", [TextFrozenLakeEnv, TextSokobanEnv])
@pytest.mark.parametrize("bad", ["left", "<action>jump</action>", "<action></action>", ""])
def test_invalid_action_does_not_move(env_cls, bad):
    env = env_cls()
    obs, info = env.reset(seed=5)
    obs2, reward, term, trunc, info2 = env.step(bad)
    assert (obs2, reward, term, trunc) == (obs, 0.0, False, False)
    assert info2["valid_action"] is False and info2["anchor"] == info["anchor"]
    assert info2["error"]


# -- Sokoban-lite ---------------------------------------------------------------------------------


def _room(size: int) -> frozenset:
    return frozenset(
        (r, c) for r in range(size) for c in range(size) if min(r, c) == 0 or max(r, c) == size - 1
    )


def test_sokoban_moves_and_view_by_hand():
    walls = _room(4)  # interior (1,1) (1,2) (2,1) (2,2)
    p = Puzzle(size=4, walls=walls, target=(1, 1), box=(1, 2), player=(2, 2))
    assert p.text() == "####\n#TB#\n#_P#\n####"
    assert move(walls, p.box, p.player, "up") == ((1, 2), (2, 2))  # box against the wall: no move
    assert move(walls, p.box, p.player, "right") == ((1, 2), (2, 2))  # wall
    assert move(walls, p.box, p.player, "left") == ((1, 2), (2, 1))
    on_target = Puzzle(4, walls, (1, 1), (1, 2), (1, 1))
    assert on_target.text() == "####\n#+B#\n#__#\n####"
    assert Puzzle(4, walls, (1, 1), (1, 1), (2, 1)).text() == "####\n#*_#\n#P_#\n####"
    assert solve(Puzzle(5, _room(5), (1, 1), (1, 2), (1, 3))) == ["left"]
    assert solve(p) is None  # the box is stuck in the top-right corner


def test_sokoban_rewards_and_step_penalty():
    env = TextSokobanEnv(step_penalty=0.01)
    env.reset(seed=3)
    plan = env.optimal_actions()
    rewards = [env.step(act(a))[1] for a in plan]
    assert rewards == pytest.approx([-0.01] * (len(plan) - 1) + [0.99])


def _bfs_text(text: str) -> int | None:
    """Independent solver on the text view: shortest number of moves to put B on T."""
    rows = text.split("\n")
    cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
    walls = {k for k, ch in cells.items() if ch == "#"}
    target = next(k for k, ch in cells.items() if ch in "T*+")
    box = next(k for k, ch in cells.items() if ch in "B*")
    player = next(k for k, ch in cells.items() if ch in "P+")
    seen, queue = {(box, player)}, deque([(box, player, 0)])
    while queue:
        box, player, n = queue.popleft()
        if box == target:
            return n
        for dr, dc in [(0, 1), (0, -1), (1, 0), (-1, 0)]:
            nxt = (player[0] + dr, player[1] + dc)
            new_box = box
            if nxt == box:
                new_box = (box[0] + dr, box[1] + dc)
            if nxt in walls or new_box in walls or (new_box, nxt) in seen:
                continue
            seen.add((new_box, nxt))
            queue.append((new_box, nxt, n + 1))
    return None


@pytest.mark.parametrize("size,n_walls", [(5, 0), (5, 2), (6, 1), (6, 3)])
def test_sokoban_generated_puzzles_are_solvable(size, n_walls):
    env = TextSokobanEnv(size=size, n_walls=n_walls, max_steps=50)
    for seed in range(25):
        obs, _ = env.reset(seed=seed)
        assert len(obs) == size * (size + 1) - 1 and obs.count("B") == 1  # box off the target
        n = _bfs_text(obs)
        plan = env.optimal_actions()
        assert n is not None and n >= 1 and len(plan) == n
        for a in plan:
            obs, reward, term, trunc, info = env.step(act(a))
        assert term and reward == 1.0 and info["success"] and "*" in obs


def test_sokoban_seed_determinism():
    a, b = TextSokobanEnv(), TextSokobanEnv()
    starts = [a.reset(seed=s)[0] for s in range(10)]
    assert starts == [b.reset(seed=s)[0] for s in range(10)]
    assert len(set(starts)) > 5
    p1 = generate_puzzle(np.random.default_rng(7))
    assert p1 == generate_puzzle(np.random.default_rng(7))


# -- conformance ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: make_text_env("grouprl/FrozenLake-v0"),
        lambda: make_text_env("grouprl/FrozenLake-v0", random_map=True, is_slippery=True),
        lambda: make_text_env("grouprl/Sokoban-v0"),
        lambda: make_text_env("grouprl/Sokoban-v0", size=5, step_penalty=0.01),
    ],
)
def test_check_text_env_passes_for_shipped_envs(make):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # gymnasium's checker reports problems as warnings too
        check_text_env(make())


class EchoEnv:
    """A plain (non-gymnasium) text env; it wrongly treats every text as a valid action."""

    system_prompt = "Say anything."

    def reset(self, seed=None):
        self.t = 0
        return f"start {seed}", {"anchor": 0}

    def step(self, action):
        self.t += 1
        return f"heard {action}", 0.0, False, self.t >= 3, {"valid_action": True, "anchor": self.t}


def test_check_text_env_catches_broken_envs():
    with pytest.raises(AssertionError, match="valid_action False"):
        check_text_env(PlainTextEnv(EchoEnv()), gymnasium_check=False)

    class Drifting(TextSokobanEnv):  # ignores the seed: every reset is a new puzzle
        def reset(self, *, seed=None, options=None):
            return super().reset(seed=None, options=options)

    with pytest.raises(AssertionError, match="not deterministic"):
        check_text_env(Drifting(), gymnasium_check=False)
