"""rollouts.filters: combined reward, DAPO zero-variance filter, rollout concatenation, dynamic sampling."""

import math

import pytest
import torch

from grouprl.rollouts.filters import (
    cat_rollouts,
    combined_reward,
    informative_groups,
    sample_until_full,
)
from grouprl.types import Rollout, TokenBatch

nan = math.nan


def _rollout(group_ids, rewards, *, prompt_len=2, width=3, fill=1.0):
    """A text Rollout of N rows: prompts of `prompt_len` real tokens, completions of `width`."""
    n = len(group_ids)
    ids = torch.arange(n * width).view(n, width) + 10  # [N, T] distinct non-pad ids
    batch = TokenBatch(
        prompt_ids=torch.full((n, prompt_len), 7),  # [N, P]
        prompt_mask=torch.ones(n, prompt_len, dtype=torch.bool),
        completion_ids=ids,
        completion_mask=torch.ones(n, width, dtype=torch.bool),
        truncated=torch.zeros(n, dtype=torch.bool),
    )
    return Rollout(
        group_ids=torch.tensor(group_ids),
        rewards={k: torch.tensor(v, dtype=torch.float32) for k, v in rewards.items()},
        actions=batch,
        old_logp=torch.full((n, width), fill),  # [N, T]
        mask=torch.ones(n, width, dtype=torch.bool),
        engine_logp=torch.full((n, width), 2 * fill),
        advantages=torch.arange(n, dtype=torch.float32),
        info={"completion": [f"c{g}" for g in group_ids]},
    )


# ---- combined_reward ----------------------------------------------------------------------------


def test_combined_reward_weights_and_nans():
    rewards = {
        "a": torch.tensor([1.0, nan, nan, 2.0]),
        "b": torch.tensor([0.5, 1.0, nan, nan]),
    }
    out = combined_reward(rewards, {"a": 2.0, "b": 0.5})
    # row 0: 2*1 + 0.5*0.5; row 1: only b; row 2: all NaN stays NaN; row 3: only a
    torch.testing.assert_close(out, torch.tensor([2.25, 0.5, nan, 4.0]), equal_nan=True)


def test_combined_reward_missing_weight_is_one():
    out = combined_reward(
        {"a": torch.tensor([1.0, 3.0]), "b": torch.tensor([2.0, 0.0])}, {"a": 0.5}
    )
    torch.testing.assert_close(out, torch.tensor([2.5, 1.5]))


# ---- informative_groups -------------------------------------------------------------------------


def test_informative_groups_cases():
    reward = torch.tensor([1.0, 1.0, 0.0, 1.0, nan, 1.0, nan, nan, 2.0, 2.0, nan, 0.0, 5.0, nan])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4, 5, 5, 5])
    keep = informative_groups(reward, groups)
    expected = [
        *[False, False],  # 0: all equal -> dropped
        *[True, True],  # 1: mixed -> kept
        *[False, False],  # 2: one valid sample -> no contrast -> dropped
        *[False, False],  # 3: nothing valid -> dropped
        *[False, False, False],  # 4: valid values equal, the NaN does not make it "mixed"
        *[True, True, True],  # 5: mixed valid values; the whole group is kept (NaN row too)
    ]
    assert keep.tolist() == expected


def test_informative_groups_non_contiguous_ids():
    reward = torch.tensor([0.0, 1.0, 3.0, 3.0, 1.0])
    groups = torch.tensor([7, 9, 7, 9, 9])  # group 7: {0, 3} mixed; group 9: {1, 3, 1} mixed
    assert informative_groups(reward, groups).tolist() == [True] * 5
    groups = torch.tensor([7, 9, 9, 7, 9])  # group 7: {0, 3}; group 9: {1, 3, 1}
    reward = torch.tensor([2.0, 1.0, 1.0, 2.0, 1.0])  # both flat
    assert informative_groups(reward, groups).tolist() == [False] * 5


# ---- cat_rollouts -------------------------------------------------------------------------------


