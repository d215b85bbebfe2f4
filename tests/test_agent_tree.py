"""Tree rollouts of multi-turn agents (grouprl/rollouts/agent_fork.py): turns as nodes, envs
re-created by replay, a tree of depth 1 equal to the flat group, tree advantages in the agent
workload and the tree_grpo preset."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from grouprl.envs.gym import make_text_env
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.agent_fork import Forker, check_turn_tree
from grouprl.rollouts.episode_record import Episode
from grouprl.rollouts.fork import NODES_PER_TREE
from grouprl.rollouts.multi_turn import collect_episodes
from grouprl.rollouts.seeds import turn_seed
from grouprl.train import train

sys.path.insert(0, str(Path(__file__).parent))
from test_agent_train import make_cfg  # noqa: E402
from test_methods_train import train_rows  # noqa: E402
from test_multi_turn import CounterEnv, scripted_policy  # noqa: E402
from test_tree_rollouts import final_weights  # noqa: E402

TURN = 21  # "<action>inc</action>" + EOS: the scripted engine's turn, in char tokens


def run_tree(policy, seeds, tree, group_size, max_turns=3, **kw):
    kw.setdefault("max_turn_tokens", 32)
    return collect_episodes(policy, CounterEnv, list(seeds), group_size, SamplingParams(),
                            max_turns=max_turns, tree=tree, **kw)  # fmt: skip


def test_turn_tree_shape_paths_segments_and_generated_tokens():
    """Seed 0 (n = 0, target 3): every episode takes 3 turns. branching [2, 2] forked before
    turn 1: the depth-1 node holds turn 0 (+ its observation), depth 2 turns 1-2."""
    r = run_tree(scripted_policy(), [0], ([2, 2], [1]), 4, first_group_id=3)
    root = 3 * NODES_PER_TREE
    # root children 1, 2; node 1's children 3, 4; node 2's children 5, 6 (made in row order)
    want = [[root, root + 1, root + 3], [root, root + 1, root + 4],
            [root, root + 2, root + 5], [root, root + 2, root + 6]]  # fmt: skip
    assert r.tree_path.tolist() == want
    seg, step = r.tree_segment, r.step_ids  # [N, T]
    assert ((seg == 1) == ((step == 0) | ((step == -1) & (seg == 1)))).all()
    for i in range(4):  # turn 0 is depth 1, turns 1-2 depth 2, env tokens follow their turn
        turns = step[i][step[i] >= 0]
        assert (seg[i][step[i] >= 0] == torch.where(turns == 0, 1, 2)).all()
        first_obs = (step[i] == -1).nonzero()[0, 0]  # the observation after turn 0
        assert seg[i, first_obs] == 1 and seg[i, r.actions.completion_mask[i]].min() == 1
        assert (seg[i][~r.actions.completion_mask[i]] == -1).all()
    # hand count: a depth-1 node's turn counts at its first row, each leaf's 2 turns at itself
    assert r.generated.tolist() == [3 * TURN, 2 * TURN, 3 * TURN, 2 * TURN]
    assert int(r.generated.sum()) == 10 * TURN < int(r.mask.sum()) == 12 * TURN
    assert r.info["env_made"] == [2, 3, 4, 5]  # 2 roots, then 4 replayed children
    assert r.rewards["return"].tolist() == [1.0] * 4 and all(r.info["success"])


def test_a_path_that_ended_is_copied_into_its_branches():
    """Seed 2 (n = 2): done after one turn, before the branch point at turn 1: its 2 children
    are copies (path -1 past depth 1, no new node, no new env, tokens counted once)."""
    r = run_tree(scripted_policy(), [2], ([2, 2], [1]), 4)
    assert (r.tree_path[:, 2] == -1).all() and r.tree_path[:, 1].tolist() == [1, 1, 2, 2]
    assert r.generated.tolist() == [TURN, 0, TURN, 0]
    assert r.info["env_made"] == [0, 0, 1, 1] and r.info["turns"] == [1] * 4


def test_fork_after_every_path_ended_still_gives_all_leaves():
    r = run_tree(scripted_policy(), [2], ([1, 3], [2]), 3)  # ends at turn 0, branch at turn 2
    assert len(r) == 3 and r.generated.tolist() == [TURN, 0, 0]


def test_a_tree_of_depth_one_is_the_flat_group_exactly(tiny_model_dir):
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    params = SamplingParams(temperature=1.0)
    kw = dict(max_turns=3, max_turn_tokens=6, seed=7)
    flat = collect_episodes(policy, CounterEnv, [0, 1], 3, params, **kw)
    tree = collect_episodes(policy, CounterEnv, [0, 1], 3, params, tree=([3], []), **kw)
    for name in ("old_logp", "mask", "step_ids", "step_rewards"):
        assert torch.equal(getattr(flat, name), getattr(tree, name)), name
    assert torch.equal(flat.actions.completion_ids, tree.actions.completion_ids)
    assert flat.tree_path is None and tree.generated.tolist() == flat.mask.sum(1).tolist()
    assert (tree.tree_segment[tree.actions.completion_mask] == 1).all()
    # and both are the episodes of the per-sample contract: turn 0 of episode j of group g is
    # drawn from generator turn_seed(7, g, j, 0), whatever the batch
    prompts = [row[m].tolist() for row, m in zip(tree.actions.prompt_ids, tree.actions.prompt_mask)]
    alone = policy.engine.generate(
        prompts, replace(params, max_new_tokens=6),
        seeds=[turn_seed(7, g, j, 0) for g in range(2) for j in range(3)],
    )  # fmt: skip
    for i, ids in enumerate(alone.completion_ids):
        assert tree.actions.completion_ids[i, : len(ids)].tolist() == list(ids)


def test_siblings_share_their_prefix_and_diverge_after_it(tiny_model_dir):
    """Real sampling: the children of one node hold the same tokens up to the fork, then sample
    on their own; every sampled token's engine log-prob is the policy's."""
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    params = SamplingParams(temperature=1.0)
    r = collect_episodes(policy, CounterEnv, [0], 4, params, max_turns=3, max_turn_tokens=6,
                         seed=3, tree=([1, 4], [1]))  # fmt: skip
    ids, seg = r.actions.completion_ids, r.tree_segment  # [N, T]
    shared = int((seg[0] == 1).sum())
    assert all(torch.equal(ids[i, :shared], ids[0, :shared]) for i in range(4))
    assert len({tuple(ids[i, shared:].tolist()) for i in range(4)}) > 1
    assert r.generated.tolist()[0] > max(r.generated.tolist()[1:])
    logp = policy.log_probs(r.actions, with_entropy=False).logp.detach()
    torch.testing.assert_close(logp[r.mask], r.engine_logp[r.mask], atol=1e-5, rtol=0)


def test_an_agent_tree_does_not_depend_on_the_batch_around_it(tiny_model_dir):
    """Per-sample seeds per node: trees collected together or one group at a time (as on two
    processes) are the same tokens, node ids and generated counts."""
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    kw = dict(max_turns=3, max_turn_tokens=6, seed=9, tree=([2, 2], [1]))
    params = SamplingParams(temperature=1.0)
    both = collect_episodes(policy, CounterEnv, [0, 1], 4, params, **kw)
    one = collect_episodes(policy, CounterEnv, [0], 4, params, **kw)
    two = collect_episodes(policy, CounterEnv, [1], 4, params, first_group_id=1, **kw)

    def tokens(r):
        return [row[m].tolist() for row, m in zip(r.actions.completion_ids, r.mask)]

    assert tokens(both) == tokens(one) + tokens(two)
    assert torch.equal(both.tree_path, torch.cat([one.tree_path, two.tree_path]))
    assert both.generated.tolist() == one.generated.tolist() + two.generated.tolist()
    assert len({str(t) for t in tokens(one)}) > 1


def test_replay_recreates_a_slippery_frozenlake_exactly():
    """The fork re-creates an env by seed + actions; on slippery FrozenLake (random transitions
    from the seeded np_random) the replayed env then steps exactly like the original."""
    make = lambda: make_text_env("grouprl/FrozenLake-v0", is_slippery=True, max_steps=20)  # noqa: E731
    moves = ["<action>up</action>", "<action>left</action>"]  # the start's safe sides
    env = make()
    env.reset(seed=11)
    e = Episode(env, 0, 11, [], [], None, path=[0, 1])
    for a in moves:
        obs, _, term, trunc, _ = env.step(a)
        e.replay.append((a, obs))
        assert not (term or trunc)
    twin = Forker(make, {0: 2})._replay(e)
    later = ["<action>right</action>", "<action>down</action>"] * 4
    outcomes = []
    for a in later:
        got, want = twin.step(a), env.step(a)
        assert got[:4] == want[:4]
        outcomes.append(got[0])
        if got[2] or got[3]:
            break
    assert len(set(outcomes)) > 1  # the walk went somewhere


class NoisyEnv(CounterEnv):
    """Its observation depends on a draw that the reset seed does not fix."""

    draws = iter(range(1000))

    def step(self, action):
        obs, *rest = super().step(action)
        return f"{obs} #{next(self.draws)}", *rest


def test_replay_of_an_env_that_the_seed_does_not_fix_fails_loudly():
    with pytest.raises(RuntimeError, match="deterministic given both"):
        collect_episodes(scripted_policy(), NoisyEnv, [0], 2, SamplingParams(), max_turns=3,
                         max_turn_tokens=32, tree=([1, 2], [1]))  # fmt: skip


@pytest.mark.parametrize(
    ("branching", "branch_at", "message"),
    [([2, 2], [], "needs 1 turn counts"), ([2, 2], [3], "inside"), ([2, 2], [0], "inside")],
)
def test_turn_tree_shape_errors_name_the_option(branching, branch_at, message):
    with pytest.raises(ValueError, match=message):
        check_turn_tree(branching, branch_at, 3)


def test_agent_tree_config_checks(tmp_path, tiny_model_dir):
    def cfg(*more):
        return make_cfg(tmp_path, tiny_model_dir, "agent.max_turns=3", "agent.credit=trajectory",
                        "rollout.group_size=4", *more)  # fmt: skip

    cfg("rollout.tree={type: fixed, branching: [2, 2], branch_at: [1]}")
    default = cfg("rollout.tree={type: fixed, branching: [2, 2]}").rollout.tree
    assert default.offsets(3) == [1]  # max_turns split in equal turn segments
    with pytest.raises(ValueError, match="branch_at in TURNS"):
        cfg("rollout.tree={type: fixed, branching: [2, 2], segment_tokens: 8}")
    with pytest.raises(ValueError, match="agent.max_turns=3"):
        cfg("rollout.tree={type: fixed, branching: [2, 2], branch_at: [3]}")
    with pytest.raises(ValueError, match="agent.credit=trajectory"):
        cfg("rollout.tree={type: fixed, branching: [2, 2], branch_at: [1]}",
            "algorithm.tree_advantage=tree_grpo", "agent.credit=gigpo")  # fmt: skip


def test_tree_grpo_preset_pins_its_formula(tmp_path, tiny_model_dir):
    """tree_grpo: A_i = GRPO of the return over the tree + GRPO over the trees of the same
    start (eps 1e-6), the same on every agent token of row i, 0 on env tokens. Two trees of one
    start (FrozenLake's fixed map: every seed starts alike), returns [1, 0, 0, 0] and [1, 1, 0, 0]:
    intra tree 1: mean .25, std (unbiased) .5 -> [1.5, -.5, -.5, -.5]; tree 2: mean .5, std
    .57735 -> +-.866025; inter over all 8: mean .375, std .517549 -> 1.207615 / -.724569."""
    from grouprl.workloads.agent import tree_advantages

    cfg = make_cfg(tmp_path, tiny_model_dir, "algorithm.preset=tree_grpo", "agent.max_turns=3",
                   "rollout.group_size=8")  # fmt: skip
    a = cfg.algorithm
    assert (a.tree_advantage, a.tree_scales, a.adv_eps, cfg.agent.credit) == (
        "tree_grpo", "none", 1e-6, "trajectory")  # fmt: skip
    assert cfg.rollout.tree.branching == [2, 2, 2] and cfg.rollout.group_size == 8
    r = collect_episodes(scripted_policy(), CounterEnv, [0, 3], 4, SamplingParams(), max_turns=3,
                         max_turn_tokens=32, tree=([2, 2], [1]))  # fmt: skip
    r.rewards["return"] = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
    adv = tree_advantages(cfg, r)  # [N, T]
    hi, lo = 1.207615, -0.724569
    want = [1.5 + hi, -0.5 + lo, -0.5 + lo, -0.5 + lo,
            0.866025 + hi, 0.866025 + hi, -0.866025 + lo, -0.866025 + lo]  # fmt: skip
    per_row = torch.stack([adv[i][r.mask[i]].unique() for i in range(8)]).squeeze(1)  # [N]
    torch.testing.assert_close(per_row, torch.tensor(want), atol=1e-5, rtol=0)
    assert (adv[~r.mask] == 0).all()


def test_a_depth_one_agent_tree_trains_exactly_like_flat_grpo(tmp_path, tiny_model_dir):
    """branching [G] on the agent workload: the same episodes (seeds), and with the per-turn
    credit over the leaves the same advantages, so 2 steps give the same weights, bit for bit."""
    common = ["rollout.seeding=per_sample", "rollout.group_size=3", "run.seed=5", "train.steps=2",
              "algorithm.preset=grpo", "agent.credit=trajectory", "checkpoint.every=1"]  # fmt: skip
    train(make_cfg(tmp_path / "flat", tiny_model_dir, *common))
    train(make_cfg(tmp_path / "tree", tiny_model_dir, *common,
                   "rollout.tree={type: fixed, branching: [3]}"))  # fmt: skip
    a, b = final_weights(tmp_path / "flat" / "run"), final_weights(tmp_path / "tree" / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_depth_one_tree_under_the_tree_grpo_preset_is_plain_grpo(tmp_path, tiny_model_dir):
    """One prompt per step, so one tree per start state: no inter-tree term, and a tree of depth
    1 is the flat group with GRPO's advantage: the preset trains bit for bit like GRPO with the
    preset's eps (1e-6) and trajectory credit."""
    common = ["rollout.seeding=per_sample", "rollout.group_size=4", "run.seed=5", "train.steps=2",
              "rollout.prompts_per_step=1", "checkpoint.every=1", "agent.max_turns=3"]  # fmt: skip
    train(make_cfg(tmp_path / "flat", tiny_model_dir, *common, "algorithm.preset=grpo",
                   "algorithm.adv_eps=1e-6", "agent.credit=trajectory"))  # fmt: skip
    train(make_cfg(tmp_path / "tree", tiny_model_dir, *common, "algorithm.preset=tree_grpo",
                   "rollout.tree={type: fixed, branching: [4]}"))  # fmt: skip
    a, b = final_weights(tmp_path / "flat" / "run"), final_weights(tmp_path / "tree" / "run")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tree_grpo_trains_on_a_real_agent_tree(tmp_path, tiny_model_dir):
    train(make_cfg(tmp_path, tiny_model_dir, "algorithm.preset=tree_grpo", "agent.max_turns=3",
                   "rollout.group_size=8", "rollout.seeding=per_sample", "train.steps=2", "checkpoint.every=1"))  # fmt: skip
    rows = train_rows(tmp_path / "run")
    assert len(rows) == 2
    # 2 trees of 8 leaves, 3 turns of <= 6 tokens: shared turns are sampled once
    assert all(0 < r["rollout/sampled_actions"] < 2 * 8 * 3 * 6 for r in rows)


@pytest.mark.parametrize("execution", ["sequential", "processes"])
def test_agent_collect_forks_guarded_envs_and_maps_env_errors_to_rows(
    execution, tmp_path, tiny_model_dir
):
    """Through the workload's collect: envs behind the guard (in their own process with
    `processes`) are re-created by replay; env_error has one entry per row (not per env made)."""
    from grouprl.workloads.agent import collect

    cfg = make_cfg(tmp_path, tiny_model_dir, "agent.max_turns=3", "agent.credit=trajectory",
                   "rollout.group_size=4", f"agent.env_execution={execution}",
                   "rollout.tree={type: fixed, branching: [2, 2], branch_at: [1]}")  # fmt: skip
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    examples = [{"env_id": "grouprl/FrozenLake-v0", "env_kwargs": {"max_steps": 3}, "seed": 4}]
    r = collect(cfg, policy, examples, SamplingParams(temperature=1.0, max_new_tokens=6),
                group_size=4, tree=cfg.rollout.tree)  # fmt: skip
    assert len(r) == 4 and r.info["env_error"] == [None] * 4 and "env_made" not in r.info
    assert r.tree_path.shape == (4, 3)
