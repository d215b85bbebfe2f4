"""The tool bugs of issue 14 (and the tool bullets of issue 15), each tested through the APIs
that existed before the fix, so that every test here fails on the old code:
  - tool schemas never reached the chat template (`tools=` was never passed);
  - tool results came back as user messages;
  - tools could not be set in the config (`agent.tools`);
  - a second tool call in one turn was dropped silently;
  - only the Hermes <tool_call> format parsed (Llama 3 JSON and Mistral [TOOL_CALLS] did not);
  - `ToolSet.invoke` let SystemExit escape; a lone surrogate in a tool result or an observation
    raised in encoding.
Helpers here (replica tokenizers, a scripted engine, a one-question env) are shared with
test_tools_real.py.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from grouprl.config.loading import apply_overrides, validate
from grouprl.envs.toolmath import ToolMathEnv
from grouprl.envs.tools.calls import ParsedAction
from grouprl.envs.tools.schemas import ToolSet
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import GenerationOutput, SamplingParams
from grouprl.policies.text.tiny import char_tokenizer, tiny_qwen2
from grouprl.replicas.text import build
from grouprl.rollouts.multi_turn import collect_episodes

FAMILIES = ("qwen2.5", "qwen3", "llama3", "mistral")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a * b


def replica_tokenizers(tmp_path_factory) -> dict:
    """The tokenizers of the chat replicas, each loaded from its hub-layout folder."""
    root = tmp_path_factory.mktemp("tool_replicas")
    return {f: AutoTokenizer.from_pretrained(build(f, root / f)) for f in FAMILIES}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    return replica_tokenizers(tmp_path_factory)


def test_toolset_base_exceptions_are_the_calls_error():
    def leave(code: int) -> str:
        """Exit.

        Args:
            code: exit status
        """
        raise SystemExit(code)

    def interrupt() -> str:
        """Interrupt."""
        raise KeyboardInterrupt

    ts = ToolSet([leave, interrupt])
    res = ts.invoke(ParsedAction(ok=True, name="leave", arguments={"code": 0}))
    assert (res.ok, res.reason) == (False, "tool_error")
    assert res.text == "Error: leave raised SystemExit: 0"
    with pytest.raises(KeyboardInterrupt):  # a real Ctrl-C still stops the run
        ts.invoke(ParsedAction(ok=True, name="interrupt", arguments={}))


def test_tool_results_are_valid_utf8(toks):
    def lone() -> str:
        """A broken string."""
        return "a\ud800b"

    res = ToolSet([lone]).invoke(ParsedAction(ok=True, name="lone", arguments={}))
    assert res.ok and res.text == "a?b"
    res.text.encode("utf-8")  # encodable


class AnswerEnv:
    """One question; a reply without tool calls is the answer (reward 1 when it holds "5")."""

    system_prompt = "Answer with the help of the tools."

    def __init__(self, observation: str = "What is 2+3?") -> None:
        self.observation = observation

    def reset(self, seed=None, options=None):
        return self.observation, {"anchor": "q"}

    def step(self, action: str):
        ok = "5" in action
        return "done", float(ok), True, False, {"success": ok, "anchor": "end"}


class ScriptedEngine:
    """Replies the token ids of `replies[turn]` then `end` (the sampled EOS / end-of-turn)."""

    def __init__(self, tok, replies: list[str], end: list[int]) -> None:
        self.tok, self.replies, self.end, self.turn = tok, replies, end, 0

    def generate(self, prompts, params, *, greedy=False) -> GenerationOutput:
        ids = self.tok(self.replies[self.turn], add_special_tokens=False).input_ids + self.end
        self.turn += 1
        return GenerationOutput(
            [list(ids) for _ in prompts], [[-0.5] * len(ids)] * len(prompts), [False] * len(prompts)
        )


def run_episode(tok, replies, env=None, toolset=None, fmt="auto", max_turns=8):
    end = [tok.eos_token_id]
    policy = CausalLMPolicy(
        tiny_qwen2(char_tokenizer()), tok, engine=ScriptedEngine(tok, replies, end)
    )
    return collect_episodes(
        policy, lambda: env or AnswerEnv(), [0], 1, SamplingParams(max_new_tokens=256),
        max_turns=max_turns, max_total_tokens=100_000,
        **({"toolset": toolset, "tool_format": fmt} if toolset is not None else {}),
    )  # fmt: skip


def test_env_tool_outputs_are_tool_messages_toolmath(toks):
    """ToolMath runs its python tool itself: its output comes back as a `tool` message rendered
    by the template (<tool_response> for Qwen), and its schema goes through `tools=`."""
    tok = toks["qwen2.5"]
    env = ToolMathEnv(max_turns=3)
    obs, _ = env.reset(seed=0)
    answer = env.problem.answer
    code = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    r = run_episode(tok, [code, f"<answer>{answer}</answer>"], env=env, max_turns=3)
    assert r.info["success"] == [True]
    messages = r.info["messages"][0]
    assert [m["role"] for m in messages[2:4]] == ["assistant", "tool"]
    assert messages[3]["name"] == "python" and messages[3]["content"] == "42"
    prompt = tok.decode(r.actions.prompt_ids[0][r.actions.prompt_mask[0]].tolist())
    assert '<tools>\n{"type": "function", "function": {"name": "python"' in prompt
    completion = tok.decode(r.actions.completion_ids[0].tolist())
    assert (
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        in completion
    )


def test_lone_surrogate_observation_does_not_break_encoding(toks):
    r = run_episode(toks["llama3"], ["It is 5."], env=AnswerEnv("What is 2+3? \ud800"))
    assert r.info["messages"][0][1]["content"].endswith("? ?")


def test_tools_can_be_set_in_the_config(tmp_path):
    raw = {"run": {"name": "t", "output_dir": str(tmp_path)}, "model": {"name_or_path": "x"},
           "task": {"name": "env", "options": {"env_id": "grouprl/ToolMath-v0"}}}  # fmt: skip
    cfg = validate(apply_overrides(raw, ["agent.tools=[json:dumps]"]))
    assert cfg.agent.tools == ["json:dumps"] and cfg.agent.tool_format == "auto"


def test_second_call_of_a_turn_is_run_not_dropped(toks):
    tok = toks["qwen2.5"]
    two = (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "mul", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    )
    r = run_episode(tok, [two, "5"], toolset=ToolSet([add, mul]))
    results = [(m["name"], m["content"]) for m in r.info["messages"][0] if m["role"] == "tool"]
    assert results == [("add", "5"), ("mul", "6")]


@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_llama3_json_and_mistral_calls_parse(toks, family):
    tok = toks[family]
    reply = (
        json.dumps({"name": "add", "parameters": {"a": 2, "b": 3}})
        if family == "llama3"
        else '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "abcDEF123"}]'
    )
    r = run_episode(tok, [reply, "It is 5."], toolset=ToolSet([add]))
    tool = [m for m in r.info["messages"][0] if m["role"] == "tool"]
    assert [(m["name"], m["content"]) for m in tool] == [("add", "5")]
    assert r.info["success"] == [True]
    if family == "mistral":  # the result answers the model's own call id, in Mistral's form
        assert tool[0]["tool_call_id"] == "abcDEF123"
        text = tok.decode(r.actions.completion_ids[0].tolist())
        assert '[TOOL_RESULTS] {"content": 5, "call_id": "abcDEF123"}[/TOOL_RESULTS]' in text
    else:  # Llama 3 returns tool results in an ipython turn
        text = tok.decode(r.actions.completion_ids[0].tolist())
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>' in text
