"""Tree rollouts of text: a group sampled as a tree whose shared prefixes are generated once.

The fork primitive for token policies: every node is a partial completion; forking it samples b
children that continue it (the engine gets prompt + the node's tokens as its context, and the b
children of a node are consecutive identical contexts, which the fast engine prefills once and
vLLM serves from its prefix cache). `branching = [b_1, ..., b_d]` children per node at each depth
and `branch_at = [t_1 < ... < t_{d-1}]` the completion offsets where depth k + 1 starts (fixed
positions), so a group has G = b_1 * ... * b_d leaves, and the leaves are the Rollout's rows.

A node whose segment ended (EOS or a stop string) before its branch point is a finished leaf: its
b_k ... b_d descendants are copies of it, not sampled again. Every leaf is still marginally a
sample of the policy (the copies of a finished path stand for the probability mass of all its
branches), so the leaf-group statistics stay unbiased; the copies are correlated, which is what a
tree is.

What the Rollout records (typed fields, every one indexed by row so micro-batches select them):
  tree_path     Long[N, D+1]  the node ids along the row's path: [root, depth-1 node, ...], -1
                              past a finished path's depth; ids are unique within the batch
                              (group id * NODES_PER_TREE + index), the root is the prompt
  tree_segment  Long[N, T]    the depth (1..D) of the segment holding each completion slot, -1
                              on padding: the node of slot t is tree_path[i, tree_segment[i, t]]
  generated     Long[N]       tokens this row sampled itself: a shared segment counts at the
                              first row through it, so the sum is what the engine generated
Samples are seeded per node when `seed` is given (rollout.seeding per_sample: the generator of
child j of node n is seeded by (seed, n, j); a root's children by (seed, group id, j) as flat
sampling does), so a tree does not depend on the batch around it, and a tree of depth 1 is
exactly the flat group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from grouprl.types import Rollout, TokenBatch

NODES_PER_TREE = 1 << 20  # node ids of one tree: group id * NODES_PER_TREE + index


@dataclass
class _Node:
    row: int  # the prompt's index in the batch
    ids: list[int] = field(default_factory=list)  # completion tokens so far, every segment
    logp: list[float] = field(default_factory=list)  # their sampling log-probs
    depth: list[int] = field(default_factory=list)  # the segment depth of each token
    path: list[int] = field(default_factory=list)  # node ids from the root
    done: bool = False  # ended (EOS / stop) before the last branch point
    truncated: bool = False  # the last segment ran out of tokens


def _seed_id(node: _Node, group_ids: list[int]) -> int:
    """The id a node's children are seeded by: a root's is its group id (a tree of depth 1 draws
    exactly what flat sampling draws), a deeper node's is -1 - its node id (never a group id)."""
    return int(group_ids[node.row]) if len(node.path) == 1 else -1 - node.path[-1]


def check_tree(branching: list[int], branch_at: list[int], max_new_tokens: int) -> None:
    """One error naming the options when the tree's shape cannot work."""
    if not branching or any(b < 1 for b in branching):
        raise ValueError(f"rollout.tree.branching={branching}: one count >= 1 per depth")
    if len(branch_at) != len(branching) - 1:
        raise ValueError(
            f"rollout.tree.branch_at={branch_at} needs {len(branching) - 1} offsets (one per "
            f"branch point after the first depth of branching={branching})"
        )
    bounds = [0, *branch_at, max_new_tokens]
    if any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(
            f"rollout.tree.branch_at={branch_at} must increase strictly inside (0, "
            f"rollout.max_new_tokens={max_new_tokens})"
        )


