"""Tools for real (issue 14, item 6): schemas through the chat template, results as `tool`
messages in the template's own form, tools from the config, every call of a turn run in order,
the Hermes / Llama 3 JSON / Mistral call formats (round trip through each replica's template),
no token drift over 5 tool turns, and the ToolSet's BaseException / UTF-8 guards (issue 15)."""

from __future__ import annotations

import copy
import json
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tools_bugs import FAMILIES, AnswerEnv, add, mul, replica_tokenizers, run_episode
from transformers import AutoTokenizer

from grouprl.config.loading import apply_overrides, validate
from grouprl.envs.tools.calls import ParsedAction
from grouprl.envs.tools.formats import (
    detect_tool_format,
    parse_tool_calls,
    render_tool_call,
    text_outside_calls,
)
from grouprl.envs.tools.schemas import ToolSet, load_tools, tools_system_prompt, valid_utf8
from grouprl.policies.text.tiny import char_tokenizer
from grouprl.replicas.text import build


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    return replica_tokenizers(tmp_path_factory)


FORMAT = {"qwen2.5": "hermes", "qwen3": "hermes", "llama3": "llama3_json", "mistral": "mistral"}


def assistant_text(tok, calls: list[dict], tools: list[dict]) -> str:
    """What the template renders for an assistant message with `calls` (its content only: the
    text between the generation prompt and the turn's end marker)."""
    user = [{"role": "user", "content": "q"}]
    start = tok.apply_chat_template(user, tools=tools, tokenize=False, add_generation_prompt=True)
    msg = {"role": "assistant", "content": "", "tool_calls": calls}
    end = {"role": "tool", "content": "r", "tool_call_id": calls[0]["id"], "name": "add"}
    full = tok.apply_chat_template([*user, msg, end], tools=tools, tokenize=False)
    assert full.startswith(start)
    body = full[len(start) :]
    return body[: body.index(tok.eos_token)]


