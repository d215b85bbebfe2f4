"""Tree advantages (objectives/tree.py): hand-computed values on a small tree, NaN leaves, groups of
one, all-equal rewards, the depth-1 equivalence with plain GRPO, the lambda-GRPO equivalence of the
scales, order invariance and the contract checks."""

import math

import pytest
import torch

from grouprl.objectives.advantages import compute_advantages
from grouprl.objectives.token_scales import prefix_share_scales
from grouprl.objectives.tree import (
    SEGMENT_ADVANTAGES,
    TREE_MODES,
    node_values,
    segment_advantages,
    shared_segment_scales,
    tree_from_paths,
    tree_token_advantages,
)

H = 2**-0.5  # 1/sqrt(2): a two-member group standardised with the unbiased std, eps = 0


def _close(a, b, tol=1e-6):
    torch.testing.assert_close(
        a.double(), torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=0
    )


# The tree of one group (T = 6 slots; R holds slots 0-1, A and B slots 2-3, the leaves 4-5):
#
#                 R (0)                    V(R) = 1/4
#               /       \
#          A (1)         B (2)             V(A) = 1/2, V(B) = 0
#         /    \        /    \
#     A1 (3)  A2 (4)  B1 (5)  B2 (6)       rewards 1, 0, 0, 0 (row A2 is one slot shorter)
PARENT = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
NODES = torch.tensor(
    [
        [0, 0, 1, 1, 3, 3],
        [0, 0, 1, 1, 4, -1],
        [0, 0, 2, 2, 5, 5],
        [0, 0, 2, 2, 6, 6],
    ]
)  # fmt: skip
MASK = NODES >= 0
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0])
ONE_GROUP = torch.zeros(4, dtype=torch.long)
LEAVES = torch.tensor([3, 4, 5, 6])


def _per_node(per_node, nodes=NODES):
    """The [N, T] tensor that puts per_node[n] on every slot of node n (0 on padding)."""
    v = torch.as_tensor(per_node, dtype=torch.float64)
    return torch.where(nodes >= 0, v[nodes.clamp(min=0)], 0.0)


def _adv(mode, **kw):
    kw.setdefault("eps", 0.0)
    return tree_token_advantages(PARENT, NODES, MASK, REWARDS, ONE_GROUP, mode=mode, **kw)


def test_registries():
    assert sorted(SEGMENT_ADVANTAGES.names()) == ["diff", "sibling_norm"]
    assert sorted(TREE_MODES.names()) == [
        "branch_grpo", "leaf_group", "segment", "tempo", "tree_grpo", "treerl", "treerpo"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="unknown tree advantage mode 'nope'"):
        _adv("nope")


# ----------------------------------------------------------------------------- hand-computed


def test_node_values_by_hand():
    _close(node_values(PARENT, LEAVES, REWARDS), [0.25, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0])


def test_a_row_may_end_at_an_inner_node():
    # a fifth row stops inside A (its leaf is A itself): it counts in V(A) and V(R), not below A
    nodes = torch.cat([NODES, torch.tensor([[0, 0, 1, 1, -1, -1]])])
    r = torch.cat([REWARDS, torch.tensor([1.0])])
    _close(node_values(PARENT, torch.tensor([3, 4, 5, 6, 1]), r), [0.4, 2 / 3, 0, 1, 0, 0, 0])
    out = tree_token_advantages(PARENT, nodes, nodes >= 0, r, torch.zeros(5), mode="segment")
    _close(out[4], [0.0, 0.0, 2 / 3 - 0.4, 2 / 3 - 0.4, 0.0, 0.0])
    _close(shared_segment_scales(nodes, nodes >= 0)[:, 0], [0.2] * 5)


