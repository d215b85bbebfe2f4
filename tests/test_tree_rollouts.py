"""Tree rollouts of text (grouprl/rollouts/fork.py): the tree's shape, its shared segments generated
once, exact log-probs of every leaf token, and a tree of depth 1 equal to the flat group."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.fork import NODES_PER_TREE, check_tree, sample_tree
from grouprl.train import train
from grouprl.types import Rollout

sys.path.insert(0, str(Path(__file__).parent))
from test_methods_train import make_cfg, train_rows  # noqa: E402


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return CausalLMPolicy.from_pretrained(tiny_model_dir, dtype="float32", engine="fast")


def test_tree_shape_segments_and_generated_tokens(policy):
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    r = sample_tree(policy, ["1+2=", "3+4="], params, [2, 3], [2], group_ids=[5, 9], seed=1)
    assert r.group_ids.tolist() == [5] * 6 + [9] * 6
    path, seg = r.tree_path, r.tree_segment  # [12, 3], [12, T]
    assert (path[:6, 0] == 5 * NODES_PER_TREE).all() and (path[6:, 0] == 9 * NODES_PER_TREE).all()
    for g in (slice(0, 6), slice(6, 12)):  # 2 depth-1 nodes, 3 leaves under each
        p = path[g]
        assert p[:3, 1].unique().numel() == 1 and p[3:, 1].unique().numel() == 1
        assert p[0, 1] != p[3, 1]
    for i in range(12):
        n = int(r.actions.completion_mask[i].sum())
        depth1 = min(2, n)  # the first 2 tokens are depth 1, the rest depth 2
        assert (
            seg[i, :depth1].eq(1).all() and seg[i, depth1:n].eq(2).all() and seg[i, n:].eq(-1).all()
        )
        if path[i, 2] == -1:  # a path that ended inside depth 1: no depth-2 segment
            assert n <= 2
    # every node's segment counted once: depth-1 segments once per node, leaves' own segments
    per_node = {}
    for i in range(12):
        for d in (1, 2):
            node = int(path[i, d])
            if node >= 0:
                per_node[node] = int((seg[i] == d).sum())
    assert int(r.generated.sum()) == sum(per_node.values()) < int(r.mask.sum())


def test_shared_prefixes_are_the_same_tokens_and_log_probs_are_exact(policy):
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    r = sample_tree(policy, ["12+34=", "5+6="], params, [2, 2, 2], [2, 5], group_ids=[0, 1], seed=3)
    ids, seg = r.actions.completion_ids, r.tree_segment
    for a in range(16):
        for b in range(16):
            same = [d for d in (1, 2) if r.tree_path[a, d] == r.tree_path[b, d] >= 0]
            for d in same:  # rows through the same node share its segment token for token
                assert torch.equal(ids[a][seg[a] == d], ids[b][seg[b] == d])
    with torch.no_grad():
        scored = policy.log_probs(r.actions, temperature=1.0).logp  # [16, T]
    assert torch.allclose(scored[r.mask], r.engine_logp[r.mask], atol=1e-4)


def test_a_tree_of_depth_one_is_the_flat_group_exactly(policy):
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    tree = sample_tree(policy, ["1+2=", "30+4="], params, [4], [], group_ids=[7, 8], seed=11)
    flat = policy.sample(["1+2=", "30+4="], 4, params, group_ids=[7, 8], seed=11)
    for f in fields(Rollout):
        a, b = getattr(tree, f.name), getattr(flat, f.name)
        if f.name in ("tree_path", "tree_segment", "generated", "info"):
            continue
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f.name
    for f in fields(tree.actions):
        a, b = getattr(tree.actions, f.name), getattr(flat.actions, f.name)
        assert (a is None and b is None) or torch.equal(a, b), f.name
    assert tree.info["completion"] == flat.info["completion"]
    assert torch.equal(tree.generated, tree.mask.sum(1))  # nothing shared


def test_a_tree_does_not_depend_on_the_batch_around_it(policy):
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    both = sample_tree(policy, ["1+2=", "3+4="], params, [2, 2], [3], group_ids=[4, 6], seed=2)
    alone = sample_tree(policy, ["3+4="], params, [2, 2], [3], group_ids=[6], seed=2)
    assert torch.equal(both.tree_path[4:], alone.tree_path)
    assert both.info["completion"][4:] == alone.info["completion"]


@pytest.mark.parametrize(
    "branching, branch_at, message",
    [
        ([2, 2], [], "needs 1 offsets"),
        ([2, 2], [6], "strictly"),
        ([2, 0], [2], "count >= 1"),
        ([2, 2, 2], [3, 3], "strictly"),
    ],  # fmt: skip
)
def test_tree_shape_errors_name_the_option(branching, branch_at, message):
    with pytest.raises(ValueError, match=message):
        check_tree(branching, branch_at, 6)


def test_tree_config_runs_in_the_loop_and_counts_generated_tokens(tmp_path, tiny_model_dir):
    tree = "rollout.tree={type: fixed, branching: [2, 2], branch_at: [2]}"
    train(make_cfg(tmp_path, tiny_model_dir, tree, "rollout.seeding=per_sample"))
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    # 2 groups of 4 leaves, at most 4 tokens each: shared depth-1 segments are generated once
    assert all(r["rollout/sampled_actions"] < 2 * 4 * r["response_length/mean"] for r in rows)
    with pytest.raises(ValueError, match="product of branching"):
        make_cfg(
            tmp_path, tiny_model_dir, "rollout.tree={type: fixed, branching: [3], branch_at: []}"
        )
    with pytest.raises(ValueError, match="branch_at in TURNS"):  # agents branch at turns
        from grouprl.config.loading import apply_overrides, validate

        validate(apply_overrides({
            "workload": {"type": "agent"}, "model": {"name_or_path": str(tiny_model_dir)},
            "task": {"name": "env", "options": {"env_id": "grouprl/FrozenLake-v0"}},
            "rollout": {"tree": {"type": "fixed", "branching": [2, 4], "segment_tokens": 2}},
        }, []))  # fmt: skip


def final_weights(run_dir):
    from safetensors.torch import load_file

    from grouprl.runtime.checkpoint import CheckpointManager

    return load_file(CheckpointManager(run_dir).latest() / "model" / "model.safetensors")


@pytest.mark.parametrize("preset", ["grpo", "treerpo"])
def test_a_depth_one_tree_trains_exactly_like_flat_grpo(preset, tmp_path, tiny_model_dir):
    """branching [G]: the tree is the flat group (same seeds, same rows), every tree advantage
    mode reduces to GRPO's on it and the shared-segment scales are 1, so the weights are the same
    bits as plain GRPO's."""
    common = ["rollout.seeding=per_sample", "rollout.group_size=4", "run.seed=5"]
    flat = tmp_path / "flat"
    train(make_cfg(flat, tiny_model_dir, *common, "algorithm.preset=grpo"))
    tree = tmp_path / "tree"
    train(make_cfg(tree, tiny_model_dir, *common, f"algorithm.preset={preset}",
                   "rollout.tree={type: fixed, branching: [4]}"))  # fmt: skip
    a, b = final_weights(flat / "run"), final_weights(tree / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_treerpo_trains_on_a_real_tree(tmp_path, tiny_model_dir):
    train(make_cfg(tmp_path, tiny_model_dir, "algorithm.preset=treerpo", "rollout.group_size=8",
                   "rollout.seeding=per_sample", "train.steps=2"))  # fmt: skip
    rows = train_rows(tmp_path / "run")
    assert len(rows) == 2 and all(r["rollout/sampled_actions"] < 2 * 8 * 4 for r in rows)
    with pytest.raises(ValueError, match="needs a tree"):
        make_cfg(tmp_path, tiny_model_dir, "algorithm.tree_advantage=treerpo")


@pytest.mark.parametrize("threshold", [2.0, 5.45])
def test_entropy_tree_branches_before_its_first_uncertain_token(policy, threshold):
    from grouprl.rollouts.fork import sample_entropy_tree

    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    r = sample_entropy_tree(policy, ["1+2=", "3+4="], params, [2, 2, 2], threshold=threshold,
                            min_tokens=1, group_ids=[0, 1], seed=4)  # fmt: skip
    with torch.no_grad():
        out = policy.log_probs(r.actions, temperature=1.0, with_entropy=True)
    assert torch.allclose(out.logp[r.mask], r.engine_logp[r.mask], atol=1e-4)
    ent, seg = out.entropy, r.tree_segment  # [16, T]
    for i in range(16):
        n = int(r.actions.completion_mask[i].sum())
        depths = seg[i, :n].tolist()
        for d in sorted(set(depths)):
            where = [t for t in range(n) if depths[t] == d]
            start, end = where[0], where[-1] + 1
            followed = end < n  # a deeper segment starts at `end`: the cut token
            if followed:
                assert float(ent[i, end]) > threshold and end - start >= 1
            if d < 3:  # a branching depth: no earlier token of its segment (past min_tokens)
                # was over the threshold (the last depth runs to the end, uncut)
                assert all(float(ent[i, t]) <= threshold for t in range(start + 1, end))
    per_node = {}
    for i in range(16):
        for d in (1, 2, 3):
            node = int(r.tree_path[i, d])
            if node >= 0:
                per_node[node] = int((seg[i] == d).sum())
    assert int(r.generated.sum()) == sum(per_node.values())  # every sampled token kept once


def test_entropy_tree_config_trains(tmp_path, tiny_model_dir):
    tree = "rollout.tree={type: entropy, branching: [2, 2], threshold: 5.0}"
    train(make_cfg(tmp_path, tiny_model_dir, tree, "algorithm.preset=treerpo",
                   "rollout.seeding=per_sample"))  # fmt: skip
    assert len(train_rows(tmp_path / "run")) == 2
