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

Entropy-triggered branch points (`sample_entropy_tree`, rollout.tree type entropy; the
high-entropy forking of TreePO arXiv 2508.17445 and ARPO arXiv 2507.19849, where uncertain tokens
decide where to branch): a node's child samples its continuation to the end; the policy scores
that continuation's token entropies (one forward), and the child's segment ends before its first
token, at least `min_tokens` into the segment, whose next-token entropy exceeds `threshold`
(nats). The child's b grandchildren resample from there, except the first, which keeps the
already sampled rest, so no sampled token is thrown away; a continuation with no such token ends
the path (it is copied into the branches below, as a finished one). Deviations: TreePO forks at
fixed-length segments and uses probability / quality heuristics to allocate branches; ARPO
branches after tool calls by the entropy change; here one threshold on the token entropy.

Prefix compute: the b children of a node are consecutive identical contexts (prompt + the node's
tokens), which the fast engine prefills once and expands, and vLLM serves from its prefix cache;
a node's prefix is prefilled again at the next depth (the KV cache is not kept across depths).

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
    # entropy trees: the already sampled continuation past the node's end (ids, log-probs,
    # whether it stopped), which the node's first child takes over
    tail: tuple[list[int], list[float], bool] | None = None


def _seed_id(node: _Node, group_ids: list[int]) -> int:
    """The id a node's children are seeded by: a root's is its group id (a tree of depth 1 draws
    exactly what flat sampling draws), a deeper node's is -1 - its node id (never a group id)."""
    return int(group_ids[node.row]) if len(node.path) == 1 else -1 - node.path[-1]