def call(name: str, args: dict, cid: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


# ---- formats: parsing, auto detection, round trips through the replicas' templates -------------


def test_auto_format_from_each_template(toks):
    assert {f: detect_tool_format(t) for f, t in toks.items()} == FORMAT
    assert detect_tool_format(char_tokenizer()) == "hermes"  # no template: the plain listing's


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_the_template(toks, family):
    tok, fmt = toks[family], FORMAT[family]
    tools = ToolSet([add, mul]).schemas()
    # Llama 3's template renders one call per message (more raise); the others take several
    calls = [call("add", {"a": 2, "b": 3}, "abcDEF123")]
    if family != "llama3":
        calls.append(call("mul", {"a": 4, "b": 5}, "xyz789XYZ"))
    text = assistant_text(tok, calls, tools)
    parsed = parse_tool_calls(text, fmt)
    assert [(p.ok, p.name, p.arguments) for p in parsed] == [
        (True, c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    if family == "mistral":
        assert [p.call_id for p in parsed] == ["abcDEF123", "xyz789XYZ"]
    assert text_outside_calls(text, fmt) == ""
    one = render_tool_call("add", {"a": 1, "b": 2}, fmt)
    assert [(p.name, p.arguments) for p in parse_tool_calls(one, fmt)] == [
        ("add", {"a": 1, "b": 2})
    ]


def test_parsers_by_hand():
    hermes = 'I add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "mul"'
    got = parse_tool_calls(hermes, "hermes")
    assert [(p.ok, p.name, p.reason) for p in got] == [
        (True, "add", None),
        (False, None, "json_error"),
    ]
    assert text_outside_calls(hermes, "hermes") == "I add."
    llama = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "mul", "parameters": {}}'
    got = parse_tool_calls(llama, "llama3_json")
    assert [(p.name, p.arguments) for p in got] == [("add", {"a": 1, "b": 2}), ("mul", {})]
    assert parse_tool_calls("The answer is 5.", "llama3_json") == []  # plain text: the answer
    bad = parse_tool_calls('{"name": "add", "parameters": [1]}', "llama3_json")
    assert [(p.ok, p.reason) for p in bad] == [(False, "bad_arguments")]
    trailing = parse_tool_calls('{"name": "add"} and more', "llama3_json")
    assert [p.ok for p in trailing] == [True, False]
    mistral = 'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}, "id": "a1b2c3d4e"}]'
    (p,) = parse_tool_calls(mistral, "mistral")
    assert (p.name, p.arguments, p.call_id) == ("add", {"a": 1}, "a1b2c3d4e")
    assert text_outside_calls(mistral, "mistral") == "Sure."
    assert parse_tool_calls("no calls", "mistral") == []
    assert [p.reason for p in parse_tool_calls("[TOOL_CALLS] [", "mistral")] == ["json_error"]
    with pytest.raises(ValueError, match="allowed are hermes, llama3_json, mistral"):
        parse_tool_calls("x", "xml")


# ---- ToolSet: BaseException, UTF-8, several calls, loading from the config ----------------------


def test_all_calls_of_a_turn_run_in_order():
    ts = ToolSet([add, mul])
    calls = parse_tool_calls(
        render_tool_call("mul", {"a": 2, "b": 3}, "hermes")
        + render_tool_call("add", {"a": 2, "b": 3}, "hermes")
        + render_tool_call("nope", {}, "hermes"),
        "hermes",
    )
    assert [r.text for r in ts.run_calls(calls)] == [
        "6",
        "5",
        "Error: unknown tool 'nope'; tools: add, mul",
    ]
    assert ts.stats.attempts == 3 and ts.stats.failures["unknown_tool"] == 1


def test_tools_from_the_config_resolve_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_tools_mod.py").write_text(
        textwrap.dedent('''
        def double(x: int) -> int:
            """Double a number.

            Args:
                x: the number
            """
            return 2 * x
        ''')
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "nowhere"))  # sys.path restored after the test
    (fn,) = load_tools(["my_tools_mod:double"])
    assert fn(4) == 8
    (by_file,) = load_tools([f"{tmp_path / 'my_tools_mod.py'}:double"])
    assert by_file(1) == 2
    with pytest.raises(ModuleNotFoundError, match="working directory"):
        load_tools(["no_such_tools_mod:f"])
    with pytest.raises(ValueError, match="module:function"):
        load_tools(["double"])
    raw = {"run": {"name": "t", "output_dir": str(tmp_path)}, "model": {"name_or_path": "x"},
           "task": {"name": "env", "options": {"env_id": "grouprl/ToolMath-v0"}}}  # fmt: skip
    cfg = validate(
        apply_overrides(raw, ["agent.tools=[my_tools_mod:double]", "agent.tool_format=llama3_json"])
    )
    assert (cfg.agent.tools, cfg.agent.tool_format) == (["my_tools_mod:double"], "llama3_json")
    with pytest.raises(Exception, match="tool_format"):
        validate(apply_overrides(copy.deepcopy(raw), ["agent.tool_format=xml"]))
    single = {"run": raw["run"], "model": raw["model"], "task": {"name": "arithmetic"}}
    with pytest.raises(
        Exception, match=r"section 'agent' \(agent\.tools\) applies to workload 'agent'"
    ):
        validate(apply_overrides(single, ["agent.tools=[my_tools_mod:double]"]))


def test_valid_utf8():
    assert valid_utf8("a\ud800b ✓") == "a?b ✓"


def test_plain_tool_listing_without_a_tools_branch():
    ts = ToolSet([add])
    prompt = tools_system_prompt(ts, char_tokenizer(), "llama3_json")
    assert '"name": "add"' in prompt and '{"name": "<tool name>", "parameters"' in prompt


