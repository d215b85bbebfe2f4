"""The OpenAI-compatible agent gateway (grouprl/rollouts/gateway/, workloads/gateway.py): a real
HTTP server on 127.0.0.1 over a tiny Qwen2 policy, talked to by the real `openai` client; the
recorded tokens and log-probs against the policy's own scoring; errors; 2 training steps whose
agent is an `openai`-client loop."""

from __future__ import annotations

import http.client
import json
import math
import time
from urllib.parse import urlparse

import pytest
import torch
from test_replicas_text import TOOLS

from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.chat_delta import prompt_ids
from grouprl.rollouts.gateway import EPISODE_HEADER, Gateway
from grouprl.rollouts.gateway.episodes import Finished, episode_rows, episodes_rollout
from grouprl.rollouts.gateway.record import EpisodeLog, chat_prompt, normalise_message
from grouprl.rollouts.gateway.server import assistant_message, wire_message

openai = pytest.importorskip("openai")  # a dev dependency (pyproject's dev extras)

MODEL = "grouprl-policy"
ADD_TOOL = TOOLS[0]  # the OpenAI-style schema of an `add` tool


@pytest.fixture
def policy(tiny_model, tiny_tokenizer):
    return CausalLMPolicy(tiny_model, tiny_tokenizer)


@pytest.fixture
def gateway(policy):
    with Gateway(
        policy, SamplingParams(temperature=1.0, max_new_tokens=8), max_episode_tokens=512,
        request_timeout_s=10.0, weight_version=3,
    ) as gw:  # fmt: skip
        yield gw


def client(gw: Gateway, **headers):
    return openai.OpenAI(
        base_url=gw.base_url, api_key="unused", max_retries=0, timeout=30.0,
        default_headers=headers or None,
    )  # fmt: skip


