"""lambda-GRPO prefix-share scales and EGSW weights: hand-computed values, a brute-force reference,
edge cases (identical sequences, padding, empty rows, groups of one) and invariances."""

import math
import random

import pytest
import torch

from grouprl.objectives.token_scales import (
    EGSW_MODES,
    TOKEN_SCALES,
    egsw_weights,
    prefix_share_scales,
)


def _close(a, b, tol=1e-6):
    torch.testing.assert_close(
        a.double(), torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=0
    )


def test_registries_match_the_config_names():
    assert sorted(TOKEN_SCALES.names()) == ["none", "prefix_share"]
    assert sorted(EGSW_MODES.names()) == ["off", "sequence", "token"]


# ----------------------------------------------------------------------------- lambda-GRPO

IDS = torch.tensor(
    [
        [1, 2, 3], [1, 2, 4], [1, 5, 6],  # group 0: a shared root, then a shared pair
        [7, 8, 9], [7, 8, 9],  # group 1: two identical sequences
        [4, 0, 0], [4, 0, 0],  # group 2: row 5 is [4] + padding (pad id 0), row 6 really is [4, 0]
        [5, 5, 5],  # group 3: alone
        [1, 1, 0], [1, 1, 0],  # group 4: row 8 fully masked
    ]
)  # fmt: skip
LENS = torch.tensor([3, 3, 3, 3, 3, 1, 2, 3, 0, 2])
MASK = torch.arange(3)[None, :] < LENS[:, None]
GROUPS = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 4, 4])
EXPECTED = [
    # t=1: all three share [1] -> 1/3; t=2: rows 0, 1 share [1, 2] -> 1/2, row 2 alone; t=3 alone
    [1 / 3, 1 / 2, 1.0], [1 / 3, 1 / 2, 1.0], [1 / 3, 1.0, 1.0],
    [0.5, 0.5, 0.5], [0.5, 0.5, 0.5],  # identical sequences count with multiplicity 2
    [0.5, 0.0, 0.0], [0.5, 1.0, 0.0],  # padding never matches the real token 0
    [1.0, 1.0, 1.0],
    [0.0, 0.0, 0.0], [1.0, 1.0, 0.0],  # a fully masked row shares nothing and gets 0
]  # fmt: skip


def test_prefix_share_hand_computed():
    _close(prefix_share_scales(IDS, MASK, GROUPS), EXPECTED)


def test_prefix_share_groups_are_separate_and_ids_arbitrary():
    # row 1 repeats row 0 but sits in another group, so it never counts; group 9 = rows 0, 2
    # share only their first token. Any integer ids, in any order.
    ids = torch.tensor([[1, 2], [1, 2], [1, 3]])
    mask = torch.ones(3, 2, dtype=torch.bool)
    _close(prefix_share_scales(ids, mask, torch.tensor([9, -4, 9])), [[0.5, 1], [1, 1], [0.5, 1]])


def test_prefix_share_permutation_equivariant():
    perm = torch.randperm(len(IDS), generator=torch.Generator().manual_seed(3))
    out = prefix_share_scales(IDS[perm], MASK[perm], GROUPS[perm] * 7 + 11)
    _close(out, torch.tensor(EXPECTED)[perm])


def _brute_force(ids, mask, groups):
    out = torch.zeros(ids.shape, dtype=torch.float64)
    rows = [tuple(zip(ids[i].tolist(), mask[i].tolist())) for i in range(len(ids))]
    for i in range(len(ids)):
        for t in range(ids.shape[1]):
            if mask[i, t]:
                k = sum(
                    1
                    for j in range(len(ids))
                    if groups[j] == groups[i] and rows[j][: t + 1] == rows[i][: t + 1]
                )
                out[i, t] = 1 / k
    return out


@pytest.mark.parametrize("seed", range(5))
def test_prefix_share_matches_brute_force(seed):
    rng = random.Random(seed)
    n, t = 12, 7
    ids = torch.tensor([[rng.randrange(2) for _ in range(t)] for _ in range(n)])  # lots of sharing
    lens = torch.tensor([rng.randrange(t + 1) for _ in range(n)])
    mask = torch.arange(t)[None, :] < lens[:, None]
    groups = torch.tensor([rng.randrange(3) for _ in range(n)])
    _close(prefix_share_scales(ids, mask, groups), _brute_force(ids, mask, groups))


def test_prefix_share_turned_off_and_errors():
    _close(TOKEN_SCALES["none"](IDS, MASK, GROUPS), MASK.double())  # plain GRPO: ones on tokens
    assert prefix_share_scales(IDS[:0], MASK[:0], GROUPS[:0]).shape == (0, 3)
    with pytest.raises(ValueError, match="group_ids"):
        prefix_share_scales(IDS, MASK, GROUPS[:3])
    with pytest.raises(ValueError, match="Bool"):
        prefix_share_scales(IDS, MASK.float(), GROUPS)


