"""Tree rollouts of a flow policy over denoising steps (policies/flow/fork.py), their advantages and
pruning in the images workload, and the branch_grpo preset.

Exactness: a tree of depth 1 is sample_groups' output (torch.equal on latents and log-probs) and
trains bit for bit like the flat flow_grpo run (final weights after 2 steps). Hand-computed: node
ids, segments, steps run (`generated`), BranchGRPO's depth-wise advantage, pruning.
"""

import pytest
import torch
from test_diffusion_train import final_state, metrics, module_cfg
from test_flow_policy import module_policy

from grouprl.config.loading import validate
from grouprl.objectives.tree import depthwise_advantages, tree_from_paths, tree_token_advantages
from grouprl.objectives.tree_prune import prune_rows
from grouprl.policies.flow.fork import sample_tree_groups
from grouprl.policies.flow.sampling import sample_groups
from grouprl.policies.flow.text_encoders import class_condition
from grouprl.rollouts.fork import NODES_PER_TREE
from grouprl.train import train

P = NODES_PER_TREE


def _gen(seed=3):
    return torch.Generator().manual_seed(seed)


def test_a_tree_of_depth_one_is_the_flat_group():
    pol, cond = module_policy(), class_condition([0, 2], 3)
    flat = sample_groups(pol, cond, 4, generator=_gen(), group_ids=[5, 6])
    tree = sample_tree_groups(pol, cond, [4], [], generator=_gen(), group_ids=[5, 6])
    for a, b in [
        (flat.actions.latents, tree.actions.latents),
        (flat.old_logp, tree.old_logp),
        (flat.mask, tree.mask),
        (flat.actions.stochastic, tree.actions.stochastic),
    ]:
        assert torch.equal(a, b)  # fmt: skip
    assert torch.equal(tree.group_ids, flat.group_ids)
    assert tree.generated.tolist() == [3] * 8  # every row ran its 3 steps itself
    assert tree.tree_path[:, 1].tolist() == [5 * P + i for i in (1, 2, 3, 4)] + [
        6 * P + i for i in (1, 2, 3, 4)
    ]


def test_a_depth_two_tree_shares_its_prefix_and_records_its_shape():
    pol, cond = module_policy(), class_condition([1], 3)
    t = sample_tree_groups(pol, cond, [2, 3], [1], generator=_gen(), group_ids=[7])
    lat = t.actions.latents  # [6, 4, 3, 4, 4]
    # siblings share x_0 and x_1 (the depth-1 window is step 0) and differ after
    assert torch.equal(lat[0, :2], lat[2, :2]) and not torch.equal(lat[0, 2], lat[1, 2])
    assert not torch.equal(lat[0, 0], lat[3, 0])  # the two depth-1 nodes: own noise
    assert torch.equal(t.old_logp[0, 0], t.old_logp[2, 0])  # one shared transition
    assert t.tree_path.tolist() == [[7 * P, 7 * P + 1, 7 * P + 3 + j] for j in range(3)] + [
        [7 * P, 7 * P + 2, 7 * P + 6 + j] for j in range(3)
    ]
    assert t.tree_segment.tolist() == [[1, 2, 2]] * 6
    assert t.generated.tolist() == [3, 2, 2, 3, 2, 2]  # 2 * 1 + 6 * 2 = 14 steps run, flat: 18
    # the stored transitions re-score exactly (ratio 1 on-policy)
    again = pol.log_probs(t.actions).logp  # [6, 3]
    assert torch.equal(again, t.old_logp)


def test_an_ode_prefix_shared_by_the_group_runs_once():
    steps = {"name": "sliding_window", "window_size": 2, "window_range": (1, 3)}
    pol = module_policy(steps=steps, initial_noise="shared")
    rows = []
    predict = pol.predict

    def counting(model, x, *args, **kw):
        rows.append(len(x))
        return predict(model, x, *args, **kw)

    pol.predict = counting
    t = sample_tree_groups(pol, class_condition([0, 1], 3), [2, 2], [1], generator=_gen(),
                           group_ids=[0, 1])  # fmt: skip
    assert rows == [2, 8, 8]  # step 0 once per group, then the 8 leaves
    assert t.generated.tolist() == [3, 2, 2, 2] * 2  # 1 shared step + 4 leaves * 2, per group
    assert not t.actions.stochastic[:, 0].any()
    assert torch.equal(t.actions.latents[0, :2], t.actions.latents[3, :2])