def sample_tree(
    policy: Any,
    prompts: list[Any],
    params: Any,
    branching: list[int],
    branch_at: list[int],
    *,
    group_ids: list[int],
    seed: int | None = None,
) -> Rollout:
    """Sample one tree per prompt (see the module docstring); rewards are left empty.
    policy: a token policy (CausalLMPolicy: `sample` with response_prefixes, `encode_prompts`,
    `tokenizer`); params: the rollout's SamplingParams (max_new_tokens bounds a whole leaf)."""
    check_tree(branching, branch_at, params.max_new_tokens)
    ends = [*branch_at, params.max_new_tokens]  # [D] completion offset where each depth stops
    counters = [1] * len(prompts)  # node index 0 is each tree's root
    frontier = [_Node(row=i, path=[int(g) * NODES_PER_TREE]) for i, g in enumerate(group_ids)]
    for level, b in enumerate(branching):
        live = [n for n in frontier if not n.done]
        sampled = iter([])
        if live:
            seg = ends[level] - (ends[level - 1] if level else 0)  # tokens of this depth
            seeded = {} if seed is None else {"seed": seed}
            out = policy.sample(
                [prompts[n.row] for n in live], b, replace(params, max_new_tokens=seg),
                group_ids=[_seed_id(n, group_ids) for n in live],
                response_prefixes=[n.ids for n in live],
                **seeded,
            )  # fmt: skip  # b consecutive rows per live node, each = its prefix + the new segment
            sampled = iter(range(len(out)))
        children = []
        for node in frontier:
            if node.done:  # a finished path: its b descendants at this depth are its copies
                children += [replace(node) for _ in range(b)]
                continue
            for _ in range(b):
                r = next(sampled)
                n_new = int(out.actions.completion_mask[r].sum()) - len(node.ids)
                new_ids = out.actions.completion_ids[r, len(node.ids) : len(node.ids) + n_new]
                new_logp = out.engine_logp[r, len(node.ids) : len(node.ids) + n_new]
                stopped = not bool(out.actions.truncated[r])
                counters[node.row] += 1
                children.append(_Node(
                    row=node.row, ids=node.ids + new_ids.tolist(),
                    logp=node.logp + new_logp.tolist(), depth=node.depth + [level + 1] * n_new,
                    path=node.path + [node.path[0] + counters[node.row] - 1],
                    done=stopped, truncated=not stopped and level == len(branching) - 1,
                ))  # fmt: skip
        frontier = children
    return _leaf_rollout(policy, prompts, group_ids, frontier, len(branching))


def _leaf_rollout(policy: Any, prompts: list[Any], group_ids: list[int], leaves: list[_Node],
                  depth: int) -> Rollout:  # fmt: skip
    """The leaves as Rollout rows (consecutive per group, like a flat group)."""
    # a node's segment counts at the first leaf through it (copies of a finished path add none)
    seen: set[int] = set()
    generated = []
    for leaf in leaves:
        own = 0
        for d, node_id in enumerate(leaf.path[1:], start=1):
            if node_id not in seen:
                seen.add(node_id)
                own += leaf.depth.count(d)
        generated.append(own)
    pad = policy.tokenizer.pad_token_id
    enc = policy.encode_prompts(prompts)
    prompt_rows = [torch.tensor(enc[leaf.row]) for leaf in leaves]
    tensor = torch.tensor
    p_ids = pad_sequence(prompt_rows, batch_first=True, padding_value=pad, padding_side="left")
    p_mask = pad_sequence([torch.ones(len(p), dtype=torch.bool) for p in prompt_rows],
                          batch_first=True, padding_value=0, padding_side="left")  # fmt: skip
    c_ids = pad_sequence([tensor(n.ids, dtype=torch.long) for n in leaves], batch_first=True,
                         padding_value=pad)  # fmt: skip  # [N, T]
    c_mask = pad_sequence([torch.ones(len(n.ids), dtype=torch.bool) for n in leaves],
                          batch_first=True, padding_value=0)  # fmt: skip  # [N, T]
    logp = pad_sequence([tensor(n.logp, dtype=torch.float32) for n in leaves], batch_first=True,
                        padding_value=0.0)  # fmt: skip  # [N, T]
    segment = pad_sequence([tensor(n.depth, dtype=torch.long) for n in leaves], batch_first=True,
                           padding_value=-1)  # fmt: skip  # [N, T]
    path = torch.full((len(leaves), depth + 1), -1, dtype=torch.long)  # [N, D+1]
    for i, n in enumerate(leaves):
        path[i, : len(n.path)] = tensor(n.path)
    batch = TokenBatch(p_ids, p_mask, c_ids, c_mask, tensor([n.truncated for n in leaves]))
    return Rollout(
        group_ids=tensor([int(group_ids[n.row]) for n in leaves], dtype=torch.long),  # [N]
        rewards={},
        actions=batch,
        old_logp=logp.clone(),  # [N, T]
        mask=c_mask.clone(),  # [N, T] every completion token was sampled by the policy
        engine_logp=logp,
        tree_path=path,
        tree_segment=segment,
        generated=tensor(generated, dtype=torch.long),  # [N]
        info={
            "prompt": [prompts[n.row] for n in leaves],
            "completion": policy.tokenizer.batch_decode(
                [n.ids for n in leaves], skip_special_tokens=True
            ),  # fmt: skip
            "completion_ids": [list(n.ids) for n in leaves],
        },
    )
