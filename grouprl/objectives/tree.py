"""Tree advantages: a group sampled as a tree (shared prefixes generated once, branching at chosen
points) -> per-node values, per-segment advantages and per-slot advantages [N, T].

The contract (what tree rollouts fill; rollouts/fork records it):
  parent       Long[M]     over the M nodes of all trees of the batch, -1 for a root. Nodes are in
                           topological order: parent[m] < m for every non-root m. A node is a
                           segment: the run of action slots generated once between two branch
                           points (a run of tokens, one agent turn, a run of denoising steps).
  node_of_row  Long[N, T]  for each sample row (one root-to-leaf path) and action slot t, the node
                           whose segment holds slot t; -1 on padding. Along a row the nodes are the
                           path's nodes in order (so they never decrease), and each change of node
                           goes from a node down to one of its descendants (its child, unless the
                           nodes between hold no slot). A node may hold no slot (a root that is
                           the prompt, an empty segment); a row's last node is its leaf
                           (`leaf_node`). Several rows may end at the same leaf (copies of a path
                           that finished early): each counts with its reward.
  rewards      Float[N]    one outcome reward per row (per leaf path); NaN = the reward failed.
  group_ids    Long[N]     one tree = one group (every row of a tree has the tree's group id and
                           every group is exactly one tree).
  mask         Bool[N, T]  the loss mask; slots of a node may be masked (an agent's environment
                           tokens) and still belong to it.

`tree_from_paths(tree_path, tree_segment)` builds (parent, node_of_row) from the Rollout's tree
fields as rollouts/fork.py records them (tree_path Long[N, D+1]: node ids along each row's path,
root first, -1 past a finished path's depth; tree_segment Long[N, T]: the depth of the segment
holding each slot, -1 on padding); nodes are renumbered 0..M-1 by depth, then id.

Definitions (each function's docstring repeats its own):
  node value       V(n) = mean of the valid rewards of the rows whose leaf is n or below n
                   (NaN if there is none). For binary rewards this is the Monte-Carlo estimate of
                   the expected reward of the prefix ending with segment n: the node value of
                   TreeRPO (arXiv 2506.05183), TEMPO's P2T prefix value (arXiv 2509.18314) and
                   TreeRL's V(s) (arXiv 2506.11902).
  segment "diff"   a(n) = V(n) - V(parent(n)); a(root) = 0. [our decision, documented] The
                   alternative V(root) - group mean is the same number here: a group is one tree,
                   so the group mean of the valid rewards IS V(root). Only with several trees per
                   prompt would it differ, and that across-tree signal is Tree-GRPO's inter-tree
                   advantage, which mode "tree_grpo" takes from the rewards directly.
  segment "sibling_norm" (TreeRPO's step-level groups)
                   a(n) = (V(n) - mean_S V) / (std_S V + eps) over S = the children of parent(n)
                   with a value; roots 0. Std is the unbiased std, eps 1e-4, and a degenerate
                   sibling group (< 2 valued siblings or all equal) gives exactly 0: the same
                   conventions as objectives/advantages.py (`Groups`).

Per-slot modes (`TREE_MODES`, `tree_token_advantages`); A^G_i is the plain GRPO advantage of row i
(compute_advantages "grpo": (r_i - mean_g) / (std_g + eps) over the group, i.e. the tree):
  leaf_group  A^G_i on every slot of row i. On a depth-1 tree it is bit for bit
              compute_advantages("grpo"). With `shared_segment_scales` a slot of node n shared by
              k rows gets (1/k) sum_i A^G_i = (V(n) - mean_g) / (std_g + eps) once (all rewards
              valid): lambda-GRPO's reading of GRPO as a process reward (arXiv 2509.21154).
  segment     a_diff(n) on every slot of node n (the segment advantage, TreeRL's local advantage).
  treerpo     a_sibling_norm(n) on every slot of node n (TreeRPO, arXiv 2506.05183).
  tempo       A^G_i + td_coef * delta_{i,t}, delta = V(n) - V(parent(n)) on the first unmasked
              slot of node n in row i when parent(n) has >= 2 children (a branch token), 0 on every
              other slot (TEMPO, arXiv 2509.18314: GRPO plus branch-gated TD corrections; within a
              segment V does not change, so the TD error V(s_{t+1}) - V(s_t) is nonzero only where
              a child segment starts; our reading of the paper's description).
  tree_grpo   A^intra_i + A^inter_i on every slot of row i (Tree-GRPO, arXiv 2509.21240; read in
              its official code, AMAP-ML/Tree-GRPO verl/trainer/ppo/ray_trainer_ts.py, estimator
              "tree" that every tree-search script uses): intra = GRPO over the rows of the tree
              (group_ids), inter = GRPO over the rows of every tree of the same prompt
              (`prompt_ids`, Long[N]; default group_ids). Deviation: a prompt with ONE tree
              gets no inter-tree term (the official code sums intra + inter there too, which is
              2 A^G); so with one tree per prompt tree_grpo is GRPO over the leaves, and a tree of
              depth 1 is plain GRPO bit for bit.
  branch_grpo a_depth(n) on every slot of node n: V(n) standardised over the nodes of n's tree
              at n's depth (BranchGRPO, arXiv 2509.06040: reward fusion = V, the mean of the
              leaf rewards below n [unconfirmed: uniform weights; the paper's fusion weights
              could not be read], then a depth-wise advantage; `depthwise_advantages`).
  treerl      (GA(n) + LA(n)) / sqrt(L(n)) on every slot of node n, GA = V(n) - V(root(n)),
              LA = V(n) - V(parent(n)), L(n) = number of valid leaves under n; roots 0 (TreeRL,
              arXiv 2506.11902: the paper's step reward, as a public verl port computes it).
Every mode gives exactly 0 on masked slots, on padding, for invalid (NaN) nodes and in degenerate
trees (one row, or all rewards equal): no NaN leaves a function.

`shared_segment_scales(node_of_row, mask)`: s = 1 / k(n), k(n) = number of rows whose path holds n,
so a segment shared by k leaves counts once when the loss sums rows. On a flat group whose rows
share literal token prefixes, with the prefix trie as the tree, this is lambda-GRPO's
`prefix_share_scales` (token_scales.py) exactly. The scales are a separate, optional multiplier
(like token_scales.py): the papers differ. Tree-GRPO's code trains every leaf path as its own
sample, shared prefix included (no scales); TEMPO, as described, adds its TD term to GRPO's
per-sample loss (no scales); TreeRL's 1/sqrt(L) is already its weighting of a node met in L leaf
paths (no scales); TreeRPO trains each node's segment once [unconfirmed], i.e. modes segment /
treerpo WITH the scales.

Deviations and unconfirmed points (official code read for Tree-GRPO and TreeRL; TreeRPO's and
TEMPO's code could not be read here):
  - TreeRPO [unconfirmed]: the official code (yangzhch6/TreeRPO) could not be read here; the
    step-level group advantage is implemented as GRPO's standardisation over siblings from the
    paper's description ("group-relative rewards computed within step-level groups"). The paper's
    trees have a fixed branching factor and depth; any tree works here. A root segment (shared by
    the whole tree) has no siblings and gets 0 (it has no alternative to be compared with).
  - TEMPO [unconfirmed coefficient]: td_coef defaults to 1.0 (the paper's weighting could not be
    read). V is the plain mean of the raw (binary) leaf rewards, as P2T defines it; the GRPO term
    is std-normalised, the TD term is not.
  - TEMPO, empty segments: a node that holds no slot (an empty segment) has no token to carry its
    TD term, which is dropped; its children's terms are kept.
  - Tree-GRPO (official code read): both levels are (r - mean) / (unbiased std + eps), summed
    with weight 1, on every response token of the leaf path; shared prefixes count once per leaf
    there too (no scales). Deviations: eps defaults to 1e-4 here (the code: 1e-6; pass eps=1e-6);
    a group of one gets 0 (the code gives it mean 0 and std 1, i.e. its raw reward).
  - TreeRL: the official code (THUDM/TreeRL, openrlhf/trainer/ppo_utils/parallel_mcts.py and
    tree_node.py) reaches its step reward through options we do not reproduce: leaf rewards are
    centred leave-one-out (r_i - mean of the other K - 1 leaves), which scales GA and LA by
    K / (K - 1) against the plain means used here; an optional 1/sqrt reweighting of accumulated
    values over the selected leaves; token-level mean removal over all steps; a local advantage of
    exactly 0 replaced by the previous node's along the path. Mode treerl is the paper's formula.
  - NaN rewards: the row's own leaf gets no value (its advantage is 0 in every mode); shared nodes
    above it take their value from the other leaves. The row still counts in k(n) of the scales
    (its tokens exist), so the leaf_group identity above holds only when all rewards are valid.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from grouprl.objectives.advantages import compute_advantages
from grouprl.objectives.group_stats import Groups
from grouprl.objectives.registry import Registry

TreeMode = Literal[
    "leaf_group", "segment", "treerpo", "tempo", "tree_grpo", "treerl", "branch_grpo"
]
SegmentKind = Literal["diff", "sibling_norm"]

SEGMENT_ADVANTAGES = Registry("segment advantage")
TREE_MODES = Registry("tree advantage mode")

ADV_EPS = 1e-4  # added to the std of every standardisation here (as compute_advantages)
TD_COEF = 1.0  # [unconfirmed] weight of TEMPO's branch-gated TD term


# ----------------------------------------------------------------------------- validation


def _check_parent(parent: Tensor) -> None:
    if parent.dim() != 1 or parent.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"parent must be Long[M], got {parent.dtype} {tuple(parent.shape)}")
    idx = torch.arange(parent.numel(), device=parent.device)  # [M]
    bad = (parent < -1) | (parent >= idx)  # [M] a parent must come before its child
    if bad.any():
        m = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"parent[{m}] = {int(parent[m])}: nodes must be in topological order "
            "(-1 for a root, else a parent index smaller than the node's own)"
        )


def _roots(parent: Tensor) -> Tensor:
    """Long[M]: the root of each node's tree (pointer jumping, log2(depth) passes)."""
    up = torch.where(parent >= 0, parent, torch.arange(parent.numel(), device=parent.device))
    while True:  # up[m]: an ancestor of m (itself for a root); halve the distance to the root
        nxt = up[up]  # [M]
        if torch.equal(nxt, up):
            return up  # [M]
        up = nxt