def test_segment_advantages_by_hand():
    v = node_values(PARENT, LEAVES, REWARDS)
    # child value - parent value; the root 0 (= V(R) - group mean, which is 0 too)
    _close(segment_advantages(PARENT, v), [0.0, 0.25, -0.25, 0.5, -0.5, 0.0, 0.0])
    # siblings {A, B} = {1/2, 0}, {A1, A2} = {1, 0}: +-1/sqrt(2); {B1, B2} = {0, 0}: degenerate
    _close(segment_advantages(PARENT, v, kind="sibling_norm", eps=0.0), [0, H, -H, H, -H, 0, 0])
    # with the default eps: c / (std + 1e-4), std of the sibling pairs = |a - b| / sqrt(2)
    s_ab, s_leaf = 0.5 * H, H
    _close(
        segment_advantages(PARENT, v, kind="sibling_norm"),
        [0, 0.25 / (s_ab + 1e-4), -0.25 / (s_ab + 1e-4), 0.5 / (s_leaf + 1e-4),
         -0.5 / (s_leaf + 1e-4), 0, 0],
    )  # fmt: skip


def test_leaf_group_by_hand():
    # rewards 1, 0, 0, 0: mean 1/4, unbiased std sqrt((9/16 + 3/16) / 3) = 1/2
    a = torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=torch.float64)
    _close(_adv("leaf_group"), torch.where(MASK, a[:, None], 0.0))


def test_segment_and_treerpo_modes_by_hand():
    _close(_adv("segment"), _per_node([0, 0.25, -0.25, 0.5, -0.5, 0, 0]))
    _close(_adv("treerpo"), _per_node([0, H, -H, H, -H, 0, 0]))


def test_tempo_by_hand():
    # GRPO on every slot, plus V(child) - V(parent) on the first slot of each child of a branch:
    # slot 2 (A: +1/4, B: -1/4), slot 4 (A1: +1/2, A2: -1/2, B1 and B2: 0); the root has none
    g = torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=torch.float64)[:, None]
    td = torch.zeros(4, 6, dtype=torch.float64)
    td[:, 2] = torch.tensor([0.25, 0.25, -0.25, -0.25])
    td[:, 4] = torch.tensor([0.5, -0.5, 0.0, 0.0])
    _close(_adv("tempo"), torch.where(MASK, g + td, 0.0))
    _close(_adv("tempo", td_coef=2.0), torch.where(MASK, g + 2 * td, 0.0))


def test_tempo_puts_the_td_term_on_the_first_unmasked_slot_and_only_at_branches():
    # a chain root(0) -> 1 -> {2, 3}; node 1 is an only child (no branch, no TD term even though
    # its first slot is masked out); rows: [1, 1, 2] and [1, 1, 3] with slot 0 masked
    parent = torch.tensor([-1, 0, 1, 1])
    nodes = torch.tensor([[1, 1, 2, 2], [1, 1, 3, 3]])
    mask = torch.tensor([[False, True, False, True], [False, True, True, True]])
    r = torch.tensor([1.0, 0.0])
    out = tree_token_advantages(parent, nodes, mask, r, torch.zeros(2), mode="tempo", eps=0.0)
    g = H  # two members {1, 0}: +-1/sqrt(2)
    # V: 1/2 at nodes 0, 1; 1 and 0 at the leaves: TD +-1/2 on each leaf's first UNMASKED slot
    _close(out, [[0.0, g, 0.0, g + 0.5], [0.0, -g, -g - 0.5, -g]])


