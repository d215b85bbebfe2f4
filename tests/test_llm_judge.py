"""llm_judge against OpenAI-compatible servers on 127.0.0.1: scripted answers (parsing, retries,
timeouts, malformed answers, groupwise) and a real tiny Qwen2.5-Instruct replica generating."""

from __future__ import annotations

import re

import pytest
import torch
from local_servers import chat_answer, serve

from grouprl.envs.rewards import build_reward, score_completions


def _user(body) -> str:
    return body["messages"][-1]["content"]


def _scripted(answers):
    """Answer by the completion found in the prompt: answers maps a completion text -> text."""

    def handler(path, body, call):
        for key, text in answers.items():
            if f"Response:\n{key}\n" in _user(body):
                return 200, chat_answer(text), 0.0
        return 404, {"error": "unscripted"}, 0.0

    return handler


def test_pointwise_parses_scores_and_fills_the_template():
    answers = {"four": "Good.\nScore: 8", "five": "Wrong, the final value 2.5", "x": "no digits"}
    with serve(_scripted(answers)) as (url, log):
        fn = build_reward("llm_judge", base_url=url + "/v1", model="judge", api_key="k", retries=0)
        with pytest.warns(RuntimeWarning, match="1 of 3 samples got no score.*no score"):
            got = fn(completions=["four", "five", "x"], prompts=["2+2?", "2+3?", "hm"])
    assert got == [0.8, 0.25, None]  # 8/10; the final number 2.5/10; no number
    assert len(log) == 3  # the requests run concurrently: find the first sample's
    path, body, headers = next(e for e in log if "Response:\nfour\n" in _user(e[1]))
    assert path == "/v1/chat/completions" and body["model"] == "judge"
    assert headers["Authorization"] == "Bearer k"
    assert body["temperature"] == 0.0 and body["max_tokens"] == 256
    assert "Prompt:\n2+2?\n\nResponse:\nfour\n" in _user(body)


def test_custom_template_columns_pattern_and_range(monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "secret")

    def handler(path, body, call):
        return 200, chat_answer("verdict <<3>> then 99"), 0.0

    with serve(handler) as (url, log):
        fn = build_reward(
            "llm_judge", base_url=url, model="m", api_key_env="JUDGE_KEY",
            template="Q: {prompt}\nA: {completion}\nReference: {answer}", system="Be strict.",
            score_pattern=r"<<(\d+)>>", score_range=[1, 5],
        )  # fmt: skip
        got = fn(
            completions=[[{"role": "assistant", "content": "yes"}]],
            prompts=[[{"role": "user", "content": "ok?"}]],
            answer=["no"],
        )
    assert got == [0.5]  # (3 - 1) / (5 - 1)
    body, headers = log[0][1], log[0][2]
    assert body["messages"][0] == {"role": "system", "content": "Be strict."}
    assert _user(body) == "Q: user: ok?\nA: yes\nReference: no"
    assert headers["Authorization"] == "Bearer secret"
    with pytest.raises(ValueError, match="exactly one group"):
        build_reward("llm_judge", base_url=url, model="m", score_pattern=r"\d+")


def test_retry_after_500_and_timeout_then_all_fail_is_loud():
    def handler(path, body, call):
        if call == 0:
            return 500, {"error": "busy"}, 0.0
        if "slow" in _user(body):
            return 200, chat_answer("Score: 1"), 1.5
        return 200, chat_answer("Score: 10"), 0.0

    with serve(handler) as (url, log):
        fn = build_reward(
            "llm_judge", base_url=url, model="m", retries=1, backoff_s=0.01, timeout_s=0.5
        )
        assert fn(completions=["a"], prompts=["p"]) == [1.0]
        assert len(log) == 2  # 500 then ok
        rewards, errors = score_completions(
            {"judge": fn}, ["slow one"], [{"prompt": "p"}], first_errors=(first := {})
        )
        assert torch.isnan(rewards["judge"]).all() and errors == {"judge": 1}
        assert "timeout_s=0.5" in first["judge"] and "2 attempt(s)" in first["judge"]
        assert len(log) == 4  # two timed-out attempts; the per-sample retry asked no more


