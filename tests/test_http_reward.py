"""The `http` reward against a scorer on 127.0.0.1, and single-turn collect overlapping its
scoring with the next chunk's generation (same samples and scores as scoring all at once)."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from local_servers import serve

from grouprl.envs.rewards import build_reward
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.single_turn import collect

EXAMPLES = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(4)]
PARAMS = SamplingParams(max_new_tokens=6)


def _score(completion: str, answer: str) -> float:
    return len(completion) + 0.5 * (answer in completion)


def _scorer(fail_first: bool = False):
    def handler(path, body, call):
        if fail_first and call == 0:
            return 503, {"error": "warming up"}, 0.0
        rewards = [_score(c, a) for c, a in zip(body["completions"], body["answer"])]
        return 200, {"rewards": rewards}, 0.05

    return handler


def test_http_posts_batches_with_columns_and_retries():
    with serve(_scorer(fail_first=True)) as (url, log):
        fn = build_reward("http", url=url + "/score", batch_size=2, retries=1, backoff_s=0.01,
                          headers={"X-Token": "t"})  # fmt: skip
        got = fn(completions=["4", "x", "68"], prompts=["2+2=", "?", "a"], answer=["4", "1", "8"],
                 tensor_col=torch.zeros(3))  # fmt: skip
    assert got == [1.5, 1.0, 2.5]
    assert [p for p, _, _ in log] == ["/score"] * 3  # 503, then two batches
    assert log[1][1] == {"prompts": ["2+2=", "?"], "completions": ["4", "x"], "answer": ["4", "1"]}
    assert log[1][2]["X-Token"] == "t"


def test_http_bad_answer_raises_naming_the_url():
    with serve(lambda p, b, c: (200, {"scores": [1]}, 0.0)) as (url, _):
        fn = build_reward("http", url=url, retries=0)
        with pytest.raises(ValueError, match="must answer"):
            fn(completions=["a"])


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return CausalLMPolicy.from_pretrained(str(tiny_model_dir))


def test_overlapped_collect_equals_the_serial_one(policy):
    threads: set[str] = set()

    def local(completions, answer, **_):
        return [_score(c, a) for c, a in zip(completions, answer)]

    def recorded(completions, answer, group_ids, **_):
        threads.add(threading.current_thread().name)
        return local(completions, answer)

    recorded.overlap, recorded.overlap_chunks = True, 2
    with serve(_scorer()) as (url, log):
        serial, e1 = collect(policy, EXAMPLES, 3, PARAMS,
                             {"r": build_reward("http", url=url, overlap_chunks=1), "l": local},
                             seed=5)  # fmt: skip
        assert len(log) == 1
        over, e2 = collect(policy, EXAMPLES, 3, PARAMS,
                           {"r": build_reward("http", url=url, overlap_chunks=2), "l": local,
                            "t": recorded}, seed=5)  # fmt: skip
        assert len(log) == 3  # one request per chunk
    assert over.info["completion"] == serial.info["completion"]
    assert (
        over.group_ids.tolist() == serial.group_ids.tolist() == [g for g in range(4) for _ in "abc"]
    )
    assert torch.equal(over.rewards["r"], serial.rewards["r"])
    assert torch.equal(over.rewards["r"], serial.rewards["l"])
    assert torch.equal(over.rewards["t"], serial.rewards["l"])
    assert list(over.rewards) == ["r", "l", "t"] and e2 == {"r": 0, "l": 0, "t": 0}
    assert threading.current_thread().name not in threads  # scored in the background
    assert torch.equal(over.actions.completion_ids[:, : serial.mask.shape[1]].masked_fill(
        ~serial.mask, 0), serial.actions.completion_ids.masked_fill(~serial.mask, 0))  # fmt: skip
    assert not any(math.isnan(v) for v in over.rewards["r"].tolist())
    assert "_completions" not in over.info and over.examples == serial.examples