def _check_rows(parent: Tensor, node_of_row: Tensor, mask: Tensor) -> None:
    """The row half of the contract (module docstring); raises on the first violation."""
    if node_of_row.dim() != 2 or node_of_row.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"node_of_row must be Long[N, T], got {node_of_row.dtype} {tuple(node_of_row.shape)}"
        )
    if mask.shape != node_of_row.shape or mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be Bool{list(node_of_row.shape)}, got {mask.dtype} {tuple(mask.shape)}"
        )
    m = parent.numel()
    if ((node_of_row < -1) | (node_of_row >= m)).any():
        raise ValueError(f"node_of_row holds ids outside [-1, {m}) (M = {m} nodes)")
    if (mask & (node_of_row < 0)).any():
        row = int(torch.nonzero(mask & (node_of_row < 0))[0, 0])
        raise ValueError(f"row {row} has a loss-mask slot with node -1 (padding must be masked)")
    # consecutive slots that hold nodes: the same node, or a step down to a descendant (to a child
    # unless a node between them holds no slot, e.g. an empty segment)
    a, b = node_of_row[:, :-1], node_of_row[:, 1:]  # [N, T-1]
    step = (a >= 0) & (b >= 0) & (a != b)  # [N, T-1]
    src, dst = a[step].long(), b[step].long()  # [S] the steps only
    ok = torch.zeros_like(src, dtype=torch.bool)  # [S]
    up = parent[dst].long()  # [S] climb from dst towards its root, one level a pass
    while bool((up >= 0).any()):
        ok |= up == src
        up = torch.where(up >= 0, parent[up.clamp(min=0)].long(), up)  # [S]
    if not ok.all():
        i, t = (int(x) for x in torch.nonzero(step)[int(torch.nonzero(~ok)[0])])
        raise ValueError(
            f"row {i}: slot {t} holds node {int(a[i, t])} and slot {t + 1} node {int(b[i, t])}, "
            "which is not below it (a row must walk down one root-to-leaf path)"
        )