def test_tree_grpo_by_hand():
    # two trees of one prompt, two leaves each: rewards {1, 0} and {1, 1}
    parent = torch.tensor([-1, 0, 0, -1, 3, 3])
    nodes = torch.tensor([[1, 1], [2, 2], [4, 4], [5, 5]])
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    trees = torch.tensor([0, 0, 1, 1])
    prompt = torch.zeros(4, dtype=torch.long)
    out = tree_token_advantages(
        parent, nodes, nodes >= 0, r, trees, mode="tree_grpo", prompt_ids=prompt, eps=0.0
    )
    # intra: +-1/sqrt(2) in tree 0, 0 in tree 1 (all equal); inter over {1, 0, 1, 1}: mean 3/4,
    # unbiased std sqrt((3/16 + 9/16) / 3) = 1/2 -> 1/2, -3/2, 1/2, 1/2
    want = torch.tensor([H + 0.5, -H - 1.5, 0.5, 0.5], dtype=torch.float64)
    _close(out, want[:, None].expand(4, 2))
    # the official code's eps = 1e-6: each level divides by (std + 1e-6)
    out6 = tree_token_advantages(
        parent, nodes, nodes >= 0, r, trees, mode="tree_grpo", prompt_ids=prompt, eps=1e-6
    )
    want6 = [0.5 / (H + 1e-6) + 0.25 / (0.5 + 1e-6), -0.5 / (H + 1e-6) - 0.75 / (0.5 + 1e-6),
             0.25 / (0.5 + 1e-6), 0.25 / (0.5 + 1e-6)]  # fmt: skip
    _close(out6[:, 0], want6)
    # without prompt_ids each tree is its own prompt: no other tree, no inter-tree term (the
    # official code would add intra twice: 2 A^G); exactly the leaf-group GRPO advantage
    out1 = tree_token_advantages(parent, nodes, nodes >= 0, r, trees, mode="tree_grpo", eps=0.0)
    _close(out1, torch.tensor([H, -H, 0.0, 0.0])[:, None].expand(4, 2))
    leaf = tree_token_advantages(parent, nodes, nodes >= 0, r, trees, mode="leaf_group", eps=0.0)
    assert torch.equal(out1, leaf)
    # one prompt with one tree, another with two: the lone tree has intra only
    prompt = torch.tensor([0, 0, 1, 1])
    mixed = tree_token_advantages(
        parent, nodes, nodes >= 0, r, trees, mode="tree_grpo", prompt_ids=prompt, eps=0.0
    )
    _close(mixed, torch.tensor([H, -H, 0.0, 0.0])[:, None].expand(4, 2))


def test_treerl_by_hand():
    # (V(n) - V(R) + V(n) - V(parent)) / sqrt(valid leaves under n)
    a = (0.25 + 0.25) / math.sqrt(2)
    _close(_adv("treerl"), _per_node([0, a, -a, 0.75 + 0.5, -0.25 - 0.5, -0.25, -0.25]))


def test_shared_segment_scales_by_hand():
    s = torch.tensor([1 / 4, 1 / 2, 1 / 2, 1, 1, 1, 1], dtype=torch.float64)
    _close(shared_segment_scales(NODES, MASK), _per_node(s))
    # summed over the batch they count every generated slot once: R 2 + A 2 + B 2 + leaves 7
    assert float(shared_segment_scales(NODES, MASK).sum()) == 13.0
    # masked slots of a node get 0 but the row still passes through the node
    mask = MASK.clone()
    mask[0, :2] = False
    want = _per_node(s)
    want[0, :2] = 0.0
    _close(shared_segment_scales(NODES, mask), want)


def test_scaled_leaf_group_counts_each_segment_once_with_its_node_advantage():
    # lambda-GRPO's reading of GRPO on a tree: sum over the rows through a slot's node of
    # scale * A_i = (V(n) - mean_g) / std_g, the node's own standardised value
    adv = _adv("leaf_group").double() * shared_segment_scales(NODES, MASK).double()
    v = node_values(PARENT, LEAVES, REWARDS).double()
    z = (v - 0.25) / 0.5  # [M]
    for n in range(7):
        for t in range(6):
            here = NODES[:, t] == n
            if here.any():
                _close(adv[here, t].sum(), z[n])


# ----------------------------------------------------------------------------- edge cases


def test_nan_leaves_are_left_out():
    r = torch.tensor([1.0, float("nan"), 0.0, float("nan")])
    v = node_values(PARENT, LEAVES, r)
    # A: only A1 counts (1); B: only B1 (0); R: {1, 0}; A2 and B2 have no value
    _close(v[:4], [0.5, 1.0, 0.0, 1.0])
    assert torch.isnan(v[4]) and torch.isnan(v[6])
    for mode in TREE_MODES.names():
        out = tree_token_advantages(PARENT, NODES, MASK, r, ONE_GROUP, mode=mode, eps=0.0)
        assert torch.isfinite(out).all(), mode
        assert (out[~MASK] == 0).all(), mode
    seg = tree_token_advantages(PARENT, NODES, MASK, r, ONE_GROUP, mode="segment", eps=0.0)
    _close(seg, _per_node([0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0]))  # A2, B2: no value -> 0
    lg = tree_token_advantages(PARENT, NODES, MASK, r, ONE_GROUP, mode="leaf_group", eps=0.0)
    _close(lg[:, 0], [H, 0.0, -H, 0.0])  # GRPO over {1, 0}; the NaN rows get 0