def test_malformed_answers_are_none_and_retried():
    def handler(path, body, call):
        if call == 0:
            return 200, b"<html>proxy error</html>", 0.0  # no JSON: retried
        if "bad" in _user(body):
            return 200, {"choices": []}, 0.0
        return 200, chat_answer("Score: 11"), 0.0  # out of range

    with serve(handler) as (url, log):
        fn = build_reward("llm_judge", base_url=url, model="m", retries=1, backoff_s=0.0)
        with pytest.raises(RuntimeError, match="all 2 samples failed; first error: ") as info:
            fn(completions=["bad", "good"], prompts=["p", "p"])
        assert "no choices[0].message.content" in str(info.value)
        assert len(log) == 3  # the non-JSON answer was retried once
        with pytest.raises(RuntimeError, match="outside score_range"):
            fn(completions=["good"], prompts=["p"])  # the remembered error, no new request
        assert len(log) == 3


def test_groupwise_scores_and_ranking_by_group_ids():
    def handler(path, body, call):
        text = _user(body)
        n = len(re.findall(r"^\[\d+\] ", text, flags=re.M))
        if "Ranking" in text:
            return 200, chat_answer("Ranking: " + " > ".join(str(k) for k in range(n, 0, -1))), 0
        return 200, chat_answer("\n".join(f"[{k}]: {2 * k}" for k in range(1, n + 1))), 0.0

    completions = ["a", "b", "c", "d", "e"]
    prompts = ["p", "p", "p", "q", "q"]
    with serve(handler) as (url, log):
        fn = build_reward("llm_judge", base_url=url, model="m", mode="groupwise")
        got = fn(completions=completions, prompts=prompts, group_ids=[0, 0, 0, 1, 1])
        assert got == pytest.approx([0.2, 0.4, 0.6, 0.2, 0.4])
        assert len(log) == 2
        asked = sorted(_user(e[1]) for e in log)  # concurrent: in any order
        assert "Prompt:\np\n\nResponses:\n[1] a\n\n[2] b\n\n[3] c\n\nAnswer" in asked[0]
        assert "Prompt:\nq\n\nResponses:\n[1] d\n\n[2] e\n\nAnswer" in asked[1]
        ranked = build_reward(
            "llm_judge", base_url=url, model="m", mode="groupwise", output="ranking",
            template="{prompt}\n{completions}\nRanking: best first",
        )  # fmt: skip
        got = ranked(completions=completions, prompts=prompts, group_ids=[0, 0, 0, 1, 1])
        assert got == [0.0, 0.5, 1.0, 0.0, 1.0]  # the judge ranks the last one first
        with pytest.raises(ValueError, match="group_ids"):
            fn(completions=completions, prompts=prompts)


@pytest.fixture(scope="module")
def qwen_judge(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grouprl.replicas.text import build

    folder = build("qwen2.5", tmp_path_factory.mktemp("judge"))
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return tok, model


def test_real_replica_behind_the_endpoint(qwen_judge):
    tok, model = qwen_judge
    generated: list[str] = []

    def handler(path, body, call):
        ids = tok.apply_chat_template(
            body["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]  # [1, T]
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=body["max_tokens"], do_sample=False,
                pad_token_id=tok.pad_token_id,
            )  # fmt: skip  # [1, T + new]
        text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        generated.append(text)
        return 200, chat_answer(text), 0.0

    with serve(handler) as (url, log):
        fn = build_reward("llm_judge", base_url=url + "/v1", model="qwen", max_tokens=12,
                          score_range=None, retries=0)  # fmt: skip
        try:
            got = fn(completions=["The answer is 4."], prompts=["What is 2+2?"])
        except RuntimeError as exc:  # the random model printed no number
            assert "no score" in str(exc)
            got = [None]
    assert len(log) == 1 and log[0][0] == "/v1/chat/completions"
    assert "Prompt:\nWhat is 2+2?\n\nResponse:\nThe answer is 4.\n" in _user(log[0][1])
    numbers = re.findall(r"-?\d+(?:\.\d+)?", generated[0])
    assert got == ([float(numbers[-1])] if numbers else [None])