def _post(
    gw: Gateway, path: str, raw: bytes, headers: dict | None = None
) -> tuple[int, dict, float]:
    url = urlparse(gw.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    start = time.monotonic()
    conn.request(
        "POST", path, body=raw, headers={"Content-Type": "application/json", **(headers or {})}
    )
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    return resp.status, body, time.monotonic() - start


def _scored(policy, rollout) -> torch.Tensor:
    with torch.no_grad():
        return policy.log_probs(rollout.actions, temperature=1.0).logp  # [N, T]


# ---- the server through the openai client -----------------------------------------------------


def test_chat_calls_validate_with_openai_and_record_what_the_policy_scores(gateway, policy):
    """Two chat calls of one episode (id in `user`, then in the header): OpenAI's response types
    parse them; call 1's prompt is the chat template's rendering, call 2's extends call 1's prompt
    + completion token for token; the episode's row holds exactly the sampled tokens under the
    mask, and their recorded log-probs equal policy.log_probs within 1e-4."""
    tok = policy.tokenizer
    gateway.episodes.open("e1")
    messages = [{"role": "user", "content": "What is 2+3?"}]
    r1 = client(gateway).chat.completions.create(
        model=MODEL, messages=messages, user="e1", logprobs=True, max_tokens=6
    )
    assert isinstance(r1, openai.types.chat.ChatCompletion)
    choice = r1.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert r1.usage.completion_tokens == len(choice.logprobs.content) <= 6
    rec1 = gateway.episodes.get_open("e1").calls[0]
    assert rec1.prompt_ids == prompt_ids(tok, messages) == r1.grouprl["prompt_token_ids"]
    assert r1.usage.prompt_tokens == len(rec1.prompt_ids) and rec1.weight_version == 3
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(rec1.logprobs)
    assert (choice.message.content or "") == tok.decode(
        rec1.completion_ids, skip_special_tokens=True
    )

    history = [
        *messages,
        choice.message.model_dump(exclude_none=True),
        {"role": "user", "content": "Sure?"},
    ]
    r2 = client(gateway, **{EPISODE_HEADER: "e1"}).chat.completions.create(
        model=MODEL, messages=history, max_tokens=5
    )
    rec2 = gateway.episodes.end("e1").calls[1]
    before = rec1.prompt_ids + rec1.completion_ids
    assert rec2.segment == 0 and rec2.prompt_ids[: len(before)] == before
    assert tok.decode(rec2.prompt_ids[len(before) :]).endswith("<|user|>\nSure?\n<|assistant|>\n")
    assert r2.usage.prompt_tokens == len(rec2.prompt_ids)

    log = gateway.episodes.end("e1")
    rollout = episodes_rollout([Finished(log, {}, 0, 0, 1.0, True)], tok, "error")
    assert len(rollout) == 1 and int(rollout.mask.sum()) == len(rec1.completion_ids) + len(
        rec2.completion_ids
    )
    full = rollout.actions.prompt_ids[0][rollout.actions.prompt_mask[0]].tolist() + (
        rollout.actions.completion_ids[0][rollout.actions.completion_mask[0]].tolist()
    )
    assert full == rec2.prompt_ids + rec2.completion_ids
    mask = rollout.mask
    assert torch.allclose(_scored(policy, rollout)[mask], rollout.engine_logp[mask], atol=1e-4)
    assert rollout.engine_logp[mask].tolist() == pytest.approx(rec1.logprobs + rec2.logprobs)


def test_completions_and_models(gateway, policy):
    gateway.episodes.open("c1")
    c = client(gateway)
    assert [m.id for m in c.models.list()] == [MODEL]
    r1 = c.completions.create(model=MODEL, prompt="abc", user="c1", logprobs=1, max_tokens=4)
    assert isinstance(r1, openai.types.Completion)
    text = r1.choices[0].text
    assert r1.choices[0].logprobs.token_logprobs == pytest.approx(
        gateway.episodes.get_open("c1").calls[0].logprobs
    )
    c.completions.create(model=MODEL, prompt="abc" + text + "def", user="c1", max_tokens=4)
    first, second = gateway.episodes.end("c1").calls
    # `seed` reaches the engine: the same seed samples the same tokens in another episode
    for eid in ("s1", "s2"):
        gateway.episodes.open(eid)
        c.completions.create(model=MODEL, prompt="xyz", user=eid, max_tokens=6, seed=11)
    s1, s2 = (gateway.episodes.end(e).calls[0] for e in ("s1", "s2"))
    assert (s1.completion_ids, s1.logprobs) == (s2.completion_ids, s2.logprobs)
    assert second.segment == 0
    assert (
        second.prompt_ids
        == first.prompt_ids
        + first.completion_ids
        + policy.tokenizer("def", add_special_tokens=False).input_ids
    )


def test_tool_calls_in_openai_shape_and_the_reply_extends_the_episode(policy):
    """A hermes tool call in the sampled tokens becomes `tool_calls` (parsed by OpenAI's types);
    the program's history with that message (arguments as JSON text) + the tool result extends the
    episode's tokens, the result rendered by the template."""
    tok = policy.tokenizer
    out = tok(
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        add_special_tokens=False,
    ).input_ids
    out = out + [tok.eos_token_id]
    message = assistant_message(tok, out, "hermes", turn=0)
    body = {
        "id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "message": wire_message(message), "finish_reason": "tool_calls"}],
    }  # fmt: skip
    parsed = openai.types.chat.ChatCompletion.model_validate(body).choices[0].message
    assert parsed.content is None and parsed.tool_calls[0].function.name == "add"
    assert json.loads(parsed.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
    assert assistant_message(tok, out, None, turn=0)["content"].startswith("<tool_call>")

    from grouprl.rollouts.gateway.record import Call

    first = [{"role": "user", "content": "2+3?"}]
    log = EpisodeLog("t")
    p = prompt_ids(tok, first)
    log.calls.append(Call("chat", p, out, [0.0] * len(out), 0, "tool_calls", 0,
                          messages=first, tools=[ADD_TOOL], message=message))  # fmt: skip
    reply = {"role": "tool", "tool_call_id": parsed.tool_calls[0].id, "content": "5"}
    history = [*first, parsed.model_dump(exclude_none=True), reply]
    history = [normalise_message(m, i) for i, m in enumerate(history)]
    ids, segment = chat_prompt(tok, log, history, [ADD_TOOL])
    assert segment == 0 and ids[: len(p) + len(out)] == p + out
    # the template closes the assistant turn with "\n" (its EOS is no closing text)
    assert tok.decode(ids[len(p) + len(out) :]) == "\n<|tool|>\n5\n<|assistant|>\n"
    # the tiny template has no tools branch: the tools are listed in a system message put first
    listed = tok.decode(chat_prompt(tok, EpisodeLog("n"), first, [ADD_TOOL])[0])
    assert (
        listed.startswith("<|system|>\nYou can use the following tools")
        and '"name": "add"' in listed
    )
    assert listed.endswith("<|user|>\n2+3?\n<|assistant|>\n")
    # another tool list is another conversation: a new segment
    assert chat_prompt(tok, log, history, None)[1] == 1


# ---- errors: 4xx JSON, promptly -------------------------------------------------------------------


def test_errors_are_prompt_4xx_json(gateway):
    gateway.episodes.open("ok")
    chat = "/v1/chat/completions"
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "user": "ok"}
    cases = [
        (b"{not json", {}, 400, "not valid JSON"),
        (b"[1, 2]", {}, 400, "JSON object"),
        (json.dumps({**good, "user": "nobody"}).encode(), {}, 404, "unknown episode"),
        (json.dumps({**good, "user": None}).encode(), {}, 400, "no episode id"),
        (json.dumps(good).encode(), {EPISODE_HEADER: "other"}, 400, "differ"),
        (json.dumps({**good, "model": "gpt-4o"}).encode(), {}, 404, "not served"),
        (json.dumps({**good, "temperature": 0.2}).encode(), {}, 400, "rollout.temperature"),
        (json.dumps({**good, "max_tokens": 99}).encode(), {}, 400, "rollout.max_new_tokens"),
        (json.dumps({**good, "n": 2}).encode(), {}, 400, "n=1"),
        (json.dumps({**good, "response_format": {}}).encode(), {}, 400, "response_format"),
        (json.dumps({**good, "messages": []}).encode(), {}, 400, "messages"),
    ]
    for raw, headers, status, words in cases:
        got, body, seconds = _post(gateway, chat, raw, headers)
        assert (got, seconds < 5) == (status, True), (raw, body)
        assert words in body["error"]["message"], body
    assert _post(gateway, "/v1/nothing", b"{}")[0] == 404
    assert gateway.episodes.get_open("ok").calls == []  # no refused request was recorded
    gateway.episodes.end("ok")
    with pytest.raises(openai.APIStatusError) as ended:
        client(gateway).chat.completions.create(model=MODEL, messages=good["messages"], user="ok")
    assert ended.value.status_code == 410 and "has ended" in ended.value.message
    with pytest.raises(openai.NotFoundError, match="unknown episode"):
        client(gateway).completions.create(model=MODEL, prompt="x", user="ghost")


def test_rewritten_history_is_split_or_refused_naming_the_episode(gateway, policy):
    gateway.episodes.open("rw")
    c = client(gateway)
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], user="rw")
    c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "b"}], user="rw")
    log = gateway.episodes.end("rw")
    assert [k.segment for k in log.calls] == [0, 1]
    done = Finished(log, {}, 7, 0, 0.5, True)
    with pytest.raises(ValueError, match="episode 'rw': call 1 does not extend"):
        episode_rows(done, "error")
    rows = episode_rows(done, "split")
    assert [r.prompt for r in rows] == [k.prompt_ids for k in log.calls]
    assert [r.ids for r in rows] == [k.completion_ids for k in log.calls]
    rollout = episodes_rollout([done], policy.tokenizer, "split")
    assert rollout.group_ids.tolist() == [7, 7] and rollout.rewards["return"].tolist() == [0.5, 0.5]
    assert torch.allclose(
        _scored(policy, rollout)[rollout.mask], rollout.engine_logp[rollout.mask], atol=1e-4
    )