# ---- rollouts with tools: scripted turns on the replicas' tokenizers ----------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_no_token_drift_over_five_tool_turns(toks, family):
    """The ids the policy trains on equal the template's rendering of the whole conversation:
    system prompt, tools, five turns of tool calls with their `tool` results, the answer."""
    tok = toks[family]
    ts = ToolSet([add, mul])
    turns = [[call("add", {"a": k, "b": 3}, f"call{k:05d}")] for k in range(5)]
    if family != "llama3":  # two calls in one turn where the template renders them
        turns[2].append(call("mul", {"a": 2, "b": 2}, "twoCALLS2"))
    replies = [assistant_text(tok, c, ts.schemas()) for c in turns] + ["It is 5."]
    r = run_episode(tok, replies, toolset=ts)
    assert r.info["turns"] == [6] and r.info["success"] == [True]
    messages = r.info["messages"][0]
    assert r.info["tool_calls"] == [sum(len(c) for c in turns)] and r.info["tool_errors"] == [0]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    want_results = [
        str(
            add(**c["function"]["arguments"])
            if c["function"]["name"] == "add"
            else mul(**c["function"]["arguments"])
        )
        for t in turns
        for c in t
    ]
    assert results == want_results and len(results) == (5 if family == "llama3" else 6)
    # the conversation up to the last tool results, re-rendered whole with the generation prompt
    history = messages[:-2]  # drop the answer and the env's last observation (never fed)
    want = tok(
        tok.apply_chat_template(
            history, tools=ts.schemas(), tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    ).input_ids
    got = r.actions.prompt_ids[0].tolist() + r.actions.completion_ids[0].tolist()
    assert got[: len(want)] == want
    answer = tok("It is 5.", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert got[len(want) :] == answer
    # every assistant turn's tokens are trained on; the template's tokens are not
    sampled = r.actions.completion_ids[0][r.mask[0]].tolist()
    expected = [
        t
        for text in replies
        for t in tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]
    ]
    assert sampled == expected


def test_schemas_reach_the_template_and_results_are_tool_messages(toks):
    tok = toks["qwen2.5"]
    reply = render_tool_call("add", {"a": 2, "b": 3}, "hermes") + render_tool_call(
        "mul", {"a": 2, "b": 3}, "hermes"
    )
    r = run_episode(tok, [reply, "5"], toolset=ToolSet([add, mul]))
    text = tok.decode(r.actions.prompt_ids[0][r.actions.prompt_mask[0]].tolist())
    assert "<tools>\n" in text and '"name": "add", "description": "Add two integers."' in text
    assert "# Tools" in text  # the template's own tools branch, not a plain-text listing
    completion = tok.decode(r.actions.completion_ids[0].tolist())
    # both calls ran, in order, and came back in ONE user turn as the template renders tool results
    assert (
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response><|im_end|>"
        in completion
    )
    roles = [m["role"] for m in r.info["messages"][0]]
    assert roles == ["system", "user", "assistant", "tool", "tool", "assistant", "user"]


def test_failed_calls_cost_the_penalty_and_the_run_goes_on(toks):
    tok = toks["llama3"]
    bad = json.dumps({"name": "add", "parameters": {"a": "two", "b": 3}})
    r = run_episode(tok, [bad, "It is 5."], toolset=ToolSet([add]))
    assert r.info["tool_errors"] == [1] and r.info["invalid_actions"] == [1]
    assert r.step_rewards[0, :2].tolist() == pytest.approx([-0.1, 1.0])
    tool = [m for m in r.info["messages"][0] if m["role"] == "tool"]
    assert tool[0]["content"].startswith("Error: bad arguments for 'add'")


@pytest.mark.parametrize("family", ["llama3", "qwen2.5"])
def test_no_token_drift_over_five_turns_with_user_observations(toks, family):
    """Text-env observations (user turns) on the replicas' templates; Llama 3 trims message
    content, so observations with surrounding whitespace go in trimmed, as the template has them."""
    tok = toks[family]

    class Echo(AnswerEnv):
        def step(self, action):
            done = action == "stop"
            return f"  turn {action} \n", float(done), done, False, {"anchor": action}

    replies = ["a", "b b", "c", "d", "stop"]
    r = run_episode(tok, replies, env=Echo())
    history = r.info["messages"][0][:-2]
    want = tok(
        tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    ).input_ids
    got = r.actions.prompt_ids[0].tolist() + r.actions.completion_ids[0].tolist()
    assert got[: len(want)] == want
    assert got[len(want) :] == tok("stop", add_special_tokens=False).input_ids + [tok.eos_token_id]


# ---- fuzzing: any text gives calls or [], never an exception; render -> parse is exact ----------

_PIECES = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{", "}", "[", "]",
           '"name"', '"parameters"', '"arguments"', '"id"', ":", ",", ";", '"', "\\", "null",
           "1e999", "NaN", '"\ud800"', "\x00", "\n", " ", "[" * 3000, '{"a":' * 2000]  # fmt: skip
