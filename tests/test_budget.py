"""rollout.budget: pass history, GRESO's skip rule and exploration update, the G allocator (worked
examples by hand), unequal groups through collect / advantages / batching, config refusals, and
short training runs with exact resume."""

from __future__ import annotations

import json
import math

import pytest
import torch

from grouprl.config.budget import AllocateBudget, GresoBudget
from grouprl.config.loading import apply_overrides, validate
from grouprl.objectives import compute_advantages, count_tokens
from grouprl.rollouts.batching import split_batch
from grouprl.rollouts.budget.allocate import allocate_group_sizes, largest_remainder, uncertainty
from grouprl.rollouts.budget.greso import (
    adjust_exploration,
    prompt_skip_probability,
    skip_probability,
)
from grouprl.rollouts.budget.history import PassHistory, group_outcomes, prompt_key
from grouprl.rollouts.budget.sampler import BudgetSampler
from grouprl.rollouts.filters import informative_groups
from grouprl.rollouts.prompt_sampler import PromptSampler
from grouprl.types import Rollout

# ---- GRESO's rule by hand ------------------------------------------------------------------------


def test_skip_probability_by_hand():
    # P_skip = 1 - max(p^z, 0.01)
    assert skip_probability(0, 0.5) == 0.0  # no zero-variance streak: always sampled
    assert skip_probability(1, 0.5) == pytest.approx(0.5)
    assert skip_probability(3, 0.5) == pytest.approx(1 - 0.125)
    assert skip_probability(7, 0.5) == pytest.approx(0.99)  # 0.5^7 = 0.0078 < 0.01: the floor
    assert skip_probability(2, 0.95) == pytest.approx(1 - 0.9025)
    assert skip_probability(2, 0.5, min_keep=1.0) == 0.0
    # easy streak uses p_easy, hard streak p_hard
    assert prompt_skip_probability(2, 0, 0.5, 0.9) == pytest.approx(0.75)
    assert prompt_skip_probability(0, 2, 0.5, 0.9) == pytest.approx(1 - 0.81)
    with pytest.raises(ValueError):
        skip_probability(-1, 0.5)


def test_exploration_update_by_hand():
    kw = dict(step=0.01, low=0.05, high=0.95)
    # observed zero-variance share at / above the target: skip more (p down), else p up
    assert adjust_exploration(0.5, 0.25 / 3, 0.25 / 3, **kw) == pytest.approx(0.49)
    assert adjust_exploration(0.5, 0.05, 0.25 / 3, **kw) == pytest.approx(0.51)
    assert adjust_exploration(0.05, 1.0, 0.1, **kw) == 0.05  # clamped at p_min
    assert adjust_exploration(0.95, 0.0, 0.1, **kw) == 0.95  # clamped at p_max


# ---- the allocator by hand ------------------------------------------------------------------------


def test_allocator_worked_example():
    """5 prompts, G = 4 -> total 20, floor 2 -> 10 to share by w = sqrt(p(1-p)):
    p = [0.5, 0.5, 0.1, 0.9, 0.0] -> w = [0.5, 0.5, 0.3, 0.3, 0], sum 1.6
    shares = 10 w / 1.6 = [3.125, 3.125, 1.875, 1.875, 0] -> floors [3, 3, 1, 1, 0] (8),
    2 left to the largest fractions (0.875, 0.875: prompts 2, 3) -> [3, 3, 2, 2, 0]
    G = 2 + that = [5, 5, 4, 4, 2], sum 20."""
    assert uncertainty(0.1) == pytest.approx(0.3)
    g = allocate_group_sizes([0.5, 0.5, 0.1, 0.9, 0.0], total=20, min_size=2)
    assert g == [5, 5, 4, 4, 2] and sum(g) == 20


