"""data.PromptSampler: seeded order, reshuffle per pass, exact resume from its state."""

import json

import pytest

from grouprl.rollouts.prompt_sampler import PromptSampler

EXAMPLES = [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)]


def _ids(rows):
    return [int(r["answer"]) for r in rows]


def test_same_seed_same_order_other_seed_other_order():
    a, b, c = PromptSampler(EXAMPLES, 3), PromptSampler(EXAMPLES, 3), PromptSampler(EXAMPLES, 4)
    first = _ids(a.next(25))
    assert first == _ids(b.next(25))
    assert first != _ids(c.next(25))


def test_each_pass_is_a_permutation_and_reshuffled():
    s = PromptSampler(EXAMPLES, 0)
    passes = [_ids(s.next(10)) for _ in range(3)]
    for p in passes:
        assert sorted(p) == list(range(10))  # every example once per pass
    assert passes[0] != passes[1] and passes[1] != passes[2]  # a new order each pass
    assert passes[0] != list(range(10))  # actually shuffled


def test_next_crosses_pass_boundaries_without_gaps():
    s, t = PromptSampler(EXAMPLES, 1), PromptSampler(EXAMPLES, 1)
    chunks = [_ids(s.next(n)) for n in (3, 9, 1, 14)]  # uneven draws spanning 2.7 passes
    assert sum(chunks, []) == _ids(t.next(27))


def test_returns_the_example_objects():
    s = PromptSampler(EXAMPLES, 0)
    assert all(any(r is e for e in EXAMPLES) for r in s.next(12))


@pytest.mark.parametrize("drawn", [0, 7, 10, 23])  # start, mid pass, exactly at a pass end, pass 3
def test_state_dict_round_trip_continues_identically(drawn):
    s = PromptSampler(EXAMPLES, 5)
    s.next(drawn)
    state = json.loads(json.dumps(s.state_dict()))  # plain data: survives any serialisation
    fresh = PromptSampler(EXAMPLES, 5)
    fresh.load_state_dict(state)
    assert _ids(fresh.next(31)) == _ids(s.next(31))


def test_resume_matches_uninterrupted_sequence():
    whole = _ids(PromptSampler(EXAMPLES, 2).next(40))
    s = PromptSampler(EXAMPLES, 2)
    head = _ids(s.next(13))
    resumed = PromptSampler(EXAMPLES, 2)
    resumed.load_state_dict(s.state_dict())
    assert head + _ids(resumed.next(27)) == whole


def test_size_mismatch_is_refused():
    s = PromptSampler(EXAMPLES, 0)
    s.next(3)
    other = PromptSampler(EXAMPLES[:9], 0)
    with pytest.raises(ValueError, match="10 training examples.*now has 9"):
        other.load_state_dict(s.state_dict())
    # nothing was changed by the refused load
    assert (other.epoch, other.position) == (0, 0)


def test_empty_training_split_is_refused():
    with pytest.raises(ValueError, match="training split is empty"):
        PromptSampler([], 0)