_texts = st.one_of(
    st.text(max_size=200), st.lists(st.sampled_from(_PIECES), max_size=30).map("".join)
)
_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=6,
)  # fmt: skip
_settings = settings(max_examples=150, deadline=2000, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip


@_settings
@given(_texts, st.sampled_from(["hermes", "llama3_json", "mistral"]))
def test_fuzz_parse_tool_calls(reliability_counts, text, fmt):
    key = "fuzz cases: tool-call parsers (hermes, llama3_json, mistral)"
    reliability_counts[key] = reliability_counts.get(key, 0) + 1
    for p in parse_tool_calls(text, fmt):
        assert isinstance(p, ParsedAction)
        assert (p.ok and isinstance(p.arguments, dict) and p.name) or (not p.ok and p.error)


@_settings
@given(
    st.text(min_size=1, max_size=12).filter(str.strip),
    st.dictionaries(st.text(max_size=6), _json, max_size=4),
    st.sampled_from(["hermes", "llama3_json", "mistral"]),
)
def test_fuzz_render_parse_round_trip(reliability_counts, name, arguments, fmt):
    key = "fuzz cases: tool-call round trip (render -> parse, three formats)"
    reliability_counts[key] = reliability_counts.get(key, 0) + 1
    if fmt == "hermes" and "tool_call>" in name.lower():
        return  # a Hermes call cannot carry its own tag (the JSON sits between the tags)
    (p,) = parse_tool_calls(render_tool_call(name, arguments, fmt), fmt)
    assert p.ok and p.name == name.strip() and p.arguments == arguments


def test_agent_tools_from_yaml_through_grouprl_train(tmp_path, monkeypatch):
    """`agent.tools` in a YAML config, resolved from the working directory under `grouprl train`:
    the run goes through and the tools' schemas reach the prompt via the template's tools branch."""
    from grouprl.cli import main

    model = build("qwen2.5", tmp_path / "qwen2.5")
    (tmp_path / "yaml_tools_mod.py").write_text(
        'def double(x: int) -> int:\n    """Double a number.\n\n    Args:\n        x: the number\n'
        '    """\n    return 2 * x\n'
    )
    config = tmp_path / "agent.yaml"
    config.write_text(
        textwrap.dedent(f"""
        run: {{name: tools, output_dir: {tmp_path / "runs"}, console: false}}
        model: {{name_or_path: {model}}}
        task:
          name: env
          options: {{env_id: grouprl/ToolMath-v0, n_train: 4, n_eval: 1}}
        agent: {{tools: ["yaml_tools_mod:double"], max_turns: 2, max_turn_tokens: 6}}
        rollout: {{prompts_per_step: 1, group_size: 2}}
        train: {{steps: 1}}
        eval: {{every: 0, max_examples: 1}}
        """)
    )
    import grouprl.train as train_mod

    prompts, real_build = [], train_mod.build_policy

    def spy(cfg, device):  # the run's real policy; its engine's prompts are recorded
        policy = real_build(cfg, device)
        generate = policy.engine.generate

        def recording(batch, *args, **kwargs):
            prompts.extend(batch)
            return generate(batch, *args, **kwargs)

        policy.engine.generate = recording
        return policy

    monkeypatch.setattr(train_mod, "build_policy", spy)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "nowhere"))  # sys.path restored after the test
    assert main(["train", str(config)]) == 0
    first = AutoTokenizer.from_pretrained(model).decode(prompts[0])
    assert "# Tools" in first and '"name": "double", "description": "Double a number."' in first
    assert '"name": "python"' in first  # ToolMath's own tool is listed too


def test_mistral_call_without_a_valid_id_gets_one_its_result_shares(toks):
    tok = toks["mistral"]
    reply = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "bad"}]'
    r = run_episode(tok, [reply, "It is 5."], toolset=ToolSet([add]))
    messages = r.info["messages"][0]
    call, result = messages[1]["tool_calls"][0], messages[2]
    assert call["id"] == result["tool_call_id"] and len(call["id"]) == 9 and call["id"].isalnum()
    rendered = tok.apply_chat_template(
        messages[:-2], tools=ToolSet([add]).schemas(), tokenize=False
    )
    assert f'"call_id": "{call["id"]}"' in rendered  # the template accepts the conversation