# ---- 2 training steps on an openai-client agent's episodes --------------------------------------------

AGENT = '''
"""A small agent: ask with a tool, answer the tool call (or nudge), then take the final answer."""
import json
import openai

TOOLS = TOOLS_JSON


def agent(base_url, episode_id, example):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": example["prompt"]}]
    first = client.chat.completions.create(
        model="grouprl-policy", messages=messages, tools=TOOLS, user=episode_id, max_tokens=6
    ).choices[0].message
    messages.append(first.model_dump(exclude_none=True))
    if first.tool_calls:
        for call in first.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(args.get("a", 0) + args.get("b", 0))})
    else:
        messages.append({"role": "user", "content": "Answer with a number."})
    final = client.chat.completions.create(
        model="grouprl-policy", messages=messages, tools=TOOLS, user=episode_id, max_tokens=6
    ).choices[0].message.content or ""
    digits = sum(ch.isdigit() for ch in final)
    return {"reward": digits / max(len(final), 1), "success": example["answer"] in final}
'''


def test_two_training_steps_on_an_openai_agent(tmp_path, tiny_model_dir):
    from grouprl.config.loading import validate
    from grouprl.train import train

    program = tmp_path / "agent.py"
    program.write_text(AGENT.replace("TOOLS_JSON", repr([ADD_TOOL])))
    raw = {
        "run": {"name": "run", "output_dir": str(tmp_path), "device": "cpu", "console": False},
        "model": {"name_or_path": str(tiny_model_dir)},
        "workload": {"type": "gateway"},
        "gateway": {"program": f"{program}:agent", "max_episode_tokens": 1024, "concurrency": 2},
        "task": {"name": "arithmetic", "options": {"n_train": 8, "n_eval": 2}},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6},
        "algorithm": {"kl_coef": 0.0},
        "train": {"steps": 2, "lr": 1e-3},
    }  # fmt: skip
    result = train(validate(raw))
    assert result["accuracy_key"] == "accuracy" and set(result["after"]) >= {"reward", "calls"}
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["split"] == "train"]
    assert len(steps) == 2 and all(math.isfinite(s["loss"]) for s in steps)
    assert [s["episode/calls"] for s in steps] == [2.0, 2.0]
    # the second step's episodes were sampled by the weights after one update
    assert [s["episode/weight_version"] for s in steps] == [0.0, 1.0]