def test_all_nan_gives_nan_values_and_zero_advantages():
    r = torch.full((4,), float("nan"))
    assert torch.isnan(node_values(PARENT, LEAVES, r)).all()
    for mode in TREE_MODES.names():
        out = tree_token_advantages(PARENT, NODES, MASK, r, ONE_GROUP, mode=mode)
        assert torch.equal(out, torch.zeros(4, 6)), mode


def test_all_equal_rewards_give_exact_zeros():
    r = torch.full((4,), 0.1)
    for mode in TREE_MODES.names():
        out = tree_token_advantages(PARENT, NODES, MASK, r, ONE_GROUP, mode=mode)
        assert torch.equal(out, torch.zeros(4, 6)), mode
    assert torch.equal(segment_advantages(PARENT, node_values(PARENT, LEAVES, r)), torch.zeros(7))


def test_a_group_of_one():
    # one tree that never branches: root (no slots) -> a single leaf row
    parent, nodes = torch.tensor([-1, 0]), torch.tensor([[1, 1, -1]])
    for mode in TREE_MODES.names():
        out = tree_token_advantages(parent, nodes, nodes >= 0, torch.tensor([1.0]),
                                    torch.tensor([5]), mode=mode)  # fmt: skip
        assert torch.equal(out, torch.zeros(1, 3)), mode
    _close(shared_segment_scales(nodes, nodes >= 0), [[1.0, 1.0, 0.0]])


def test_integer_rewards_give_float32_and_float64_is_kept():
    out = tree_token_advantages(PARENT, NODES, MASK, torch.tensor([1, 0, 0, 0]), ONE_GROUP)
    assert out.dtype == torch.float32
    out = tree_token_advantages(PARENT, NODES, MASK, REWARDS.double(), ONE_GROUP, mode="tempo")
    assert out.dtype == torch.float64
    assert node_values(PARENT, LEAVES, torch.tensor([1, 0, 0, 0])).dtype == torch.float32


# ----------------------------------------------------------------------------- equivalences


def _depth1(lengths, groups):
    """Depth-1 trees: per group a root with no slot, every row its own leaf under it."""
    groups = torch.as_tensor(groups)
    uniq = torch.unique(groups)
    n, t = len(lengths), max(lengths)
    parent = [-1] * len(uniq) + [int((uniq == g).nonzero()) for g in groups]
    nodes = torch.full((n, t), -1)
    for i, length in enumerate(lengths):
        nodes[i, :length] = len(uniq) + i
    return torch.tensor(parent), nodes


def test_depth_one_tree_is_plain_grpo_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    groups = torch.tensor([3, 3, 3, 3, 7, 7, 7, 9, 9, 1])  # includes a group of one
    lengths = [5, 3, 1, 4, 2, 5, 5, 3, 3, 2]
    parent, nodes = _depth1(lengths, groups)
    mask = nodes >= 0
    mask[0, 1] = False  # a masked slot inside a row
    r = torch.rand(10, generator=gen)
    r[5] = float("nan")
    r[7] = r[8]  # a degenerate group
    for eps in (1e-4, 0.0, 1e-6):
        out = tree_token_advantages(parent, nodes, mask, r, groups, eps=eps)
        plain = compute_advantages("grpo", r, groups, eps=eps)  # [N]
        assert torch.equal(out, torch.where(mask, plain[:, None], 0.0))
    assert torch.equal(shared_segment_scales(nodes, mask), mask.float())


