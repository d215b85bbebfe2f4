"""rollouts.single_turn.collect with the tiny causal LM: shapes, group ids, rewards, reward failures."""

import math

import pytest
import torch

from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.single_turn import collect

EXAMPLES = [
    {"prompt": "1+2=", "answer": "3"},
    {"prompt": "4+4=", "answer": "8"},
    {"prompt": "9+0=", "answer": "9"},
]
PARAMS = SamplingParams(max_new_tokens=5)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return CausalLMPolicy.from_pretrained(str(tiny_model_dir))


class Recorder:
    """A batched reward that records its keyword arguments and scores 1 if the completion has '3'."""

    def __init__(self):
        self.calls = []

    def __call__(self, completions, **kw):
        self.calls.append({"completions": list(completions), **kw})
        return [float("3" in c) for c in completions]


def test_collect_shapes_group_ids_and_rewards(policy):
    torch.manual_seed(0)
    rec = Recorder()
    lengths = lambda completions, completion_lengths, **_: [float(n) for n in completion_lengths]  # noqa: E731
    rollout, errors = collect(
        policy, EXAMPLES, 4, PARAMS, {"acc": rec, "len": lengths}, first_group_id=7
    )
    n, b = 12, rollout.actions
    assert len(rollout) == n
    assert rollout.group_ids.tolist() == [7] * 4 + [8] * 4 + [9] * 4
    T = b.completion_ids.shape[1]
    assert 1 <= T <= PARAMS.max_new_tokens
    assert rollout.old_logp.shape == rollout.mask.shape == b.completion_mask.shape == (n, T)
    assert torch.equal(rollout.mask, b.completion_mask)
    assert (rollout.old_logp[~rollout.mask] == 0).all() and (
        rollout.old_logp[rollout.mask] <= 0
    ).all()
    assert b.prompt_ids.shape[0] == n and b.truncated.shape == (n,)
    assert set(rollout.rewards) == {"acc", "len"} and errors == {"acc": 0, "len": 0}
    for v in rollout.rewards.values():
        assert v.shape == (n,) and v.dtype == torch.float32 and torch.isfinite(v).all()
    # rewards are computed on exactly these completions, one call per function for the batch
    assert len(rec.calls) == 1
    call = rec.calls[0]
    assert call["completions"] == rollout.info["completion"]
    assert rollout.rewards["acc"].tolist() == [float("3" in c) for c in rollout.info["completion"]]
    assert rollout.rewards["len"].tolist() == b.lengths.float().tolist()
    # every example column reaches the reward, repeated per completion, plus generation facts
    assert call["answer"] == ["3"] * 4 + ["8"] * 4 + ["9"] * 4
    assert call["prompts"] == [ex["prompt"] for ex in EXAMPLES for _ in range(4)]
    assert call["completion_lengths"] == b.lengths.tolist()
    assert call["truncated"] == b.truncated.tolist()
    assert call["max_new_tokens"] == PARAMS.max_new_tokens
    assert rollout.examples == [ex for ex in EXAMPLES for _ in range(4)]
    assert rollout.info["prompt"] == call["prompts"]


def test_collect_greedy_groups_are_identical(policy):
    rollout, _ = collect(policy, EXAMPLES[:2], 3, PARAMS, {"acc": Recorder()}, greedy=True)
    comps = rollout.info["completion"]
    assert comps[0] == comps[1] == comps[2] and comps[3] == comps[4] == comps[5]
    assert rollout.group_ids.tolist() == [0, 0, 0, 1, 1, 1]


def _explodes_on_bad(completions, bad, **_):
    """Raises when the batch holds a 'bad' example (a failing verifier on one sample)."""
    if any(bad):
        raise ZeroDivisionError("verifier crashed")
    return [1.0] * len(completions)


BAD_EXAMPLES = [
    {"prompt": "1+2=", "answer": "3", "bad": False},
    {"prompt": "2+2=", "answer": "4", "bad": True},
    {"prompt": "3+2=", "answer": "5", "bad": False},
]


def test_failing_reward_gives_nan_for_that_sample_only(policy):
    ok = lambda completions, **_: [0.5] * len(completions)  # noqa: E731
    rollout, errors = collect(policy, BAD_EXAMPLES, 1, PARAMS, {"v": _explodes_on_bad, "ok": ok})
    assert errors == {"v": 1, "ok": 0}
    v = rollout.rewards["v"]
    assert v[0].item() == 1.0 and math.isnan(v[1].item()) and v[2].item() == 1.0
    assert rollout.rewards["ok"].tolist() == [0.5, 0.5, 0.5]


def test_failing_reward_fail_fast_reraises(policy):
    with pytest.raises(ZeroDivisionError, match="verifier crashed") as info:
        collect(policy, BAD_EXAMPLES, 1, PARAMS, {"v": _explodes_on_bad}, fail_fast=True)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "'v'" in notes and "sample 1" in notes


def test_non_finite_reward_is_refused(policy):
    inf = lambda completions, **_: [math.inf] * len(completions)  # noqa: E731
    with pytest.raises(ValueError, match="finite number"):
        collect(policy, EXAMPLES[:1], 2, PARAMS, {"inf": inf})