def test_depthwise_advantage_by_hand():
    # one tree: root 0, depth-1 nodes 1, 2, leaves 3, 4 (under 1) and 5, 6 (under 2)
    parent = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
    values = torch.tensor([2.5, 1.5, 3.5, 1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    a = depthwise_advantages(parent, values, eps=0.0)
    s1 = (2 * 1.0**2) ** 0.5  # unbiased std of [1.5, 3.5]
    s2 = ((2.25 + 0.25 + 0.25 + 2.25) / 3) ** 0.5  # of [1, 2, 3, 4], mean 2.5
    want = [0.0, -1 / s1, 1 / s1, -1.5 / s2, -0.5 / s2, 0.5 / s2, 1.5 / s2]
    assert torch.allclose(a, torch.tensor(want, dtype=torch.float64))
    # the per-step slots through tree_token_advantages: the rows' paths of a 2 x 2 tree
    path = torch.tensor([[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 6]])
    segment = torch.tensor([[1, 2, 2]] * 4)
    par, node = tree_from_paths(path, segment)
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    adv = tree_token_advantages(par, node, torch.ones(4, 3, dtype=torch.bool), rewards,
                                torch.zeros(4, dtype=torch.long), mode="branch_grpo", eps=0.0)  # fmt: skip
    assert torch.allclose(adv[:, 0], torch.tensor(want[1:3]).repeat_interleave(2).float())
    assert torch.allclose(adv[:, 1], torch.tensor(want[3:]).float())
    assert torch.equal(adv[:, 1], adv[:, 2])


def test_prune_rows_drops_the_lowest_rewards_of_each_tree():
    r = torch.tensor([0.3, 0.1, float("nan"), 0.9, 5.0, 4.0, 6.0, 4.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    assert prune_rows(r, g, 0.5).tolist() == [False, True, True, False,
                                              False, True, False, True]  # fmt: skip
    assert prune_rows(r, g, 0.3).tolist() == [False, False, True, False,
                                              False, True, False, False]  # fmt: skip
    assert not prune_rows(r, g, 0.0).any()
    with pytest.raises(ValueError, match="prune_fraction"):
        prune_rows(r, g, 1.0)


def test_tree_config_counts_denoising_steps(tmp_path):
    with pytest.raises(ValueError, match="diffusion.rollout_steps=3"):
        module_cfg(tmp_path, "rollout.tree={type: fixed, branching: [2, 2], branch_at: [3]}")
    with pytest.raises(ValueError, match="sampler"):
        cfg = module_cfg(tmp_path, "rollout.tree={type: fixed, branching: [2, 2]}",
                         "diffusion.sampler=ode")  # fmt: skip
        train(cfg)
    with pytest.raises(ValueError, match="objective"):
        module_cfg(tmp_path, "rollout.tree={type: fixed, branching: [2, 2]}",
                   "diffusion.objective={type: awm}")  # fmt: skip
    cfg = module_cfg(tmp_path, "rollout.tree={type: fixed, branching: [2, 2], segment_tokens: 2}")
    assert cfg.rollout.tree.offsets(cfg.diffusion.rollout_steps) == [2]


def test_a_depth_one_tree_trains_bit_for_bit_like_flow_grpo(tmp_path):
    common = ("train.steps=2", "algorithm.minibatches=1")
    train(module_cfg(tmp_path / "flat", *common))
    train(module_cfg(tmp_path / "tree", *common, "rollout.tree={type: fixed, branching: [4]}"))
    a, b = final_state(tmp_path / "flat" / "run"), final_state(tmp_path / "tree" / "run")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma, mb = metrics(tmp_path / "flat" / "run"), metrics(tmp_path / "tree" / "run")
    assert [r["rollout/sampled_actions"] for r in ma] == [r["rollout/sampled_actions"] for r in mb]
    assert ma[0]["rollout/sampled_actions"] == 2 * 4 * 3  # denoising steps run, not trained (16)


@pytest.mark.parametrize("ratio_norm", ["off", "grpo_guard"])  # guard: [n, K] advantages
def test_a_branching_tree_trains_with_depthwise_advantages_and_pruning(tmp_path, ratio_norm):
    cfg = module_cfg(tmp_path, "rollout.tree={type: fixed, branching: [2, 2], branch_at: [1], "
                     "prune_fraction: 0.25}", "algorithm.tree_advantage=branch_grpo",
                     "algorithm.tree_scales=shared_segment",
                     f"diffusion.objective={{type: policy_gradient, ratio_norm: {ratio_norm}}}")  # fmt: skip
    train(cfg)
    (row,) = metrics(tmp_path / "run")
    assert row["rollout/sampled_actions"] == 2 * (2 * 1 + 4 * 2)  # flat: 2 * 4 * 3 = 24
    assert row["tree/pruned_frac"] == 0.25
    assert row["trained_steps/mean"] == 1.5  # 2 trained steps, one row in four masked
    assert all(v == v for v in row.values() if isinstance(v, float))


def test_branch_grpo_preset_resolves_to_a_step_tree():
    cfg = validate({"workload": {"type": "images"}, "model": {"name_or_path": "x", "type": "flow"},
                    "task": {"name": "image_prompts"}, "algorithm": {"preset": "branch_grpo"}})  # fmt: skip
    t = cfg.rollout.tree
    assert (t.branching, t.branch_at, t.leaves) == ([2, 2, 2, 2], [3, 6, 9], 16)
    assert cfg.rollout.group_size == 16 and cfg.algorithm.tree_advantage == "branch_grpo"
    assert cfg.diffusion.shared_noise == "group" and cfg.diffusion.rollout_steps == 16


def test_pruned_rows_leave_the_forward_pass_and_keep_the_gradient(tmp_path):
    from grouprl.envs.tasks import build_task
    from grouprl.objectives.objective import count_tokens
    from grouprl.workloads import build_policy
    from grouprl.workloads.images import loss as image_loss
    from grouprl.workloads.images import sampling as images

    cfg = module_cfg(tmp_path, "rollout.tree={type: fixed, branching: [2, 2], branch_at: [1], "
                     "prune_fraction: 0.5}", "algorithm.tree_advantage=branch_grpo",
                     "algorithm.kl_coef=0")  # fmt: skip
    policy = build_policy(cfg, torch.device("cpu"))
    task = build_task(cfg.task.name, **cfg.task.options)
    torch.manual_seed(0)
    rollout, _ = images.collect(cfg, policy, task.train[:2], dict(task.reward_fns))
    image_loss.prepare(cfg, policy, rollout, {"color_area": 1.0})
    assert rollout.mask.any(1).tolist().count(False) == 4  # 2 of the 4 leaves of each tree
    counts = count_tokens(rollout.mask, max_len=3, group_ids=rollout.group_ids)
    seen = []
    log_probs = policy.log_probs

    def counting(batch, **kw):
        seen.append(len(batch))
        return log_probs(batch, **kw)

    policy.log_probs = counting
    grads = []
    for fn in (image_loss._policy_gradient, image_loss._pg_rows):  # rows dropped / all rows
        policy.model.zero_grad()
        res, old = fn(cfg, policy, rollout, counts, True)
        res.loss.backward()
        grads.append([p.grad.clone() for p in policy.model.parameters()])
        assert old.shape == rollout.old_logp.shape
    assert seen == [4, 8]
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(*grads))
    assert any(bool(a.abs().sum() > 0) for a in grads[0])


def test_the_branch_grpo_preset_trains_with_a_tree_fitted_to_the_model(tmp_path):
    train(module_cfg(tmp_path, "algorithm.preset=branch_grpo", "rollout.group_size=4",
                     "rollout.tree={type: fixed, branching: [2, 2], branch_at: [1]}",
                     "diffusion.rollout_steps=3", "train.steps=1"))  # fmt: skip
    (row,) = metrics(tmp_path / "run")
    assert row["rollout/sampled_actions"] < 2 * 4 * 3  # shared first steps run once per node
    assert all(v == v for v in row.values() if isinstance(v, float))