def test_allocator_ties_totals_and_edges():
    assert allocate_group_sizes([0.3, 0.3, 0.3], total=10, min_size=2) == [4, 3, 3]  # tie: low i
    assert allocate_group_sizes([0.0, 1.0], total=8, min_size=2) == [4, 4]  # all w = 0: uniform
    assert allocate_group_sizes([0.5], total=8, min_size=2) == [8]  # one prompt takes all
    assert allocate_group_sizes([0.5, 0.5], total=4, min_size=2) == [2, 2]  # nothing to share
    assert largest_remainder([1.5, 1.5, 1.0], 4) == [2, 1, 1]
    for rates in ([0.01, 0.2, 0.5, 0.77, 0.99, 0.6, 0.33], [0.5] * 7):
        for total in (14, 15, 56, 101):
            g = allocate_group_sizes(rates, total=total, min_size=2)
            assert sum(g) == total and min(g) >= 2
            assert g == allocate_group_sizes(rates, total=total, min_size=2)  # deterministic
    with pytest.raises(ValueError, match="min_group_size"):
        allocate_group_sizes([0.5, 0.5, 0.5], total=5, min_size=2)


# ---- the history ----------------------------------------------------------------------------------


def test_history_streaks_window_and_smoothed_rate():
    h = PassHistory(window=2)
    assert h.streaks("q") == (0, 0) and h.pass_rate("q", 1.0, 1.0) == 0.5  # prior for unseen
    h.record("q", 0, 4, 4)
    h.record("q", 1, 4, 4)
    assert h.streaks("q") == (2, 0)
    h.record("q", 2, 0, 4)
    assert h.streaks("q") == (0, 1)
    assert h.visits("q") == [[1, 4, 4], [2, 0, 4]]  # window 2: the oldest dropped
    assert h.pass_rate("q", 1.0, 1.0) == pytest.approx((4 + 1) / (8 + 2))
    h.record("q", 3, 2, 4)  # mixed: both streaks end
    assert h.streaks("q") == (0, 0)
    other = PassHistory(window=2)
    other.load_state_dict(json.loads(json.dumps(h.state_dict())))  # JSON round trip
    assert other.state_dict() == h.state_dict()
    with pytest.raises(ValueError, match="same window"):
        PassHistory(window=3).load_state_dict(h.state_dict())
    with pytest.raises(ValueError):
        h.record("q", 4, 5, 4)


def _rollout(examples, sizes, accuracy, **more):
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))  # [N]
    rows = [ex for ex, n in zip(examples, sizes) for _ in range(n)]
    n = len(rows)
    rewards = {"format": torch.zeros(n), "accuracy": torch.tensor(accuracy, dtype=torch.float)}
    return Rollout(group_ids=ids, rewards={**rewards, **more}, actions=None,
                   old_logp=torch.zeros(n, 1), mask=torch.ones(n, 1, dtype=torch.bool),
                   examples=rows)  # fmt: skip


def test_group_outcomes_use_accuracy_threshold_and_nan():
    exs = [{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}]
    r = _rollout(exs, [3, 2], [1.0, 0.5, math.nan, 1.0, 1.0])
    out = list(group_outcomes(r, None, 1.0))
    assert out == [("a", 1, 3), (prompt_key(exs[1], None), 2, 2)]  # NaN and 0.5 fail
    assert list(group_outcomes(r, None, 0.5))[0] == ("a", 2, 3)
    with pytest.raises(KeyError, match="key_column 'id'"):
        prompt_key({"prompt": "a"}, "id")


# ---- the sampler ----------------------------------------------------------------------------------


