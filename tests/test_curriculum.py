"""rollouts.curriculum: DUMP's UCB scores and softmax by hand, windows, sampling, exact resume."""

import json
import math
from collections import Counter

import pytest
import torch

from grouprl.rollouts.curriculum import DumpSampler, response_advantages, softmax, ucb_scores

# 3 examples from source "a", 2 from "b", 1 from "c"
EXAMPLES = [
    {"prompt": "a0", "src": "a"},
    {"prompt": "b0", "src": "b"},
    {"prompt": "a1", "src": "a"},
    {"prompt": "a2", "src": "a"},
    {"prompt": "b1", "src": "b"},
    {"prompt": "c0", "src": "c"},
]
AB = [e for e in EXAMPLES if e["src"] != "c"]


def _prompts(rows):
    return [r["prompt"] for r in rows]


# ---- pure math --------------------------------------------------------------------------------


def test_ucb_scores_by_hand():
    # N = 3, ln(4) = 1.3862944, 2 ln 4 = 2.7725887
    # a: 0.4 + sqrt(2.7725887 / 3) = 0.4 + 0.9613513 = 1.3613513
    # b: 0.1 + sqrt(2.7725887 / 2) = 0.1 + 1.1774100 = 1.2774100
    assert ucb_scores([0.4, 0.1], [2, 1], c=1.0) == pytest.approx([1.3613513, 1.2774100])
    # c scales the bonus only: 0.4 + 0.5 * 0.9613513, 0.1 + 0.5 * 1.1774100
    assert ucb_scores([0.4, 0.1], [2, 1], c=0.5) == pytest.approx([0.8806756, 0.6887050])
    # before any data: ln(1) = 0, no bonus, all scores 0
    assert ucb_scores([0.0, 0.0, 0.0], [0, 0, 0], c=1.0) == [0.0, 0.0, 0.0]


def test_softmax_by_hand():
    # scores / 0.1 = 3, 2, 0; minus max: 0, -1, -3; exp: 1, 0.3678794, 0.0497871; sum 1.4176665
    assert softmax([0.3, 0.2, 0.0], 0.1) == pytest.approx([0.7053845, 0.2594965, 0.0351190])
    # max subtracted: huge scores do not overflow (exp(1e4) would)
    assert softmax([1000.0, 999.9], 0.1) == pytest.approx([0.7310586, 0.2689414])


# ---- the sampler's probabilities ---------------------------------------------------------------


def test_uniform_before_any_update():
    s = DumpSampler(EXAMPLES, source_column="src")
    assert s.probabilities() == {"a": pytest.approx(1 / 3), "b": pytest.approx(1 / 3), "c": 1 / 3}
    m = s.metrics()
    assert m["curriculum/p/b"] == pytest.approx(1 / 3)
    assert m["curriculum/mu/b"] == 0.0 and m["curriculum/n/b"] == 0.0


def test_update_then_hand_computed_probabilities():
    s = DumpSampler(AB, source_column="src", c=1.0, temperature=0.1)
    s.update(["a", "a", "b"], [0.5, -0.3, 0.1])
    # windows: a = [0.5, 0.3] (absolute values) -> mu 0.4, n 2;  b = [0.1] -> mu 0.1, n 1
    # UCB a = 1.3613513, b = 1.2774100 (test_ucb_scores_by_hand)
    # (UCB a - UCB b) / T = 0.8394124;  p_a = 1 / (1 + exp(-0.8394124)) = 1 / 1.4319643 = 0.6983414
    assert s.probabilities() == {"a": pytest.approx(0.6983414), "b": pytest.approx(0.3016586)}
    m = s.metrics()
    assert m["curriculum/mu/a"] == pytest.approx(0.4) and m["curriculum/mu/b"] == pytest.approx(0.1)
    assert m["curriculum/n/a"] == 2.0 and m["curriculum/n/b"] == 1.0
    assert m["curriculum/ucb/a"] == pytest.approx(1.3613513)
    assert set(m) == {f"curriculum/{k}/{s}" for k in ("p", "mu", "ucb", "n") for s in "ab"}