def test_prefix_share_large_batch_runs():
    # N = 512, T = 1024, groups of 8 (timings are in the module docstring; none asserted here)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50_000, (512, 1024), generator=g)
    ids[:, :4] = 7  # every group shares its first 4 tokens
    mask = torch.ones(512, 1024, dtype=torch.bool)
    out = prefix_share_scales(ids, mask, torch.arange(512) // 8)
    assert (out[:, :4] == 1 / 8).all() and (out[:, 5:] == 1).all()


# ----------------------------------------------------------------------------- EGSW

# One group of two: A = [1, -1], token entropies below, alpha 0.5, P 1.
ADV = torch.tensor([1.0, -1.0])
ENT = torch.tensor([[0.5, 0.5, 9.0], [1.0, 2.0, 9.0]])  # the 9s sit on masked slots
EMASK = torch.tensor([[True, True, False], [True, True, False]])
# sequence: H = [0.5, 1.5]; logits = [1 + 0.25, -1 + 0.75] = [1.25, -0.25]
# softmax = [sigmoid(1.5), sigmoid(-1.5)], times G = 2
S0, S1 = 2 / (1 + math.exp(-1.5)), 2 / (1 + math.exp(1.5))


def test_egsw_sequence_hand_computed():
    w = egsw_weights(ADV, ENT, EMASK, torch.tensor([0, 0]), alpha=0.5, temperature=1.0)
    _close(w, [[S0, S0, 0.0], [S1, S1, 0.0]])
    assert w[EMASK].sum().item() == pytest.approx(4.0)  # weights average 1 over the group's tokens


def test_egsw_token_hand_computed_and_ragged():
    # t=0: logits [1 + 0.25, -1 + 0.5] = [1.25, -0.5] -> 2 sigmoid(+-1.75)
    # t=1: logits [1.25, 0.0] -> 2 sigmoid(+-1.25); t=2: only row 0 is there -> weight 1 (count 1)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    w = egsw_weights(ADV, ENT, mask, torch.tensor([3, 3]), alpha=0.5, level="token")
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    _close(w, [[2 * sig(1.75), 2 * sig(1.25), 1.0], [2 * sig(-1.75), 2 * sig(-1.25), 0.0]])


def test_egsw_temperature_and_alpha():
    # P = 2 halves the logit gap: sequence gap 1.5 -> 0.75
    w = egsw_weights(ADV, ENT, EMASK, torch.tensor([0, 0]), alpha=0.5, temperature=2.0)
    _close(w[:, 0], [2 / (1 + math.exp(-0.75)), 2 / (1 + math.exp(0.75))])
    # equal advantages and alpha 0: uniform, i.e. plain GRPO weights
    w = egsw_weights(torch.zeros(2), ENT, EMASK, torch.tensor([0, 0]), alpha=0.0, level="token")
    _close(w, EMASK.double())


def test_egsw_edge_cases():
    # group of one -> 1; an empty row takes no part and gets 0; [N, T] advantages accepted
    adv = torch.tensor([[2.0, 2.0], [5.0, 5.0], [0.0, 0.0]])
    ent = torch.rand(3, 2)
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    for level in ("sequence", "token"):
        w = egsw_weights(adv, ent, mask, torch.tensor([0, 1, 1]), level=level)
        _close(w, [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    # NaN in padding does not leak; output is detached
    ent = torch.tensor([[0.5, float("nan")]], requires_grad=True)
    w = egsw_weights(torch.tensor([1.0]), ent, torch.tensor([[True, False]]), torch.tensor([0]))
    assert not w.requires_grad and w.tolist() == [[1.0, 0.0]]


def test_egsw_off_and_permutation():
    _close(egsw_weights(ADV, ENT, EMASK, torch.tensor([0, 0]), level="off"), EMASK.double())
    g = torch.Generator().manual_seed(1)
    adv, ent = torch.randn(6, generator=g), torch.rand(6, 4, generator=g)
    mask = torch.arange(4)[None, :] < torch.tensor([4, 2, 3, 1, 4, 0])[:, None]
    groups = torch.tensor([0, 1, 0, 1, 0, 1])
    perm = torch.tensor([5, 2, 0, 4, 1, 3])
    for level in ("sequence", "token"):
        w = egsw_weights(adv, ent, mask, groups, level=level)
        wp = egsw_weights(adv[perm], ent[perm], mask[perm], groups[perm], level=level)
        _close(wp, w[perm])


def test_egsw_errors():
    with pytest.raises(ValueError, match="egsw mode"):
        egsw_weights(ADV, ENT, EMASK, torch.tensor([0, 0]), level="step")
    with pytest.raises(ValueError, match="temperature"):
        egsw_weights(ADV, ENT, EMASK, torch.tensor([0, 0]), temperature=0.0)
    with pytest.raises(ValueError, match="entropy"):
        egsw_weights(ADV, ENT[:, :2], EMASK, torch.tensor([0, 0]))