class _Rng:
    """A stand-in RNG whose random() returns a fixed sequence."""

    def __init__(self, values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


def _examples(n):
    return [{"prompt": f"q{i}", "answer": str(i)} for i in range(n)]


def test_greso_sampler_skips_by_hand_and_replaces():
    """Order of draws (seeded shuffle): the first prompt has an all-fail streak of 1 (P_skip = 0.5
    at p_hard 0.5), the second an all-pass streak of 2 (P_skip = 0.75), the third none. Draws
    0.3 < 0.5 skip, 0.8 >= 0.75 keep, third kept without a draw."""
    exs = _examples(3)
    inner = PromptSampler(exs, seed=0)
    order = [ex["prompt"] for ex in PromptSampler(exs, seed=0).next(3)]
    s = BudgetSampler(inner, GresoBudget(), group_size=4, seed=0)
    s.history.record(order[0], 0, 0, 4)
    s.history.record(order[1], 0, 4, 4)
    s.history.record(order[1], 1, 4, 4)
    s._rng = _Rng([0.3, 0.8])
    got = s.next(2)
    assert [e["prompt"] for e in got] == [order[1], order[2]]
    assert s.group_sizes(got) is None
    m = s.finish_step()
    assert m["budget/skipped_prompts"] == 1 and m["budget/predicted_zero_variance"] == 2
    assert m["budget/G_min"] == m["budget/G_max"] == 4


def test_greso_exploration_update_after_the_first_pass():
    exs = _examples(4)
    s = BudgetSampler(PromptSampler(exs, seed=0), GresoBudget(), group_size=2, seed=0)
    r = _rollout(exs, [2, 2, 2, 2], [1, 1, 1, 1, 0, 0, 0, 1])  # pass, pass, fail, mixed
    s.observe(r, step=0)
    m = s.finish_step()  # first pass over the data: p's unchanged (official code: epoch > 0)
    assert (m["budget/p_easy"], m["budget/p_hard"]) == (0.5, 0.5)
    assert m["budget/zero_variance_frac"] == 0.75 and m["budget/all_pass_frac"] == 0.5
    s.inner.epoch = 1
    s.observe(r, step=1)
    m = s.finish_step()
    # easy 0.5 >= 0.25/3: p_easy 0.49; hard 0.25 >= 0.25*2/3 = 0.1667: p_hard 0.49
    assert m["budget/p_easy"] == pytest.approx(0.49) and m["budget/p_hard"] == pytest.approx(0.49)
    r2 = _rollout(exs, [2, 2, 2, 2], [1, 0, 1, 0, 1, 0, 0, 1])  # no zero-variance group
    s.observe(r2, step=2)
    m = s.finish_step()
    assert m["budget/p_easy"] == pytest.approx(0.5) and m["budget/zero_variance_frac"] == 0.0


def test_allocate_sampler_from_history_by_hand():
    """Beta(1, 1)-smoothed rates (passes + 1) / (samples + 2): 0 of 8 -> 0.1, 8 of 8 -> 0.9,
    unseen -> 0.5, 4 of 8 -> 0.5, 0 of 16 -> 1/18; G = 4 and 5 prompts: total 20, floor 2."""
    exs = _examples(5)
    s = BudgetSampler(PromptSampler(exs, seed=0), AllocateBudget(), group_size=4, seed=0)
    s.history.record("q0", 0, 0, 8)  # p = 0.1
    s.history.record("q1", 0, 8, 8)  # p = 0.9
    s.history.record("q3", 0, 4, 8)  # p = 0.5
    s.history.record("q4", 0, 0, 8)
    s.history.record("q4", 1, 0, 8)  # p = 1/18
    # w = [0.3, 0.3, 0.5, 0.5, sqrt(17)/18 = 0.22906]; total 20, floor 2, 10 to share, sum w 1.82906
    # shares = [1.6402, 1.6402, 2.7337, 2.7337, 1.2523] -> floors [1, 1, 2, 2, 1] (7), 3 left to
    # the largest fractions 0.7337 (idx 2, 3), 0.6402 (idx 0) -> [2, 1, 3, 3, 1]
    assert s.group_sizes(exs) == [4, 3, 5, 5, 3]
    m = s.finish_step()
    assert (m["budget/G_min"], m["budget/G_max"]) == (3, 5)


def test_sampler_state_round_trip_and_refusals():
    exs = _examples(5)
    a = BudgetSampler(PromptSampler(exs, seed=1), GresoBudget(), group_size=2, seed=1)
    for step in range(3):
        got = a.next(2)
        a.observe(_rollout(got, [2, 2], [1, 1, 0, 0]), step)
        a.finish_step()
    state = json.loads(json.dumps(a.state_dict()))  # plain JSON
    b = BudgetSampler(PromptSampler(exs, seed=1), GresoBudget(), group_size=2, seed=1)
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    assert [e["prompt"] for e in a.next(4)] == [e["prompt"] for e in b.next(4)]
    c = BudgetSampler(PromptSampler(exs, seed=1), AllocateBudget(), group_size=2, seed=1)
    before = c.state_dict()
    with pytest.raises(ValueError, match="same budget"):
        c.load_state_dict(state)
    assert c.state_dict() == before


# ---- unequal groups through the pipeline ---------------------------------------------------------


def test_unequal_groups_advantages_counts_batches_and_filter():
    """Groups of 3, 1 and 2: rewards [1, 0, 0 | 1 | 1, 1]. Group 0: mean 1/3, sample std
    sqrt(1/3) -> A = [2/3, -1/3, -1/3] / 0.57735 = [1.1547, -0.57735, -0.57735]; the singleton and
    the tied pair get 0."""
    ids = torch.tensor([5, 5, 5, 6, 7, 7])  # [N]
    r = torch.tensor([1.0, 0, 0, 1, 1, 1])  # [N]
    adv = compute_advantages("grpo", r, ids, eps=0.0)
    assert adv.tolist() == pytest.approx([1.1547005, -0.5773503, -0.5773503, 0, 0, 0])
    mask = torch.ones(6, 3, dtype=torch.bool)  # [N, T]
    mask[3] = False  # a fully masked row: its group does not count
    assert count_tokens(mask, group_ids=ids)["num_groups"] == 2
    assert informative_groups(r, ids).tolist() == [True, True, True, False, False, False]
    roll = Rollout(group_ids=ids, rewards={"r": r}, actions=None, old_logp=torch.zeros(6, 3),
                   mask=mask)  # fmt: skip
    torch.manual_seed(0)
    for mb, micro in split_batch(roll, 2, 3, whole_groups=True):
        for idx in micro:  # whole groups only, never split
            for g in ids[idx].unique():
                assert set(idx.tolist()) >= set((ids == g).nonzero().flatten().tolist())
        assert sum(len(i) for i in micro) == len(mb)


def test_collect_with_one_group_size_per_example(tiny_model, tiny_tokenizer):
    from grouprl.policies.text.causal_lm import CausalLMPolicy
    from grouprl.policies.text.engines.base import SamplingParams
    from grouprl.rollouts.single_turn import collect

    policy = CausalLMPolicy(tiny_model, tiny_tokenizer, engine="fast")
    exs = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "4+4=", "answer": "8"}]
    params = SamplingParams(max_new_tokens=3)
    seen = []

    def acc(completions, answer, group_ids, **_):
        seen.append((list(answer), list(group_ids)))
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    r, _ = collect(policy, exs, [3, 1], params, {"accuracy": acc}, first_group_id=10, seed=7)
    assert r.group_ids.tolist() == [10, 10, 10, 11]
    assert [e["answer"] for e in r.examples] == ["3", "3", "3", "8"]
    assert r.info["prompt"] == ["1+2=", "1+2=", "1+2=", "4+4="]
    assert seen == [(["3", "3", "3", "8"], [10, 10, 10, 11])]
    # per-sample seeding: a group's samples depend on its id and index only, not on the G's
    same, _ = collect(policy, exs[:1], 3, params, {"accuracy": acc}, first_group_id=10, seed=7)
    assert r.info["completion"][:3] == same.info["completion"]
    with pytest.raises(ValueError, match="one per group"):
        collect(policy, exs, [3], params, {"accuracy": acc})