def _check_groups(parent: Tensor, leaf: Tensor, group_ids: Tensor) -> None:
    """One tree = one group: the rows of a tree share a group id and a group has one tree."""
    if group_ids.shape != leaf.shape:
        raise ValueError(
            f"group_ids must have shape {tuple(leaf.shape)}, got {tuple(group_ids.shape)}"
        )
    if leaf.numel() == 0:
        return
    root = _roots(parent)[leaf]  # [N]
    for a, b, what in ((root, group_ids, "tree"), (group_ids, root, "group")):
        _, inv = torch.unique(a, return_inverse=True)  # [N]
        k = int(inv.max()) + 1
        lo = torch.full((k,), torch.iinfo(torch.int64).max, device=b.device)
        hi = torch.full((k,), torch.iinfo(torch.int64).min, device=b.device)
        lo = lo.scatter_reduce(0, inv, b.long(), "amin")  # [K]
        hi = hi.scatter_reduce(0, inv, b.long(), "amax")  # [K]
        if (lo != hi).any():
            i = int(torch.nonzero((lo != hi)[inv])[0])
            raise ValueError(
                f"row {i}: its {what} spans several "
                f"{'groups' if what == 'tree' else 'trees'}; one tree must be one group"
            )


def _leaf_nodes(node_of_row: Tensor) -> Tensor:
    """Long[N]: the last node of each row (nodes never decrease along a row, so the max)."""
    leaf = node_of_row.max(dim=1).values if node_of_row.shape[1] else None  # [N]
    if leaf is None or (leaf < 0).any():
        raise ValueError("every row needs at least one slot with a node (node_of_row >= 0)")
    return leaf  # [N]