def test_bonus_favours_the_rarely_sampled_source():
    s = DumpSampler(AB, source_column="src")
    s.update(["a"] * 10, [0.0] * 10)  # a seen 10 times, all groups uninformative; b never seen
    # N = 10, 2 ln 11 = 4.7957905; UCB a = sqrt(4.7957905 / 11) = 0.6602885, b = sqrt(4.7957905)
    # = 2.1899293; (b - a) / 0.1 = 15.2964081; p_a = exp(-15.2964081) / (1 + ...) = 2.2743e-7
    p = s.probabilities()
    assert p["a"] == pytest.approx(2.2743e-7, rel=1e-3)
    assert p["b"] == pytest.approx(1 - 2.2743e-7)


def test_window_keeps_the_last_values_but_counts_are_cumulative():
    s = DumpSampler(AB, source_column="src", window=2, c=0.0)
    s.update(["a", "a"], [1.0, 2.0])
    s.update(["a", "b"], [-3.0, 0.0])  # a's window evicts 1.0 -> [2.0, 3.0]
    m = s.metrics()
    assert m["curriculum/mu/a"] == pytest.approx(2.5)
    assert m["curriculum/n/a"] == 3.0 and m["curriculum/n/b"] == 1.0
    # c = 0: softmax([2.5, 0] / 0.1) -> p_b = exp(-25) / (1 + exp(-25)) = 1.3888e-11
    assert s.probabilities()["b"] == pytest.approx(1.3888e-11, rel=1e-3)


def test_tensor_advantages_and_one_source():
    s = DumpSampler(AB, source_column="src", c=0.0)
    s.update(["b", "b"], torch.tensor([-0.25, 0.75]))
    assert s.metrics()["curriculum/mu/b"] == pytest.approx(0.5)
    one = DumpSampler(EXAMPLES[:1], source_column="src")  # one source: always drawn
    one.update(["a"], [0.3])
    assert one.probabilities() == {"a": 1.0}
    assert _prompts(one.next(3)) == ["a0"] * 3


def test_response_advantages():
    seq = torch.tensor([0.5, -1.0])  # [N]: already one per response
    assert response_advantages(seq, torch.ones(2, 3, dtype=torch.bool)).tolist() == [0.5, -1.0]
    adv = torch.tensor([[1.0, 3.0, 100.0], [-2.0, -2.0, -2.0]])  # [N, T]
    mask = torch.tensor([[True, True, False], [True, True, True]])
    # row 0: (1 + 3) / 2 = 2 (the masked 100 is ignored); row 1: -6 / 3 = -2
    assert response_advantages(adv, mask).tolist() == [2.0, -2.0]
    with pytest.raises(ValueError, match=r"responses \[1\] have no masked-in token"):
        response_advantages(adv, torch.tensor([[True, False, False], [False, False, False]]))
    with pytest.raises(ValueError, match="same shape"):
        response_advantages(adv, mask[:, :2])


# ---- drawing -----------------------------------------------------------------------------------


def test_frequencies_follow_p():
    s = DumpSampler(EXAMPLES, source_column="src", c=0.0, seed=3)
    n = 30_000
    drawn = Counter(_prompts(s.next(n)))
    # before data: each source 1/3, each prompt 1/3 divided by its source's size
    # binomial std <= sqrt(0.25 / 30000) = 0.0029; tolerance 0.012 is ~4 std
    for src, size in {"a": 3, "b": 2, "c": 1}.items():
        for i in range(size):
            assert drawn[f"{src}{i}"] / n == pytest.approx(1 / 3 / size, abs=0.012)
    s.update(["a", "c"], [0.1, 0.0])  # c = 0: scores 1, 0, 0 -> p = e/(e+2), 1/(e+2), 1/(e+2)
    # e = 2.7182818: p_a = 0.5761169, p_b = p_c = 0.2119416
    by_source = Counter(r["src"] for r in s.next(n))
    assert by_source["a"] / n == pytest.approx(0.5761169, abs=0.012)
    assert by_source["b"] / n == pytest.approx(0.2119416, abs=0.012)
    assert by_source["c"] / n == pytest.approx(0.2119416, abs=0.012)