def test_dynamic_sampling_keeps_whole_unequal_groups():
    """Rounds of groups sized [3, 1, 2] with rewards [1, 0, 0 | 1 | 0, 1]: the singleton is
    dropped, groups of 3 and 2 kept; 3 groups wanted from 2 per round -> the second round's first
    informative group completes the batch, cut at a group boundary."""
    from grouprl.rollouts.filters import sample_until_full

    def one_round(k, size=None):
        ids = torch.tensor([0, 0, 0, 1, 2, 2]) + 10 * k  # [N]
        r = torch.tensor([1.0, 0, 0, 1, 0, 1])  # [N]
        mask = torch.ones(6, 1, dtype=torch.bool)  # [N, T]
        return Rollout(ids, {"a": r}, None, torch.zeros(6, 1), mask)

    out, m = sample_until_full(one_round, {"a": 1.0}, groups_wanted=3, max_rounds=5)
    assert out.group_ids.tolist() == [0, 0, 0, 2, 2, 10, 10, 10]
    assert m["dynamic/rounds"] == 2.0


def test_text_workload_splits_group_sizes_over_processes(tiny_model_dir, tmp_path):
    """Two fake processes each sample a contiguous share of the prompts: each gets the G's of its
    own share (3 prompts with G = [2, 5, 3] -> rank 0: [2, 5], rank 1: [3])."""
    from grouprl.rollouts.batching import chunks
    from grouprl.rollouts.filters import cat_rollouts
    from grouprl.workloads import build_workload
    from grouprl.workloads.text import causal_lm_policy

    cfg = validate({"workload": {"type": "text"}, "model": {"name_or_path": str(tiny_model_dir)},
                    "task": {"name": "arithmetic"}, "run": {"output_dir": str(tmp_path)},
                    "rollout": {"max_new_tokens": 2, "group_size": 4}})  # fmt: skip
    calls = []

    class TwoRanks:
        def gather_groups(self, examples, first_group_id, make):
            parts = []
            for share in chunks(list(range(len(examples))), 2):
                calls.append(share)
                parts.append(make([examples[i] for i in share], first_group_id + share[0]))
            return cat_rollouts([p[0] for p in parts]), {}

    policy = causal_lm_policy(cfg, torch.device("cpu"))
    w = build_workload(cfg, policy=policy, reward_fns={"accuracy": lambda completions, **_: [0.0]
                       * len(completions)}, weights={"accuracy": 1.0}, dist=TwoRanks())  # fmt: skip
    exs = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3)]
    got = w.collect(policy, exs, first_group_id=4, step=0, group_sizes=[2, 5, 3])
    assert calls == [[0, 1], [2]]
    assert got.rollout.group_ids.tolist() == [4, 4, 5, 5, 5, 5, 5, 6, 6, 6]
    plain = w.collect(policy, exs, first_group_id=0, step=0)  # no sizes: rollout.group_size
    assert plain.rollout.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4