# ----------------------------------------------------------------------------- from rollouts


def tree_from_paths(tree_path: Tensor, tree_segment: Tensor) -> tuple[Tensor, Tensor]:
    """The Rollout's tree fields (rollouts/fork.py) -> (parent Long[M], node_of_row Long[N, T]).

    tree_path Long[N, D+1]: node ids (any unique integers) along each row's path, the root first,
    -1 only as a tail; tree_segment Long[N, T]: the path column (depth) of the node holding each
    slot, -1 on padding. The M distinct ids are renumbered by (depth, id), which is a topological
    order; an id met at two depths or under two parents is an error.
    """
    if tree_path.dim() != 2 or tree_segment.dim() != 2 or tree_path.shape[0] != len(tree_segment):
        raise ValueError(
            "tree_path must be Long[N, D+1] and tree_segment Long[N, T] with the same N, got "
            f"{tuple(tree_path.shape)} and {tuple(tree_segment.shape)}"
        )
    n, width = tree_path.shape
    path = tree_path.long()  # [N, D+1]
    has = path >= 0  # [N, D+1]
    if n and (not has[:, 0].all() or (has.long().cumprod(1) != has.long()).any()):
        raise ValueError("tree_path: each row starts with its root and has -1 only as a tail")
    seg = tree_segment.long()  # [N, T]
    if ((seg < -1) | (seg >= width)).any():
        raise ValueError(f"tree_segment must hold -1 or a path column in [0, {width})")
    col = seg.clamp(min=0)  # [N, T]
    slot_id = torch.gather(path, 1, col)  # [N, T] the node id of each slot (garbage on padding)
    if ((seg >= 0) & (slot_id < 0)).any():
        raise ValueError("tree_segment points at a path column that is -1 for its row")
    depth = torch.arange(width, device=path.device).expand(n, width)[has]  # [E]
    up = torch.cat([torch.full_like(path[:, :1], -1), path[:, :-1]], dim=1)[has]  # [E]
    uniq, inv = torch.unique(path[has], return_inverse=True)  # [U], [E]
    u = uniq.numel()

    def one_per_id(x: Tensor, what: str) -> Tensor:
        """[E] values per path entry -> [U] the one value of each id (raises if it has two)."""
        lo = torch.full((u,), torch.iinfo(torch.int64).max, device=x.device)
        hi = torch.full((u,), torch.iinfo(torch.int64).min, device=x.device)
        lo = lo.scatter_reduce(0, inv, x, "amin")  # [U]
        hi = hi.scatter_reduce(0, inv, x, "amax")  # [U]
        if (lo != hi).any():
            bad = int(uniq[torch.nonzero(lo != hi)[0]])
            raise ValueError(f"tree_path: node id {bad} appears at two {what}")
        return lo  # [U]

    node_depth = one_per_id(depth, "depths")  # [U]
    node_up = one_per_id(up, "parents")  # [U] the parent's id, -1 for a root
    order = torch.argsort(node_depth, stable=True)  # [U] uniq is sorted: ties keep the id order
    rank = torch.empty_like(order)
    rank[order] = torch.arange(u, device=path.device)  # [U] new index of uniq[k]
    up_rank = rank[torch.searchsorted(uniq, node_up.clamp(min=0)).clamp(max=max(u - 1, 0))]
    parent = torch.full((u,), -1, dtype=torch.long, device=path.device)  # [M]
    parent[rank] = torch.where(node_up >= 0, up_rank, -1)  # [M]
    slot_node = rank[torch.searchsorted(uniq, slot_id.clamp(min=0)).clamp(max=max(u - 1, 0))]
    node_of_row = torch.where(seg >= 0, slot_node, -1)  # [N, T]
    return parent, node_of_row