def test_qwen25_replica_tools_branch_and_tool_results(tmp_path):
    """On the Qwen2.5 replica (its real chat template with the tools branch): the request's tools
    are rendered by the template into call 1's prompt, a `tool` message of the program comes back
    as the template's <tool_response> delta after the sampled tokens, and the row's log-probs are
    the policy's own."""
    from grouprl.replicas.text import build

    policy = CausalLMPolicy.from_pretrained(
        str(build("qwen2.5", tmp_path / "qwen")), dtype="float32"
    )
    tok = policy.tokenizer
    with Gateway(
        policy, SamplingParams(temperature=1.0, max_new_tokens=6), max_episode_tokens=1024
    ) as gw:
        gw.episodes.open("q")
        c = client(gw)
        messages = [{"role": "user", "content": "What is 2+3?"}]
        first = c.chat.completions.create(
            model=MODEL, messages=messages, tools=[ADD_TOOL], user="q"
        )
        history = [
            *messages,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": "c00000000", "content": "5"},
        ]
        c.chat.completions.create(model=MODEL, messages=history, tools=[ADD_TOOL], user="q")
        one, two = gw.episodes.end("q").calls
    assert one.prompt_ids == prompt_ids(tok, messages, [ADD_TOOL])
    assert '"name": "add"' in tok.decode(one.prompt_ids) and "<tools>" in tok.decode(one.prompt_ids)
    before = one.prompt_ids + one.completion_ids
    assert two.segment == 0 and two.prompt_ids[: len(before)] == before
    delta = tok.decode(two.prompt_ids[len(before) :])
    assert "<tool_response>\n5\n</tool_response>" in delta and delta.endswith(
        "<|im_start|>assistant\n"
    )
    rollout = episodes_rollout([Finished(gw.episodes.end("q"), {}, 0, 0, 1.0, True)], tok, "error")
    mask = rollout.mask
    assert int(mask.sum()) == len(one.completion_ids) + len(two.completion_ids)
    assert torch.allclose(_scored(policy, rollout)[mask], rollout.engine_logp[mask], atol=1e-4)


def test_a_body_that_never_arrives_is_a_408_not_a_hang(policy):
    import socket

    with Gateway(policy, SamplingParams(max_new_tokens=4), request_timeout_s=1.0) as gw:
        url = urlparse(gw.base_url)
        start = time.monotonic()
        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b'\r\nContent-Length: 100\r\n\r\n{"model": '
            )
            answer = b""
            while chunk := sock.recv(4096):  # the server closes the connection after answering
                answer += chunk
            answer = answer.decode()
        assert answer.startswith("HTTP/1.1 408") and "request_timeout_s" in answer
        assert time.monotonic() - start < 5