# ---- config ---------------------------------------------------------------------------------------

REWARDS_PY = '''
def parity(completions, **_):
    return [float(sum(map(ord, c)) % 2) for c in completions]


def skewed(prompts, completions, **_):
    """Parity for prompts starting with 0-4, always 0 for 5-9: pass rates differ by prompt."""
    return [float(p[0] in "01234" and sum(map(ord, c)) % 2 == 1)
            for p, c in zip(prompts, completions)]
'''


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("budget_rewards") / "rewards.py"
    path.write_text(REWARDS_PY)
    return path


def make_cfg(out_dir, model_dir, reward_file, *overrides, skewed=False):
    """skewed: the only (so correctness) reward is `skewed`, so the tiny untrained model has pass
    rates that differ by prompt."""
    rewards = [{"name": "accuracy"}, {"name": f"{reward_file}:parity", "weight": 0.5}]
    if skewed:
        rewards = [{"name": f"{reward_file}:skewed"}]
    raw = {
        "run": {"name": "run", "output_dir": str(out_dir), "seed": 0, "device": "cpu",
                "console": False},
        "model": {"name_or_path": str(model_dir)},
        "task": {"name": "arithmetic",
                 "options": {"n_train": 4, "n_eval": 2, "ops": "+", "max_value": 9}},
        "rewards": rewards,
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 3},
        "train": {"steps": 2, "lr": 1e-3},
        "eval": {"every": 0},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