def test_cat_rollouts_pads_every_2d_field_and_token_batch():
    a = _rollout([0, 0], {"r": [1.0, 2.0]}, prompt_len=3, width=2, fill=-1.0)
    b = _rollout([5, 5, 6], {"r": [3.0, nan, 4.0]}, prompt_len=1, width=4, fill=-2.0)
    out = cat_rollouts([a, b])
    assert len(out) == 5
    assert out.group_ids.tolist() == [0, 0, 5, 5, 6]
    torch.testing.assert_close(
        out.rewards["r"], torch.tensor([1.0, 2.0, 3.0, nan, 4.0]), equal_nan=True
    )
    assert out.advantages.tolist() == [0.0, 1.0, 0.0, 1.0, 2.0]
    assert out.info["completion"] == ["c0", "c0", "c5", "c5", "c6"]
    assert out.ref_logp is None and out.step_ids is None
    # [N, T] fields: right padded to T = 4 with 0 / False
    assert out.old_logp.shape == out.mask.shape == out.engine_logp.shape == (5, 4)
    assert out.old_logp[:2].tolist() == [[-1.0, -1.0, 0.0, 0.0]] * 2
    assert out.engine_logp[:2].tolist() == [[-2.0, -2.0, 0.0, 0.0]] * 2
    assert out.old_logp[2:].tolist() == [[-2.0] * 4] * 3
    assert out.mask[:2].tolist() == [[True, True, False, False]] * 2
    assert out.mask[2:].all()
    # TokenBatch: prompts re-padded on the LEFT (to P = 3), completions on the RIGHT (to T = 4)
    tb = out.actions
    assert tb.prompt_ids.shape == tb.prompt_mask.shape == (5, 3)
    assert tb.prompt_ids[2:].tolist() == [[0, 0, 7]] * 3
    assert tb.prompt_mask[2:].tolist() == [[False, False, True]] * 3
    assert tb.prompt_mask[:2].all()
    assert tb.completion_ids.shape == (5, 4)
    assert tb.completion_ids[0].tolist() == [10, 11, 0, 0]
    assert tb.completion_mask[:2].tolist() == [[True, True, False, False]] * 2
    assert tb.lengths.tolist() == [2, 2, 4, 4, 4]
    assert tb.truncated.shape == (5,)
    # the padded rollout still selects rows consistently
    sub = out.select([1, 3])
    assert sub.group_ids.tolist() == [0, 5] and sub.actions.completion_ids.shape == (2, 4)


def test_cat_rollouts_token_level_advantages_are_padded():
    a = _rollout([0, 0], {"r": [1.0, 2.0]}, width=2)
    b = _rollout([1, 1], {"r": [3.0, 4.0]}, width=3)
    a.advantages, b.advantages = torch.ones(2, 2), torch.full((2, 3), 2.0)  # [n, T]
    out = cat_rollouts([a, b])
    assert out.advantages.tolist() == [[1, 1, 0], [1, 1, 0], [2, 2, 2], [2, 2, 2]]


def test_cat_rollouts_agent_fields_keep_their_meaning():
    """step_ids pad with -1 (no turn; 0 would be turn 0), step_rewards [n, max_turns] join as is."""
    a = _rollout([0, 0], {"r": [1.0, 2.0]}, width=2)
    b = _rollout([1, 1], {"r": [3.0, 4.0]}, width=3)
    a.step_ids, b.step_ids = torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    a.step_rewards, b.step_rewards = torch.zeros(2, 4), torch.full((2, 4), nan)  # [n, max_turns]
    out = cat_rollouts([a, b])
    assert out.step_ids.tolist() == [[0, 0, -1], [0, 0, -1], [1, 1, 1], [1, 1, 1]]
    assert out.step_rewards.shape == (4, 4) and out.step_rewards[2:].isnan().all()


def test_cat_rollouts_single_part_is_returned_unchanged():
    a = _rollout([0, 0], {"r": [1.0, 2.0]})
    assert cat_rollouts([a]) is a


# ---- sample_until_full --------------------------------------------------------------------------

FLAT, MIXED = [1.0, 1.0], [0.0, 1.0]  # one group of G = 2: no contrast / contrast


class FakeSampler:
    """sample_round with scripted rewards: rounds[i] lists one reward pair per group of round i."""

    def __init__(self, rounds):
        self.rounds, self.calls = rounds, []

    def __call__(self, round_index, size=None):
        self.calls.append(round_index)
        self.sizes = [*getattr(self, "sizes", []), size]
        groups = self.rounds[round_index]  # as scripted, whatever size was asked
        ids = [10 * round_index + j for j, _ in enumerate(groups) for _ in range(2)]
        acc = [v for pair in groups for v in pair]
        return _rollout(ids, {"acc": acc})