def test_seeded_and_returns_the_example_objects():
    a, b = (
        DumpSampler(EXAMPLES, source_column="src", seed=1),
        DumpSampler(EXAMPLES, source_column="src", seed=1),
    )
    other = DumpSampler(EXAMPLES, source_column="src", seed=2)
    first = a.next(40)
    assert _prompts(first) == _prompts(b.next(40))
    assert _prompts(first) != _prompts(other.next(40))
    assert all(any(r is e for e in EXAMPLES) for r in first)


# ---- resume ------------------------------------------------------------------------------------


def _run(s, steps):
    """Draw 5 prompts per step and feed back a made-up advantage per prompt; return the prompts."""
    out = []
    for _ in range(steps):
        rows = s.next(5)
        out += _prompts(rows)
        s.update(
            [r["src"] for r in rows],
            [len(r["prompt"]) * 0.1 - 0.15 * i for i, r in enumerate(rows)],
        )
    return out


def test_state_round_trip_continues_identically():
    whole = DumpSampler(EXAMPLES, source_column="src", window=4, seed=7)
    expected = _run(whole, 12)
    s = DumpSampler(EXAMPLES, source_column="src", window=4, seed=7)
    head = _run(s, 5)
    state = json.loads(json.dumps(s.state_dict()))  # plain data: survives any serialisation
    fresh = DumpSampler(EXAMPLES, source_column="src", window=4, seed=7)
    fresh.load_state_dict(state)
    assert fresh.metrics() == s.metrics()
    assert head + _run(fresh, 7) == expected
    assert fresh.metrics() == whole.metrics()


def test_refused_loads_change_nothing():
    s = DumpSampler(EXAMPLES, source_column="src", window=4)
    _run(s, 3)
    other = DumpSampler(AB, source_column="src", window=4)
    before = other.state_dict()
    with pytest.raises(ValueError, match="resume needs the same data"):
        other.load_state_dict(s.state_dict())
    assert other.state_dict() == before
    wider = DumpSampler(EXAMPLES, source_column="src", window=5)
    with pytest.raises(ValueError, match="window is 4, the config's is 5"):
        wider.load_state_dict(s.state_dict())


# ---- errors ------------------------------------------------------------------------------------


def test_missing_column_names_it_and_the_existing_columns():
    with pytest.raises(KeyError, match=r"'dataset' is missing .* example 0.*\['prompt', 'src'\]"):
        DumpSampler(EXAMPLES, source_column="dataset")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window": 0}, "window must be an integer >= 1"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"c": -1.0}, "c .* must be >= 0"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DumpSampler(EXAMPLES, source_column="src", **kwargs)


def test_empty_and_colliding_sources():
    with pytest.raises(ValueError, match="training split is empty"):
        DumpSampler([], source_column="src")
    with pytest.raises(ValueError, match="print the same"):
        DumpSampler([{"src": 1}, {"src": "1"}], source_column="src")


def test_bad_updates_are_refused_and_change_nothing():
    s = DumpSampler(AB, source_column="src")
    s.update(["a"], [0.2])
    before = s.state_dict()
    with pytest.raises(ValueError, match=r"sources \['zzz'\] .*known: \['a', 'b'\]"):
        s.update(["a", "zzz"], [0.1, 0.1])
    with pytest.raises(ValueError, match="2 sources but 1 advantages"):
        s.update(["a", "b"], [0.1])
    with pytest.raises(ValueError, match=r"responses \[1\] are not finite"):
        s.update(["a", "b"], [0.1, math.nan])
    with pytest.raises(ValueError, match="response_advantages"):
        s.update(["a"], torch.zeros(1, 3))
    assert s.state_dict() == before