def test_program_failures_name_the_episode(policy):
    from grouprl.rollouts.gateway.episodes import run_episodes

    def ask(base_url, episode_id):
        c = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
        return c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], user=episode_id, max_tokens=2
        )

    def raises(base_url, episode_id, example):
        ask(base_url, episode_id)
        raise KeyError("boom")

    late: list = []

    def slow(base_url, episode_id, example):
        time.sleep(1.5)
        try:
            ask(base_url, episode_id)
        except openai.APIStatusError as exc:
            late.append(exc.status_code)
        return 1.0

    params = SamplingParams(max_new_tokens=4)
    with Gateway(policy, params, request_timeout_s=5.0) as gw:
        with pytest.raises(
            RuntimeError, match=r"episode 'ep-0-0-\w+': the program raised KeyError"
        ):
            run_episodes(gw, raises, [{}], 1)
        with pytest.raises(TimeoutError, match="episode_timeout_s=0.5"):
            run_episodes(gw, slow, [{}], 1, timeout_s=0.5)
        time.sleep(1.5)
        assert late == [410]  # the program past its deadline: its episode had ended
        with pytest.raises(TypeError, match="must return a number"):
            run_episodes(gw, lambda u, e, x: (ask(u, e), "yes")[1], [{}], 1)
        with pytest.raises(ValueError, match="made no call"):
            run_episodes(gw, lambda u, e, x: 1.0, [{}], 1)
        done = run_episodes(
            gw, lambda u, e, x: ask(u, e) and None, [{"k": 1}, {"k": 2}], 2, first_group_id=5,
            reward_fn=lambda ex, calls: ex["k"] + len(calls),
        )  # fmt: skip
    assert gw._batcher is None  # stopped with the server
    assert [(f.group, f.index, f.reward) for f in done] == [
        (5, 0, 2.0),
        (5, 1, 2.0),
        (6, 0, 3.0),
        (6, 1, 3.0),
    ]


def test_gateway_options_fail_naming_the_key():
    from grouprl.config.loading import validate

    base = {
        "model": {"name_or_path": "x"}, "workload": {"type": "gateway"},
        "task": {"name": "arithmetic"},
    }  # fmt: skip
    with pytest.raises(Exception, match="progam"):
        validate({**base, "gateway": {"program": "a.py:f", "progam": 1}})
    with pytest.raises(Exception, match="reward_fn"):
        validate({**base, "gateway": {"program": "a.py:f", "reward": "function"}})
    with pytest.raises(Exception, match="program"):
        validate({**base, "gateway": {}})
    cfg = validate({**base, "gateway": {"program": "a.py:f", "on_rewrite": "split"}})
    assert cfg.workload_settings.on_rewrite == "split"
    from grouprl.config import docs

    assert "gateway.on_rewrite: split | error" in docs.show_text("gateway")  # grouprl config show


def test_messages_the_template_refuses_are_a_400(tmp_path):
    """Mistral v0.3's template raises on roles that do not alternate: a 400 quoting it, not a 500."""
    from grouprl.replicas.text import build

    policy = CausalLMPolicy.from_pretrained(str(build("mistral", tmp_path / "m")), dtype="float32")
    with Gateway(policy, SamplingParams(max_new_tokens=4)) as gw:
        gw.episodes.open("m")
        with pytest.raises(openai.BadRequestError, match="roles must alternate"):
            client(gw).chat.completions.create(
                model=MODEL, user="m",
                messages=[{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
            )  # fmt: skip
        assert gw.episodes.end("m").calls == []


def test_concurrent_episodes_sample_in_one_batch_with_their_own_log_probs(policy):
    """4 episodes that call at the same moment are one engine batch; each row's recorded log-probs
    are still the policy's scores of its own tokens."""
    import threading

    from grouprl.rollouts.gateway.episodes import run_episodes

    barrier = threading.Barrier(4)

    def together(base_url, episode_id, example):
        barrier.wait(timeout=10)
        c = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": example["q"]}], user=episode_id
        )
        return 0.0

    with Gateway(policy, SamplingParams(max_new_tokens=6), max_batch=8) as gw:
        batcher = gw._batcher
        done = run_episodes(gw, together, [{"q": "a"}, {"q": "bcd"}], 2, concurrency=4)
    assert batcher.largest > 1
    rollout = episodes_rollout(done, policy.tokenizer, "error")
    mask = rollout.mask
    assert torch.allclose(_scored(policy, rollout)[mask], rollout.engine_logp[mask], atol=1e-4)