def test_sample_until_full_stops_when_full_and_truncates():
    fake = FakeSampler([[MIXED, FLAT], [MIXED, MIXED], [MIXED, MIXED]])
    out, m = sample_until_full(fake, {"acc": 1.0}, groups_wanted=2, max_rounds=5)
    assert fake.calls == [0, 1]  # full after the second round: no third round
    assert out.group_ids.tolist() == [0, 0, 10, 10]  # 3 kept, truncated to exactly 2 groups
    assert out.rewards["acc"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert out.info["completion"] == ["c0", "c0", "c10", "c10"]
    assert m == {"dynamic/rounds": 2.0, "dynamic/kept_frac": 3 / 4, "dynamic/prompts": 4.0}
    assert fake.sizes == [2, 2]  # full rounds (DAPO)


def test_sample_until_full_truncates_within_one_round():
    fake = FakeSampler([[MIXED, FLAT, MIXED, MIXED]])
    out, m = sample_until_full(fake, {"acc": 1.0}, groups_wanted=2, max_rounds=3)
    assert fake.calls == [0]
    assert out.group_ids.tolist() == [0, 0, 2, 2]
    assert m["dynamic/rounds"] == 1.0 and m["dynamic/kept_frac"] == 3 / 4


def test_sample_until_full_caps_rounds_and_trains_on_what_it_has():
    fake = FakeSampler([[FLAT, FLAT], [FLAT, MIXED], [FLAT, FLAT], [MIXED, MIXED]])
    out, m = sample_until_full(fake, {"acc": 1.0}, groups_wanted=2, max_rounds=3)
    assert fake.calls == [0, 1, 2]
    assert out.group_ids.tolist() == [11, 11]
    assert m == {"dynamic/rounds": 3.0, "dynamic/kept_frac": 1 / 6, "dynamic/prompts": 6.0}


def test_sample_until_full_none_when_nothing_kept():
    fake = FakeSampler([[FLAT, [nan, 1.0]], [[nan, nan], FLAT]])
    out, m = sample_until_full(fake, {"acc": 1.0}, groups_wanted=1, max_rounds=2)
    assert out is None
    assert m == {"dynamic/rounds": 2.0, "dynamic/kept_frac": 0.0, "dynamic/prompts": 4.0}


def test_sample_until_full_uses_weighted_combined_reward():
    # acc is flat, fmt varies: with fmt weighted 0 the group is flat, with weight 1 it is kept
    def one_round(*_):
        return _rollout([0, 0], {"acc": [1.0, 1.0], "fmt": [0.0, 1.0]})

    out, _ = sample_until_full(one_round, {"acc": 1.0, "fmt": 0.0}, 1, 1)
    assert out is None
    out, _ = sample_until_full(one_round, {"acc": 1.0, "fmt": 1.0}, 1, 1)
    assert out.group_ids.tolist() == [0, 0]


def test_resample_size_needed_samples_what_the_kept_share_says():
    # round 0: 3 of 4 groups kept -> 1 missing / (3/4) -> ceil(4/3) = 2 prompts next;
    # round 1: 0 of 2 kept -> 1 missing / (3/6) = 2 prompts; round 2: fills it
    fake = FakeSampler([[MIXED, MIXED, FLAT, MIXED], [FLAT, FLAT], [MIXED, FLAT]])
    out, m = sample_until_full(fake, {"acc": 1.0}, 4, 5, resample_size="needed")
    assert fake.sizes == [4, 2, 2] and m["dynamic/prompts"] == 8.0
    assert len(out.group_ids.unique()) == 4
    # a first round that keeps nothing says nothing about the share: the next one is full
    fake = FakeSampler([[FLAT, FLAT], [MIXED, FLAT]])
    sample_until_full(fake, {"acc": 1.0}, 2, 2, resample_size="needed")
    assert fake.sizes == [2, 2]


@pytest.mark.parametrize("wanted", [1, 3])
def test_sample_until_full_never_returns_more_groups_than_wanted(wanted):
    fake = FakeSampler([[MIXED] * 5])
    out, _ = sample_until_full(fake, {"acc": 1.0}, groups_wanted=wanted, max_rounds=1)
    assert len(torch.unique(out.group_ids)) == wanted and len(out) == 2 * wanted


def test_reward_metrics_hand_computed_and_unscored_reward_is_nan():
    from grouprl.rollouts.reward_metrics import reward_metrics

    rewards = {"a": torch.tensor([1.0, nan, 3.0]), "b": torch.tensor([nan, nan, nan])}
    m = reward_metrics(rewards, {"a": 2.0, "b": 1.0})
    # combined: [2, NaN, 6] (row 1: every reward NaN); mean 4, sample std sqrt(8)
    assert m["reward/mean"] == pytest.approx(4.0)
    assert m["reward/std"] == pytest.approx(math.sqrt(8.0))
    assert m["reward/a"] == pytest.approx(2.0)  # unweighted mean over the scored rows
    assert math.isnan(m["reward/b"])  # never scored: NaN, not 0