def _prefix_trie(token_ids, mask, group_ids):
    """Per-token prefix trie of flat groups: node = (group, prefix up to and including the slot,
    slots read as (token id, mask bit)); a root per group holds no slot; right padding -> -1."""
    n, t = token_ids.shape
    ends = torch.where(mask.any(1), t - mask.flip(1).int().argmax(1), 0)  # [N] last real slot + 1
    key_of: dict = {}
    parent: list[int] = []
    nodes = torch.full((n, t), -1)
    for i in range(n):
        prev = key_of.setdefault(("root", int(group_ids[i])), len(key_of))
        if prev == len(parent):
            parent.append(-1)
        prefix = ("root", int(group_ids[i]))
        for j in range(int(ends[i])):
            prefix = (prefix, int(token_ids[i, j]), bool(mask[i, j]))
            node = key_of.setdefault(prefix, len(key_of))
            if node == len(parent):
                parent.append(prev)
            nodes[i, j], prev = node, node
    return torch.tensor(parent), nodes


def test_scales_equal_lambda_grpo_prefix_share_on_a_flat_group():
    ids = torch.tensor(
        [
            [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 6], [1, 7, 0, 0],  # group 0: nested prefixes
            [4, 4, 4, 0], [4, 4, 4, 0],  # group 1: identical rows (multiplicity 2)
            [1, 2, 3, 4],  # group 2: alone (same tokens as row 0, another prompt)
        ]
    )  # fmt: skip
    lengths = torch.tensor([4, 4, 4, 2, 3, 3, 4])
    mask = torch.arange(4)[None, :] < lengths[:, None]
    mask[2, 1] = False  # a masked slot inside a row still belongs to the prefix
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    _, nodes = _prefix_trie(ids, mask, groups)
    assert torch.equal(shared_segment_scales(nodes, mask), prefix_share_scales(ids, mask, groups))


def test_scales_equal_lambda_grpo_prefix_share_on_random_groups():
    gen = torch.Generator().manual_seed(1)
    n, t = 24, 9
    ids = torch.randint(0, 3, (n, t), generator=gen)  # a small vocabulary: many shared prefixes
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    groups = torch.randint(0, 4, (n,), generator=gen)
    parent, nodes = _prefix_trie(ids, mask, groups)
    assert torch.equal(shared_segment_scales(nodes, mask), prefix_share_scales(ids, mask, groups))
    # the trie is a valid tree batch: every mode runs on it
    r = torch.rand(n, generator=gen).round()
    for mode in TREE_MODES.names():
        out = tree_token_advantages(parent, nodes, mask, r, groups, mode=mode)
        assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------- invariance


@pytest.mark.parametrize(
    "mode", ["leaf_group", "segment", "treerpo", "tempo", "tree_grpo", "treerl"]
)
def test_permuting_rows_permutes_the_outputs(mode):
    gen = torch.Generator().manual_seed(2)
    # two trees: the hand tree (group 0) and a copy of it with other rewards (group 1)
    parent = torch.cat([PARENT, torch.where(PARENT >= 0, PARENT + 7, PARENT)])
    nodes = torch.cat([NODES, torch.where(NODES >= 0, NODES + 7, NODES)])
    mask = nodes >= 0
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, float("nan"), 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    out = tree_token_advantages(parent, nodes, mask, r, groups, mode=mode)
    scales = shared_segment_scales(nodes, mask)
    perm = torch.randperm(8, generator=gen)
    out_p = tree_token_advantages(parent, nodes[perm], mask[perm], r[perm], groups[perm], mode=mode)
    assert torch.equal(out_p, out[perm])
    assert torch.equal(shared_segment_scales(nodes[perm], mask[perm]), scales[perm])


# ----------------------------------------------------------------------------- from rollouts


def test_tree_from_paths_reads_the_rollout_fields():
    # the hand tree as rollouts/fork.py numbers it (root = group id * 2**20, children in creation
    # order); tree_segment names the path column of each slot (0: the root's own slots here)
    root = 7 * 2**20
    path = torch.tensor([[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 6]]) + root
    seg = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 2, -1], [0, 0, 1, 1, 2, 2],
                        [0, 0, 1, 1, 2, 2]])  # fmt: skip
    parent, nodes = tree_from_paths(path, seg)
    assert torch.equal(parent, PARENT) and torch.equal(nodes, NODES)


