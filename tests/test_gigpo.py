"""grouprl.objectives.gigpo: discounted returns, episode / anchor-step advantages, GiGPO, credit
modes, token broadcast and the StarPO-S group filter. Expected values are worked out by hand in
the comments (sample std = unbiased, /(n-1))."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

from grouprl.objectives.gigpo import (
    CREDIT,
    agent_advantages,
    broadcast_to_tokens,
    discounted_returns,
    episode_advantages,
    gigpo_advantages,
    keep_top_groups_by_std,
    step_advantages,
)

NAN = float("nan")


def close(a, b, atol=1e-5):
    b = torch.as_tensor(b, dtype=a.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, atol=atol, equal_nan=True), (a, b)


# ----------------------------------------------------------------------------- discounted returns


def test_discounted_returns_hand():
    sr = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, NAN], [NAN, NAN, NAN]])
    # gamma 0.5, row 0: R2 = 2, R1 = 0 + 0.5*2 = 1, R0 = 1 + 0.5*1 = 1.5; row 1: R1 = 1, R0 = 0.5
    close(discounted_returns(sr, 0.5), [[1.5, 1.0, 2.0], [0.5, 1.0, NAN], [NAN, NAN, NAN]])
    # default gamma 0.95, success only at the end: [0.95^2, 0.95, 1] = [0.9025, 0.95, 1]
    close(discounted_returns(torch.tensor([[0.0, 0.0, 1.0]])), [[0.9025, 0.95, 1.0]])
    # gamma 1: plain reward-to-go
    close(discounted_returns(torch.tensor([[1.0, 2.0, 3.0]]), 1.0), [[6.0, 5.0, 3.0]])


def test_discounted_returns_rejects_holes_and_inf():
    with pytest.raises(ValueError, match="rows \\[0\\] have NaN before a valid turn"):
        discounted_returns(torch.tensor([[1.0, NAN, 1.0], [1.0, 1.0, NAN]]))
    with pytest.raises(ValueError, match="inf"):
        discounted_returns(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="Float\\[N, K\\]"):
        discounted_returns(torch.tensor([1.0, 2.0]))


# ----------------------------------------------------------------------------- episode advantages


def test_episode_advantages_hand():
    r = torch.tensor([3.0, 1.0, 2.0, 2.0, 7.0, 4.0, NAN, 6.0])
    g = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3])
    # group 0: mean 2, sample std sqrt((1 + 1) / 1) = sqrt(2) -> +-1/(sqrt 2 + 1e-6)
    # group 1: all equal -> 0; group 2: singleton -> 0; group 3: NaN left out, {4, 6} -> -+1/sqrt 2
    s = 1 / (math.sqrt(2) + 1e-6)
    close(episode_advantages(r, g), [s, -s, 0, 0, 0, -s, 0, s])
    close(episode_advantages(r, g, "mean_norm"), [1, -1, 0, 0, 0, -1, 0, 1])
    with pytest.raises(ValueError, match="allowed are mean_std_norm, mean_norm"):
        episode_advantages(r, g, "std")


# ----------------------------------------------------------------------------- step advantages


def test_step_groups_never_cross_episode_groups():
    step_returns = torch.tensor([[0.5, 1.0], [0.0, 0.0], [3.0, NAN], [5.0, NAN]])
    anchors = [["s0", "s1"], ["s0", "s2"], ["s0"], ["s1"]]
    groups = torch.tensor([0, 0, 1, 1])
    # group 0, anchor s0: {0.5, 0}: mean 0.25, sample std sqrt(2 * 0.0625) = 0.353553 -> +-0.707105
    # (0, s1), (0, s2): singletons -> 0. Group 1 has s0 and s1 once each: singletons -> 0, even
    # though group 0 also saw s0 and s1.
    a = 0.25 / (math.sqrt(0.125) + 1e-6)
    out = step_advantages(step_returns, anchors, groups)
    close(out, [[a, 0.0], [-a, 0.0], [0.0, NAN], [0.0, NAN]])
    close(
        step_advantages(step_returns, anchors, groups, "mean_norm"),
        [[0.25, 0], [-0.25, 0], [0, NAN], [0, NAN]],
    )


def test_repeated_anchor_within_one_trajectory_shares_a_step_group():
    # an invalid action leaves the state unchanged: turns 0 and 1 of trajectory 0 both act in "s"
    step_returns = torch.tensor([[1.0, 3.0], [2.0, NAN]])
    out = step_advantages(step_returns, [["s", "s"], ["s"]], torch.tensor([0, 0]), "mean_norm")
    close(out, [[-1.0, 1.0], [0.0, NAN]])  # mean of {1, 3, 2} = 2


def test_anchor_conversion_and_errors():
    sr = torch.tensor([[1.0], [2.0], [4.0]])
    g = torch.tensor([0, 0, 0])
    # arrays and tensors are compared by shape and values: the first two are the same state
    anchors = [[np.array([[1, 2]])], [torch.tensor([[1, 2]])], [np.array([[1, 3]])]]
    close(step_advantages(sr, anchors, g, "mean_norm"), [[-0.5], [0.5], [0.0]])  # {1, 2}, {4}
    # dicts (with list values) are compared by value: one step group {1, 2, 4}, mean 7/3
    anchors = [[{"a": [1], "b": 0}], [{"b": 0, "a": [1]}], [{"a": [1], "b": 0}]]
    close(step_advantages(sr, anchors, g, "mean_norm"), [[-4 / 3], [-1 / 3], [5 / 3]])

    class Unhashable:
        __hash__ = None

    with pytest.raises(TypeError, match="trajectory 1: anchor is not hashable"):
        step_advantages(sr, [["a"], [Unhashable()], ["a"]], g)
    with pytest.raises(ValueError, match="trajectory 0: 2 anchors but 1 valid turns"):
        step_advantages(sr, [["a", "b"], ["a"], ["a"]], g)
    with pytest.raises(ValueError, match="one anchor list and one group id per trajectory"):
        step_advantages(sr, [["a"]], g)


# ----------------------------------------------------------------------------- GiGPO


def _lake():
    """Three episodes from start S (one group). A: S -> X -> goal (reward 1 on turn 1);
    B: S -> Y, fails; C: S -> X, fails."""
    step_rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    anchors = [["S", "X"], ["S", "Y"], ["S", "X"]]
    returns = torch.tensor([1.0, 0.0, 0.0])
    return returns, step_rewards, anchors, torch.tensor([5, 5, 5])


def test_gigpo_hand_defaults():
    returns, sr, anchors, g = _lake()
    # A^E: {1, 0, 0}: mean 1/3, std sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3) = 0.577350
    #      -> [2/3, -1/3, -1/3] / 0.577350 = [1.154701, -0.577350, -0.577350]
    # step returns (gamma 0.95): A [0.95, 1], B [0, 0], C [0, 0]
    # step group S: {0.95, 0, 0} is 0.95 * {1, 0, 0} -> A^S = [1.154701, -0.577350, -0.577350]
    # step group X: {A: 1, C: 0}: mean 0.5, std sqrt(0.5) -> [+0.707107, -0.707107]; Y: singleton 0
    # A = A^E + 1.0 * A^S:
    #   A: [1.154701 + 1.154701, 1.154701 + 0.707107] = [2.309401, 1.861808]
    #   B: [-0.577350 - 0.577350, -0.577350 + 0]      = [-1.154701, -0.577350]
    #   C: [-0.577350 - 0.577350, -0.577350 - 0.707107] = [-1.154701, -1.284457]
    out = gigpo_advantages(returns, sr, anchors, g)
    close(out, [[2.309401, 1.861808], [-1.154701, -0.577350], [-1.154701, -1.284457]])
    # omega 0.5 halves the step part: A turn 1 = 1.154701 + 0.5 * 0.707107 = 1.508255
    assert out.dtype == torch.float32
    half = gigpo_advantages(returns, sr, anchors, g, omega=0.5)
    assert half[0, 1].item() == pytest.approx(1.508255, abs=1e-5)


def test_gigpo_hand_mean_norm():
    returns, sr, anchors, g = _lake()
    # A^E = [2/3, -1/3, -1/3]; A^S: S {0.95, 0, 0} mean 0.316667 -> [0.633333, -0.316667, -0.316667];
    # X: [0.5, -0.5]; Y: 0
    out = gigpo_advantages(returns, sr, anchors, g, norm="mean_norm")
    close(
        out,
        [
            [2 / 3 + 0.633333, 2 / 3 + 0.5],
            [-1 / 3 - 0.316667, -1 / 3],
            [-1 / 3 - 0.316667, -1 / 3 - 0.5],
        ],
    )


def test_methods_section_11_defaults():
    for fn in (gigpo_advantages, agent_advantages):
        p = inspect.signature(fn).parameters
        assert (p["gamma"].default, p["omega"].default, p["eps"].default) == (0.95, 1.0, 1e-6)
        assert p["norm"].default == "mean_std_norm"
    assert inspect.signature(step_advantages).parameters["eps"].default == 1e-6


def test_all_equal_group_gives_zero():
    sr = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    out = gigpo_advantages(
        torch.tensor([1.0, 1.0]), sr, [["a", "b"], ["a", "b"]], torch.tensor([0, 0])
    )
    assert torch.equal(out, torch.zeros(2, 2))  # exact zeros, no 0/0 residue


def test_permutation_invariance():
    gen = torch.Generator().manual_seed(0)
    n, k = 12, 5
    sr = torch.randint(0, 3, (n, k), generator=gen).float()
    lengths = torch.randint(1, k + 1, (n,), generator=gen)
    sr[torch.arange(k)[None, :] >= lengths[:, None]] = NAN
    anchors = [
        [int(torch.randint(0, 3, (1,), generator=gen)) for _ in range(int(c))] for c in lengths
    ]
    g = torch.arange(n) // 4
    ret = torch.nansum(sr, 1)
    perm = torch.randperm(n, generator=gen)
    base = gigpo_advantages(ret, sr, anchors, g)
    shuffled = gigpo_advantages(ret[perm], sr[perm], [anchors[i] for i in perm], g[perm])
    close(shuffled, base[perm])
    # relabelling the groups changes nothing
    close(gigpo_advantages(ret, sr, anchors, g * 7 + 100), base)


# ----------------------------------------------------------------------------- tokens and modes


def test_broadcast_to_tokens():
    per_turn = torch.tensor([[1.0, 2.0, NAN], [3.0, NAN, NAN]])
    step_ids = torch.tensor([[-1, 0, 0, -1, 1, 1], [0, 0, -1, -1, -1, -1]])
    close(broadcast_to_tokens(per_turn, step_ids), [[0, 1, 1, 0, 2, 2], [3, 3, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match="NaN"):
        broadcast_to_tokens(per_turn, torch.tensor([[0, 2], [0, 0]]))
    with pytest.raises(ValueError, match="must lie in \\[-1, 2\\]"):
        broadcast_to_tokens(per_turn, torch.tensor([[0, 3], [0, 0]]))
    with pytest.raises(ValueError, match="disagree"):
        broadcast_to_tokens(per_turn, torch.tensor([[0, 1]]))


def test_agent_advantages_modes():
    returns, sr, anchors, g = _lake()
    step_ids = torch.tensor([[0, 0, -1, 1], [0, -1, 1, 1], [0, -1, -1, 1]])
    assert CREDIT.names() == ["trajectory", "turn", "gigpo"]
    # trajectory: A^E = [1.154701, -0.577350, -0.577350] on every agent token
    e = [1.154701, -0.577350, -0.577350]
    out = agent_advantages("trajectory", returns, sr, step_ids, None, g)
    close(out, [[e[0], e[0], 0, e[0]], [e[1], 0, e[1], e[1]], [e[2], 0, 0, e[2]]])
    # turn: step returns {0.95, 1, 0, 0, 0, 0} pooled: mean 1.95/6 = 0.325,
    # sum of squares 0.625^2 + 0.675^2 + 4 * 0.325^2 = 1.26875, std = sqrt(1.26875 / 5) = 0.503736
    # -> 0.95: 1.240729, 1: 1.339988, 0: -0.645183
    a, b, c = 0.625 / 0.503736, 0.675 / 0.503736, -0.325 / 0.503736
    out = agent_advantages("turn", returns, sr, step_ids, None, g)
    close(out, [[a, a, 0, b], [c, 0, c, c], [c, 0, 0, c]])
    # gigpo: the per-turn values of test_gigpo_hand_defaults, spread over the turn's tokens
    out = agent_advantages("gigpo", returns, sr, step_ids, anchors, g)
    close(out[0], [2.309401, 2.309401, 0, 1.861808])
    close(out[2], [-1.154701, 0, 0, -1.284457])
    with pytest.raises(ValueError, match="needs anchor_keys"):
        agent_advantages("gigpo", returns, sr, step_ids, None, g)
    with pytest.raises(ValueError, match="allowed are gigpo, trajectory, turn"):
        agent_advantages("episode", returns, sr, step_ids, anchors, g)


# ----------------------------------------------------------------------------- StarPO-S filter


def test_keep_top_groups_by_std():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 5.0, 2.0, 2.0])
    g = torch.tensor([3, 3, 1, 1, 2, 2, 0, 0])
    # stds: group 3 {1, 0}: 0.7071; group 1 {1, 1}: 0; group 2 {0, 5}: 3.5355; group 0: 0
    # keep 0.5 of 4 groups = 2: groups 2 and 3
    keep = keep_top_groups_by_std(r, g, 0.5)
    assert keep.tolist() == [True, True, False, False, True, True, False, False]
    # keep 0.75 -> 3 groups; groups 1 and 0 tie at std 0: group 1 appears first and is kept
    keep = keep_top_groups_by_std(r, g, 0.75)
    assert keep.tolist() == [True, True, True, True, True, True, False, False]
    assert keep_top_groups_by_std(r, g, 1.0).all()
    # floor(0.1 * 4) = 0 -> at least one group is kept (the widest, group 2)
    assert keep_top_groups_by_std(r, g, 0.1).tolist() == [False] * 4 + [True, True] + [False] * 2
    # NaN returns are ignored in the std: group 3 {1, NaN} has one valid member -> std 0
    r2 = torch.tensor([1.0, NAN, 1.0, 3.0])
    assert keep_top_groups_by_std(r2, torch.tensor([0, 0, 1, 1]), 0.5).tolist() == [
        False,
        False,
        True,
        True,
    ]
    with pytest.raises(ValueError, match="keep_frac"):
        keep_top_groups_by_std(r, g, 0.0)