# ----------------------------------------------------------------------------- node values


def _node_stats(parent: Tensor, leaf_node: Tensor, rewards: Tensor) -> tuple[Tensor, Tensor]:
    """-> (V [M] float64, NaN where no valid leaf; L [M] float64, valid leaves under each node)."""
    m = parent.numel()
    if leaf_node.dim() != 1 or leaf_node.shape != rewards.shape:
        raise ValueError(
            f"leaf_node and rewards must both be [N], got {tuple(leaf_node.shape)} and "
            f"{tuple(rewards.shape)}"
        )
    if ((leaf_node < 0) | (leaf_node >= m)).any():
        raise ValueError(f"leaf_node must hold node ids in [0, {m})")
    r = rewards.to(torch.float64)  # [N]
    if torch.isinf(r).any():
        raise ValueError("rewards contain +-inf; use NaN for 'no reward'")
    valid = ~torch.isnan(r)  # [N]
    x = torch.where(valid, r, torch.zeros_like(r))  # [N]
    w = valid.to(torch.float64)  # [N]
    total = torch.zeros(m, dtype=torch.float64, device=r.device)  # [M]
    count = torch.zeros(m, dtype=torch.float64, device=r.device)  # [M]
    cur = leaf_node.long()  # [N] each row climbs from its leaf to its root, one level a pass
    while True:
        live = cur >= 0  # [N]
        if not live.any():
            break
        total.index_add_(0, cur[live], x[live])
        count.index_add_(0, cur[live], w[live])
        cur = torch.where(live, parent[cur.clamp(min=0)].long(), cur)  # [N]
    values = torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, torch.nan))
    return values, count  # [M], [M]


def node_values(parent: Tensor, leaf_node: Tensor, rewards: Tensor) -> Tensor:
    """V(n) = mean of the valid rewards of the rows whose leaf is n or a descendant of n.

    parent Long[M] (topological), leaf_node Long[N] (the last node of each row), rewards Float[N]
    (NaN = failed reward, excluded) -> Float[M] (dtype of the rewards, float32 for integer
    rewards); NaN for a node with no valid leaf below it. TreeRPO arXiv 2506.05183 (expected
    reward of a step), TEMPO arXiv 2509.18314 (P2T prefix value), TreeRL arXiv 2506.11902 (V(s)).
    """
    _check_parent(parent)
    out = rewards.dtype if rewards.is_floating_point() else torch.float32
    return _node_stats(parent, leaf_node, rewards)[0].to(out)  # [M]


# ----------------------------------------------------------------------------- segment advantages
# Each: fn(parent [M], values [M] float64 (NaN = no value), *, eps) -> [M] float64, 0 where
# the node (or what it is compared with) has no value and for roots.