def test_config_refusals(tmp_path, tiny_model_dir, reward_file):
    from grouprl.runtime.async_rollout import check_async
    from grouprl.workloads.base import Capabilities, refuse_unsupported

    cfg = make_cfg(tmp_path, tiny_model_dir, reward_file, "rollout.budget.type=greso")
    assert cfg.rollout.budget.p_easy == 0.5 and cfg.rollout.budget.target_zero_variance == 0.25

    class Toy:
        name, capabilities = "toy", Capabilities()

    with pytest.raises(ValueError, match="workload 'toy' does not support rollout.budget"):
        refuse_unsupported(Toy, cfg)
    with pytest.raises(ValueError, match="rollout.budget"):
        check_async(make_cfg(tmp_path, tiny_model_dir, reward_file, "rollout.budget.type=greso",
                             "train.async_mode=one_step_off"), world=1)  # fmt: skip
    with pytest.raises(ValueError, match="curriculum.type='dump'"):
        make_cfg(tmp_path, tiny_model_dir, reward_file, "rollout.budget.type=allocate",
                 "curriculum.type=dump")  # fmt: skip
    with pytest.raises(ValueError, match="min_group_size=5 > rollout.group_size=4"):
        make_cfg(tmp_path, tiny_model_dir, reward_file, "rollout.budget.type=allocate",
                 "rollout.budget.min_group_size=5")  # fmt: skip
    with pytest.raises(ValueError, match="p_easy"):
        make_cfg(tmp_path, tiny_model_dir, reward_file, "rollout.budget.type=allocate",
                 "rollout.budget.p_easy=0.3")  # fmt: skip
    greso = make_cfg(tmp_path, tiny_model_dir, reward_file, "algorithm.preset=greso")
    assert greso.rollout.budget.type == "greso" and greso.algorithm.dynamic_sampling == (
        "zero_variance"
    )


# ---- training -------------------------------------------------------------------------------------