def check_tree(
    branching: list[int],
    branch_at: list[int],
    limit: int,
    *,
    unit: str = "offsets",
    limit_option: str = "rollout.max_new_tokens",
) -> None:
    """One error naming the options when the tree's shape cannot work: branch_at must hold one
    point per depth after the first, increasing strictly inside (0, limit). unit / limit_option:
    what the points count (completion offsets for text, turns for agents, denoising steps for
    flows) and the option bounding them."""
    if not branching or any(b < 1 for b in branching):
        raise ValueError(f"rollout.tree.branching={branching}: one count >= 1 per depth")
    if len(branch_at) != len(branching) - 1:
        raise ValueError(
            f"rollout.tree.branch_at={branch_at} needs {len(branching) - 1} {unit} (one per "
            f"branch point after the first depth of branching={branching})"
        )
    bounds = [0, *branch_at, limit]
    if any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(
            f"rollout.tree.branch_at={branch_at} ({unit}) must increase strictly inside (0, "
            f"{limit_option}={limit})"
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
    enc = policy.encode_prompts(prompts)  # once per prompt
    batch = _token_batch(policy, [enc[n.row] for n in leaves], [n.ids for n in leaves],
                         truncated=[n.truncated for n in leaves])  # fmt: skip
    tensor = torch.tensor
    logp = pad_sequence([tensor(n.logp, dtype=torch.float32) for n in leaves], batch_first=True,
                        padding_value=0.0)  # fmt: skip  # [N, T]
    segment = pad_sequence([tensor(n.depth, dtype=torch.long) for n in leaves], batch_first=True,
                           padding_value=-1)  # fmt: skip  # [N, T]
    path = torch.full((len(leaves), depth + 1), -1, dtype=torch.long)  # [N, D+1]
    for i, n in enumerate(leaves):
        path[i, : len(n.path)] = tensor(n.path)
    return Rollout(
        group_ids=tensor([int(group_ids[n.row]) for n in leaves], dtype=torch.long),  # [N]
        rewards={},
        actions=batch,
        old_logp=logp.clone(),  # [N, T]
        mask=batch.completion_mask.clone(),  # [N, T] every completion token was sampled
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


def sample_entropy_tree(
    policy: Any,
    prompts: list[Any],
    params: Any,
    branching: list[int],
    *,
    threshold: float,
    min_tokens: int,
    group_ids: list[int],
    seed: int | None = None,
) -> Rollout:
    """One tree per prompt whose branch points are high-entropy tokens (module docstring):
    branching [b_1, ..., b_d] children per node at each depth; a child's segment ends before the
    first token at least min_tokens in whose next-token entropy exceeds threshold (nats)."""
    if not branching or any(b < 1 for b in branching):
        raise ValueError(f"rollout.tree.branching={branching}: one count >= 1 per depth")
    counters = [1] * len(prompts)
    frontier = [_Node(row=i, path=[int(g) * NODES_PER_TREE]) for i, g in enumerate(group_ids)]
    for level, b in enumerate(branching):
        last = level == len(branching) - 1
        children: list[_Node] = []
        fresh: list[tuple[_Node, _Node]] = []  # (parent, child) pairs that sample a new tail
        for node in frontier:
            if node.done:
                children += [replace(node) for _ in range(b)]
                continue
            for k in range(b):
                counters[node.row] += 1
                child = replace(node, path=node.path + [node.path[0] + counters[node.row] - 1],
                                tail=node.tail if k == 0 else None)  # fmt: skip
                children.append(child)
                if child.tail is None:
                    fresh.append((node, child))
        _sample_tails(policy, prompts, params, fresh, group_ids, seed)
        live = [c for c in children if not c.done]
        cuts = [None] * len(live) if last else _entropy_cuts(
            policy, prompts, params, live, threshold, min_tokens)  # fmt: skip
        for child, cut in zip(live, cuts):
            ids, logp, stopped = child.tail
            n = len(ids) if cut is None else cut
            child.ids, child.logp = child.ids + ids[:n], child.logp + logp[:n]
            child.depth = child.depth + [level + 1] * n
            child.tail = None if cut is None else (ids[n:], logp[n:], stopped)
            child.done = cut is None and not last  # no branch point: the path ends here
            child.truncated = cut is None and not stopped
        frontier = children
    return _leaf_rollout(policy, prompts, group_ids, frontier, len(branching))


def _sample_tails(policy: Any, prompts: list[Any], params: Any, pairs: list, group_ids: list[int],
                  seed: int | None) -> None:  # fmt: skip
    """Each child of `pairs` samples its continuation from its parent's end to max_new_tokens,
    in one engine call per distinct remaining length (the b - 1 fresh children of a node are
    consecutive identical contexts)."""
    by_left: dict[int, list[tuple[_Node, _Node]]] = {}
    for parent, child in pairs:
        by_left.setdefault(params.max_new_tokens - len(parent.ids), []).append((parent, child))
    for left, group in by_left.items():
        if left < 1:  # the parent used the whole budget: an empty, truncated continuation
            for _, child in group:
                child.tail = ([], [], False)
            continue
        parents = list(dict.fromkeys(id(p) for p, _ in group))
        first = {id(p): p for p, _ in group}
        sizes = [sum(1 for p, _ in group if id(p) == pid) for pid in parents]
        seeded = {} if seed is None else {"seed": seed}
        out = policy.sample(
            [prompts[first[pid].row] for pid in parents], sizes,
            replace(params, max_new_tokens=left),
            group_ids=[_seed_id(first[pid], group_ids) for pid in parents],
            response_prefixes=[first[pid].ids for pid in parents], **seeded,
        )  # fmt: skip  # rows: each parent's fresh children, consecutive
        row = 0
        for pid, size in zip(parents, sizes):
            own = [c for p, c in group if id(p) == pid]
            start = len(first[pid].ids)
            for child in own[:size]:
                n = int(out.actions.completion_mask[row].sum()) - start
                child.tail = (out.actions.completion_ids[row, start : start + n].tolist(),
                              out.engine_logp[row, start : start + n].tolist(),
                              not bool(out.actions.truncated[row]))  # fmt: skip
                row += 1


def _entropy_cuts(policy: Any, prompts: list[Any], params: Any, nodes: list[_Node],
                  threshold: float, min_tokens: int) -> list[int | None]:  # fmt: skip
    """Per node: the index in its tail of the first token, at least min_tokens in, whose
    next-token entropy under the policy exceeds `threshold`; None where there is none."""
    enc = policy.encode_prompts(prompts)  # once per prompt
    batch = _token_batch(policy, [enc[n.row] for n in nodes], [n.ids + n.tail[0] for n in nodes])
    with torch.no_grad():
        ent = policy.log_probs(batch, temperature=params.temperature, with_entropy=True).entropy
    cuts: list[int | None] = []
    for i, node in enumerate(nodes):
        start, n = len(node.ids), len(node.tail[0])
        high = [t for t in range(min_tokens, n) if float(ent[i, start + t]) > threshold]
        cuts.append(high[0] if high else None)  # [T] entropies of the tail's positions
    return cuts


def _token_batch(policy: Any, prompt_ids: list[list[int]], completions: list[list[int]],
                 truncated: list[bool] | None = None) -> TokenBatch:  # fmt: skip
    """[left-padded prompt | right-padded completion] of token rows (prompts as token ids)."""
    pad = policy.tokenizer.pad_token_id
    enc = [torch.tensor(p, dtype=torch.long) for p in prompt_ids]
    rows = [torch.tensor(c, dtype=torch.long) for c in completions]
    return TokenBatch(
        prompt_ids=pad_sequence(enc, batch_first=True, padding_value=pad, padding_side="left"),
        prompt_mask=pad_sequence([torch.ones(len(p), dtype=torch.bool) for p in enc],
                                 batch_first=True, padding_value=0, padding_side="left"),
        completion_ids=pad_sequence(rows, batch_first=True, padding_value=pad),  # [n, T]
        completion_mask=pad_sequence([torch.ones(len(c), dtype=torch.bool) for c in rows],
                                     batch_first=True, padding_value=0),
        truncated=torch.tensor(truncated if truncated is not None else [False] * len(rows)),
    )  # fmt: skip