@SEGMENT_ADVANTAGES.register("diff")
def diff_advantages(parent: Tensor, values: Tensor, *, eps: float) -> Tensor:
    """a(n) = V(n) - V(parent(n)), a(root) = 0 (module docstring: why not V(root) - mean)."""
    up = values[parent.clamp(min=0)]  # [M] parent value (garbage for roots, masked below)
    a = values - up  # [M]
    keep = (parent >= 0) & ~torch.isnan(a)  # [M] a child of a NaN parent is NaN as well
    return torch.where(keep, a, torch.zeros_like(a))  # [M]


@SEGMENT_ADVANTAGES.register("sibling_norm")
def sibling_norm_advantages(parent: Tensor, values: Tensor, *, eps: float) -> Tensor:
    """TreeRPO step-level groups: a(n) = (V(n) - mean_S) / (std_S + eps) over S = the valued
    children of parent(n) (unbiased std); 0 for roots and degenerate sibling groups."""
    valid = (parent >= 0) & ~torch.isnan(values)  # [M]
    g = Groups.from_ids(parent, valid)  # siblings = one group; roots are never valid
    x = torch.where(valid, values, torch.zeros_like(values))  # [M] NaN-free
    c = g.centered(x)  # [M] exactly 0 for degenerate sibling groups
    denom = g.std(x) + eps  # [M]
    return torch.where(denom > 0, c / denom.clamp(min=torch.finfo(c.dtype).tiny), 0.0)  # [M]


def segment_advantages(
    parent: Tensor, values: Tensor, *, kind: SegmentKind = "diff", eps: float = ADV_EPS
) -> Tensor:
    """Per-node advantages Float[M] from node values Float[M] (NaN = no value).

    kind "diff": V(n) - V(parent(n)), roots 0 (TreeRPO / TEMPO / TreeRL local advantage);
    kind "sibling_norm": standardised over the node's siblings (TreeRPO, arXiv 2506.05183).
    Nodes without a value get 0. Module docstring: formulas, sources, deviations.
    """
    fn = SEGMENT_ADVANTAGES[kind]
    _check_parent(parent)
    if values.shape != parent.shape:
        raise ValueError(f"values must be [M] = {tuple(parent.shape)}, got {tuple(values.shape)}")
    out = values.dtype if values.is_floating_point() else torch.float32
    return fn(parent, values.to(torch.float64), eps=eps).to(out)  # [M]


# ----------------------------------------------------------------------------- per-slot modes


class _Tree:
    """The validated batch tree and the quantities every mode reads (float64)."""

    def __init__(self, parent, node_of_row, mask, rewards, group_ids, prompt_ids, eps, td_coef):
        self.parent, self.node, self.mask = parent.long(), node_of_row.long(), mask
        self.rewards, self.group_ids, self.eps, self.td_coef = rewards, group_ids, eps, td_coef
        self.prompt_ids = group_ids if prompt_ids is None else prompt_ids
        self.leaf = _leaf_nodes(self.node)  # [N]
        self.values, self.leaves = _node_stats(self.parent, self.leaf, rewards)  # [M], [M]

    def grpo(self, ids: Tensor) -> Tensor:
        """Plain GRPO advantage per row over `ids` -> [N] float64."""
        r = self.rewards.to(torch.float64)  # [N]
        return compute_advantages("grpo", r, ids, eps=self.eps)  # [N]

    def per_row(self, adv: Tensor) -> Tensor:
        """[N] -> [N, T] on the unmasked slots."""
        return torch.where(self.mask, adv[:, None], torch.zeros_like(adv)[:, None])  # [N, T]

    def per_node(self, adv: Tensor) -> Tensor:
        """[M] -> [N, T]: each unmasked slot gets the value of the node holding it."""
        slot = adv[self.node.clamp(min=0)]  # [N, T]
        return torch.where(self.mask, slot, torch.zeros_like(slot))  # [N, T]


@TREE_MODES.register("leaf_group")
def mode_leaf_group(tree: _Tree) -> Tensor:
    return tree.per_row(tree.grpo(tree.group_ids))  # [N, T]