def test_tree_from_paths_with_finished_copies_an_empty_segment_and_unordered_ids():
    # root 50; 40 -> {30, 31}; 41 finished at depth 1 (two rows are its copies, -1 after it);
    # 42 holds no slot (an empty segment) -> 32. Ids shrink with depth: renumbered by depth.
    path = torch.tensor([[50, 40, 30], [50, 40, 31], [50, 41, -1], [50, 41, -1], [50, 42, 32]])
    seg = torch.tensor([[1, 2, 2], [1, 2, -1], [1, 1, -1], [1, 1, -1], [2, 2, -1]])
    parent, nodes = tree_from_paths(path, seg)
    # dense ids: 50 -> 0; 40, 41, 42 -> 1, 2, 3; 30, 31, 32 -> 4, 5, 6
    assert parent.tolist() == [-1, 0, 0, 0, 1, 1, 3]
    assert nodes.tolist() == [[1, 4, 4], [1, 5, -1], [2, 2, -1], [2, 2, -1], [6, 6, -1]]
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    leaf = nodes.max(1).values
    # the copies count with their multiplicity: V(41) = 1 from two rows, V(root) = 3/5
    _close(node_values(parent, leaf, r), [0.6, 0.5, 1.0, 0.0, 1.0, 0.0, 0.0])
    mask = nodes >= 0
    for mode in TREE_MODES.names():  # the row through the empty segment passes the checks
        out = tree_token_advantages(parent, nodes, mask, r, torch.zeros(5), mode=mode)
        assert torch.isfinite(out).all() and (out[~mask] == 0).all(), mode
    seg_adv = tree_token_advantages(parent, nodes, mask, r, torch.zeros(5), mode="segment")
    # row 0: 40 gets 1/2 - 3/5, 30 gets 1 - 1/2; row 4: 32 gets V(32) - V(42) = 0 (the empty
    # segment 42 has a = -3/5 but no slot to carry it)
    _close(seg_adv[0], [-0.1, 0.5, 0.5])
    _close(seg_adv[4], [0.0, 0.0, 0.0])


def test_tree_from_paths_refuses_inconsistent_paths():
    with pytest.raises(ValueError, match="two parents"):
        tree_from_paths(torch.tensor([[1, 2, 4], [1, 3, 4]]), torch.tensor([[2], [2]]))
    with pytest.raises(ValueError, match="only as a tail"):
        tree_from_paths(torch.tensor([[1, -1, 4]]), torch.tensor([[0]]))
    with pytest.raises(ValueError, match="is -1 for its row"):
        tree_from_paths(torch.tensor([[1, 2, -1]]), torch.tensor([[2]]))


# ----------------------------------------------------------------------------- contract checks


def test_contract_violations_fail_loudly():
    with pytest.raises(ValueError, match="topological order"):
        node_values(torch.tensor([-1, 2, 0]), torch.tensor([1]), torch.tensor([1.0]))
    bad = NODES.clone()
    bad[0, 4] = 5  # A -> B1 is not a parent -> child step
    with pytest.raises(ValueError, match="not below it"):
        tree_token_advantages(PARENT, bad, bad >= 0, REWARDS, ONE_GROUP)
    mask = MASK.clone()
    mask[1, 5] = True  # a loss slot on padding
    with pytest.raises(ValueError, match="node -1"):
        tree_token_advantages(PARENT, NODES, mask, REWARDS, ONE_GROUP)
    with pytest.raises(ValueError, match="one tree must be one group"):
        tree_token_advantages(PARENT, NODES, MASK, REWARDS, torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="one tree must be one group"):  # two trees, one group
        parent = torch.tensor([-1, 0, -1, 2])
        nodes = torch.tensor([[1], [3]])
        tree_token_advantages(parent, nodes, nodes >= 0, torch.tensor([1.0, 0.0]),
                              torch.zeros(2))  # fmt: skip
    with pytest.raises(ValueError, match="prompt_ids is read by mode 'tree_grpo' only"):
        _adv("tempo", prompt_ids=ONE_GROUP)
    with pytest.raises(ValueError, match="inf"):
        node_values(PARENT, LEAVES, torch.tensor([1.0, float("inf"), 0.0, 0.0]))
    with pytest.raises(ValueError, match="at least one slot"):
        nodes = NODES.clone()
        nodes[3] = -1
        tree_token_advantages(PARENT, nodes, nodes >= 0, REWARDS, ONE_GROUP)