def _train_rows(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def test_greso_preset_trains_and_skips(tmp_path, tiny_model_dir, reward_file):
    from grouprl.train import train

    train(make_cfg(tmp_path, tiny_model_dir, reward_file, "algorithm.preset=greso",
                   "train.steps=4", "algorithm.max_sampling_rounds=2"))  # fmt: skip
    rows = _train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        for k in ("skipped_prompts", "predicted_zero_variance", "G_min", "G_max",
                  "zero_variance_frac", "p_easy", "p_hard"):  # fmt: skip
            assert f"budget/{k}" in r
        assert r["budget/G_min"] == r["budget/G_max"] == 4
    # 4 training prompts, 2 per round: from the third round on, every drawn prompt has a history
    assert sum(r["budget/predicted_zero_variance"] for r in rows) > 0


@pytest.mark.parametrize("budget", ["allocate", "greso", "greso_allocate"])
def test_budget_trains_and_resumes_identically(budget, tmp_path, tiny_model_dir, reward_file):
    """4 steps in one run vs 2 steps, checkpoint, resume for 2: the same budget metrics (skips,
    G's), sampler state (history, p's, RNG) and weights. allocate: unequal groups happen."""
    from safetensors.torch import load_file

    from grouprl.runtime.checkpoint import CheckpointManager
    from grouprl.train import train

    # seed 2: the shuffle pairs prompts of different pass rates in steps 3 and 4 (unequal G)
    common = [f"rollout.budget.type={budget}", "train.steps=4", "checkpoint.every=2",
              "rollout.seeding=per_sample", "rollout.group_size=8", "run.seed=2"]  # fmt: skip

    def cfg(out, *more):
        return make_cfg(out, tiny_model_dir, reward_file, *common, *more, skewed=True)

    train(cfg(tmp_path / "a"))
    train(cfg(tmp_path / "b", "train.steps=2"))
    train(cfg(tmp_path / "b", "run.resume=true"))
    ra, rb = _train_rows(tmp_path / "a" / "run"), _train_rows(tmp_path / "b" / "run")
    budget_a = [{k: v for k, v in r.items() if k.startswith("budget/")} for r in ra]
    assert budget_a == [{k: v for k, v in r.items() if k.startswith("budget/")} for r in rb]
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    if "allocate" in budget:  # unequal groups happened
        assert any(r["budget/G_min"] != r["budget/G_max"] for r in ra)
    if "greso" in budget:  # the all-fail prompts (5-9) were predicted and some skipped
        assert sum(r["budget/skipped_prompts"] for r in ra) > 0
    sa = CheckpointManager.load(CheckpointManager(tmp_path / "a" / "run").latest())["sampler"]
    sb = CheckpointManager.load(CheckpointManager(tmp_path / "b" / "run").latest())["sampler"]
    assert sa == sb and len(sa["history"]["prompts"]) == 4
    wa = load_file(CheckpointManager(tmp_path / "a" / "run").latest() / "model" /
                   "model.safetensors")  # fmt: skip
    wb = load_file(CheckpointManager(tmp_path / "b" / "run").latest() / "model" /
                   "model.safetensors")  # fmt: skip
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_two_processes_budget_equals_one(tiny_model_dir, tmp_path, reward_file):
    """accelerate launch with 2 CPU processes (gloo), greso_allocate: each process samples its
    share of the groups with their own G's; the budget metrics and the checkpointed sampler state
    equal a one-process run's (per-sample seeding: the same samples)."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from grouprl.runtime.checkpoint import CheckpointManager
    from grouprl.train import train

    root = Path(__file__).resolve().parents[1]

    def _launch_two(config_path):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
        cmd = [sys.executable, "-m", "accelerate.commands.launch",
               "--config_file", str(root / "configs" / "accelerate" / "ddp.yaml"),
               "--num_processes", "2", "--main_process_port", str(port),
               "-m", "grouprl", "train", str(config_path)]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    overrides = ["rollout.budget.type=greso_allocate", "train.steps=4", "checkpoint.every=2",
                 "rollout.seeding=per_sample", "rollout.prompts_per_step=4", "run.seed=2",
                 "rollout.group_size=8",
                 "run.num_threads=1"]  # fmt: skip
    one = make_cfg(tmp_path / "one", tiny_model_dir, reward_file, *overrides, skewed=True)
    two = one.model_dump(mode="json")
    two["run"]["output_dir"] = str(tmp_path / "two")
    config_path = tmp_path / "cfg.yaml"
    config_path.write_text(yaml.safe_dump(two))
    _launch_two(config_path)
    train(one)
    r1, r2 = _train_rows(tmp_path / "one" / "run"), _train_rows(tmp_path / "two" / "run")
    pick = [{k: v for k, v in r.items() if k.startswith("budget/")} for r in r1]
    assert pick == [{k: v for k, v in r.items() if k.startswith("budget/")} for r in r2]
    assert any(r["budget/G_min"] != r["budget/G_max"] for r in r1)
    s1 = CheckpointManager.load(CheckpointManager(tmp_path / "one" / "run").latest())["sampler"]
    s2 = CheckpointManager.load(CheckpointManager(tmp_path / "two" / "run").latest())["sampler"]
    assert s1 == s2
    for a, b in zip(r1, r2):  # the same samples and rewards; losses equal up to rounding
        assert a["reward/mean"] == b["reward/mean"]
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