@TREE_MODES.register("segment")
def mode_segment(tree: _Tree) -> Tensor:
    return tree.per_node(diff_advantages(tree.parent, tree.values, eps=tree.eps))  # [N, T]


@TREE_MODES.register("treerpo")
def mode_treerpo(tree: _Tree) -> Tensor:
    a = sibling_norm_advantages(tree.parent, tree.values, eps=tree.eps)  # [M]
    return tree.per_node(a)  # [N, T]


@TREE_MODES.register("tempo")
def mode_tempo(tree: _Tree) -> Tensor:
    m = tree.parent.numel()
    p = tree.parent  # [M]
    n_children = torch.zeros(m, dtype=torch.long, device=p.device)  # [M]
    n_children.index_add_(0, p[p >= 0], torch.ones_like(p[p >= 0]))
    branch = (p >= 0) & (n_children[p.clamp(min=0)] >= 2)  # [M] the node starts at a branch
    delta = torch.where(branch, diff_advantages(p, tree.values, eps=tree.eps), 0.0)  # [M]
    # first unmasked slot of each node in each row: node ids increase along a row (topological
    # order), so it is the unmasked slot whose node exceeds every earlier unmasked slot's node
    seen = torch.where(tree.mask, tree.node, torch.full_like(tree.node, -1))  # [N, T]
    before = torch.cummax(seen, dim=1).values  # [N, T] max node up to and including t
    before = torch.cat([torch.full_like(before[:, :1], -1), before[:, :-1]], dim=1)  # [N, T]
    first = tree.mask & (tree.node > before)  # [N, T]
    td = torch.where(first, delta[tree.node.clamp(min=0)], 0.0)  # [N, T]
    return tree.per_row(tree.grpo(tree.group_ids)) + tree.td_coef * td  # [N, T]


@TREE_MODES.register("tree_grpo")
def mode_tree_grpo(tree: _Tree) -> Tensor:
    intra = tree.grpo(tree.group_ids)  # [N] within the tree
    inter = tree.grpo(tree.prompt_ids)  # [N] across the trees of one prompt
    # a prompt with one tree has no other tree to compare with: no inter-tree term (the
    # official code adds its intra-tree advantage a second time there)
    pairs = torch.unique(torch.stack([tree.prompt_ids, tree.group_ids]), dim=1)  # [2, trees]
    prompts, trees = torch.unique(pairs[0], return_counts=True)  # [P], [P]
    lone = torch.isin(tree.prompt_ids, prompts[trees < 2])  # [N]
    return tree.per_row(intra + torch.where(lone, torch.zeros_like(inter), inter))  # [N, T]


@TREE_MODES.register("treerl")
def mode_treerl(tree: _Tree) -> Tensor:
    v = tree.values  # [M]
    ga = v - v[_roots(tree.parent)]  # [M] global: against the tree's root (0 at roots)
    la = diff_advantages(tree.parent, v, eps=tree.eps)  # [M] local: against the parent
    r = (ga + la) / tree.leaves.clamp(min=1).sqrt()  # [M]
    keep = (tree.parent >= 0) & ~torch.isnan(r)  # [M]
    return tree.per_node(torch.where(keep, r, torch.zeros_like(r)))  # [N, T]


@TREE_MODES.register("branch_grpo")
def mode_branch_grpo(tree: _Tree) -> Tensor:
    return tree.per_node(depthwise_advantages(tree.parent, tree.values, eps=tree.eps))  # [N, T]


def depthwise_advantages(parent: Tensor, values: Tensor, *, eps: float) -> Tensor:
    """BranchGRPO's depth-wise advantage: a(n) = (V(n) - mean_D V) / (std_D V + eps) over D = the
    valued nodes of n's tree at n's depth (unbiased std); roots 0, degenerate depth groups
    (< 2 valued nodes or all equal) exactly 0, as compute_advantages "grpo"."""
    m = parent.numel()
    depth = torch.zeros(m, dtype=torch.long)  # [M]
    root = torch.arange(m)  # [M]
    par = parent.cpu()
    for i in range(m):  # topological order: a parent comes first
        if par[i] >= 0:
            depth[i], root[i] = depth[par[i]] + 1, root[par[i]]
    valid = (par >= 0) & ~torch.isnan(values.cpu())  # [M]
    out = torch.zeros(m, dtype=values.dtype)  # [M]
    if bool(valid.any()):
        key = root * (int(depth.max()) + 1) + depth  # [M] one id per (tree, depth)
        out[valid] = compute_advantages("grpo", values.cpu()[valid], key[valid], eps=eps).to(
            values.dtype
        )  # [V]
    return out.to(values.device)


def tree_token_advantages(
    parent: Tensor,
    node_of_row: Tensor,
    mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor,
    *,
    mode: TreeMode = "leaf_group",
    eps: float = ADV_EPS,
    td_coef: float = TD_COEF,
    prompt_ids: Tensor | None = None,
) -> Tensor:
    """Per-slot advantages Float[N, T] of a batch of trees (module docstring: contract, modes).

    parent Long[M], node_of_row Long[N, T], mask Bool[N, T], rewards Float[N] (NaN = failed),
    group_ids Long[N] (one tree = one group); prompt_ids Long[N] only for mode "tree_grpo" (the
    trees of one prompt; default group_ids). 0 on masked slots; dtype of the rewards (float32 for
    integer rewards).
    """
    fn = TREE_MODES[mode]
    if prompt_ids is not None and mode != "tree_grpo":
        raise ValueError(f"prompt_ids is read by mode 'tree_grpo' only, got mode {mode!r}")
    _check_parent(parent)
    _check_rows(parent, node_of_row, mask)
    n = node_of_row.shape[0]
    if rewards.shape != (n,):
        raise ValueError(f"rewards must have shape ({n},), got {tuple(rewards.shape)}")
    if prompt_ids is not None and prompt_ids.shape != (n,):
        raise ValueError(f"prompt_ids must have shape ({n},), got {tuple(prompt_ids.shape)}")
    tree = _Tree(parent, node_of_row, mask, rewards, group_ids, prompt_ids, eps, td_coef)
    _check_groups(tree.parent, tree.leaf, group_ids)
    out = rewards.dtype if rewards.is_floating_point() else torch.float32
    return fn(tree).to(out)  # [N, T]


# ----------------------------------------------------------------------------- scales


def shared_segment_scales(node_of_row: Tensor, mask: Tensor) -> Tensor:
    """s = 1 / k(n) on each unmasked slot, k(n) = number of rows whose path holds the slot's node
    n; 0 on masked slots. node_of_row Long[N, T], mask Bool[N, T] -> Float[N, T] (float32).

    A segment shared by k leaves then counts once in a loss that sums rows, the tree form of
    lambda-GRPO's prefix_share_scales (arXiv 2509.21154, token_scales.py), which it equals on the
    prefix trie of a flat group.
    """
    if node_of_row.dim() != 2 or mask.shape != node_of_row.shape or mask.dtype != torch.bool:
        raise ValueError(
            "shared_segment_scales: node_of_row must be Long[N, T] and mask Bool of the same "
            f"shape, got {tuple(node_of_row.shape)} and {mask.dtype} {tuple(mask.shape)}"
        )
    if (mask & (node_of_row < 0)).any():
        raise ValueError("shared_segment_scales: a loss-mask slot has node -1")
    n, t = node_of_row.shape
    if n * t == 0 or not (node_of_row >= 0).any():
        return torch.zeros(n, t, device=mask.device)  # [N, T]
    node = node_of_row.long()  # [N, T]
    m = int(node.max()) + 1
    rows = torch.arange(n, device=node.device)[:, None].expand_as(node)  # [N, T]
    has = node >= 0  # [N, T]
    pairs = torch.unique(rows[has] * m + node[has])  # [P] distinct (row, node) pairs
    k = torch.bincount(pairs % m, minlength=m).float()  # [M] rows through each node
    s = 1.0 / k[node.clamp(min=0)].clamp(min=1)  # [N, T]
    return torch.where(mask, s, torch.zeros_like(s))  # [N, T]
