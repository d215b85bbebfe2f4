"""grouprl.envs.toolmath: problem generators, tool observations, the step contract, conformance."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from grouprl.envs.gym import check_text_env, make_text_env
from grouprl.envs.sandbox import SandboxResult
from grouprl.envs.toolmath import PROBLEMS, ToolMathEnv, make_problem, tool_observation


class ScriptedRng:
    """Stands in for np.random.Generator: `integers` returns the scripted values in order."""

    def __init__(self, *values: int) -> None:
        self.values = list(values)

    def integers(self, low: int, high: int) -> int:
        v = self.values.pop(0)
        assert low <= v < high, (v, low, high)
        return v


def call(code: str) -> str:
    return (
        "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"
    )


# ----------------------------------------------------------------------------- problems
def test_generators_by_hand():
    # name index 0 = Tom, item index 0 = apples; then a=3 boxes of b=12, gives away c=5: 36 - 5
    p = PROBLEMS["boxes"](ScriptedRng(0, 0, 3, 12, 5))
    assert p.text == "Tom has 3 boxes of 12 apples and gives away 5. How many apples are left?"
    assert p.answer == 31
    # Mia (1), pencils (1), 4 at 7 dollars = 28 -> smallest bill above is 50 -> 22 change
    p = PROBLEMS["change"](ScriptedRng(1, 1, 4, 7))
    assert "4 pencils at 7 dollars each and pays with a 50-dollar bill" in p.text and p.answer == 22
    assert PROBLEMS["trip"](ScriptedRng(60, 3, 15)).answer == 195  # 60 * 3 + 15
    assert PROBLEMS["share"](ScriptedRng(0, 2, 7, 12)).answer == 12  # 84 marbles among 7
    assert (
        "shares 84 marbles equally among 7 friends"
        in PROBLEMS["share"](ScriptedRng(0, 2, 7, 12)).text
    )
    assert PROBLEMS["orchard"](ScriptedRng(37, 48, 20)).answer == 1756  # 37 * 48 - 20


@pytest.mark.parametrize("kind", sorted(PROBLEMS))
def test_answers_follow_from_the_numbers_in_the_text(kind):
    rules = {
        "boxes": lambda a, b, c: a * b - c,
        "change": lambda n, p, bill: bill - n * p,
        "trip": lambda s, h, d: s * h + d,
        "share": lambda total, k: total // k,
        "orchard": lambda r, t, d: r * t - d,
    }
    for seed in range(40):
        p = make_problem(np.random.default_rng(seed), (kind,))
        numbers = [int(x) for x in re.findall(r"\d+", p.text)]
        assert p.answer == rules[kind](*numbers) and p.answer > 0, p


def test_same_seed_same_problem_and_seeds_vary():
    env = ToolMathEnv()
    first = [env.reset(seed=s)[0] for s in range(6)]
    assert first == [env.reset(seed=s)[0] for s in range(6)]
    assert len(set(first)) == 6
    with pytest.raises(ValueError, match="allowed are boxes"):
        ToolMathEnv(kinds=["algebra"])


# ---------------------------------------------------------------------- tool observations
def _result(reason, stdout="", stderr="", rc=0):
    return SandboxResult(reason == "ok", rc, stdout, stderr, reason)


def test_tool_observation_by_hand():
    kw = {"timeout_s": 2.0, "memory_mb": 128, "max_chars": 80}
    assert tool_observation(_result("ok", "31\n"), **kw) == "31"
    assert tool_observation(_result("ok"), **kw) == "(no output: print the values you need)"
    tb = 'Traceback (most recent call last):\n  File "main.py", line 1\n    1/0\nZeroDivisionError: x\n'
    assert tool_observation(_result("error", "a\n", tb, 1), **(kw | {"max_chars": 200})) == (
        '[python: the code raised an error]\na\n  File "main.py", line 1\n    1/0\nZeroDivisionError: x'
    )
    assert tool_observation(_result("timeout", "part\n", rc=None), **kw) == (
        "[python: stopped after the 2.0 s time limit]\npart"
    )
    assert (
        tool_observation(_result("memory", rc=86), **kw)
        == "[python: stopped at the 128 MB memory limit]"
    )
    assert (
        tool_observation(_result("killed", rc=-9), **kw)
        == "[python: the process was killed (exit -9)]"
    )
    assert tool_observation(_result("ok", "é\x00ok"), **kw) == "??ok"
    long = tool_observation(_result("ok", "x" * 500), **kw)
    assert (
        len(long) == 80 and long.endswith("\n[... output truncated]") and long.startswith("x" * 50)
    )


# --------------------------------------------------------------------------- the step contract
def test_tool_calls_answers_and_anchors():
    env = ToolMathEnv(max_turns=4, tool_timeout_s=0.5)
    obs0, info = env.reset(seed=3)
    assert obs0 == env.problem.text and info == {"anchor": (obs0,), "success": False}
    obs, r, term, trunc, info = env.step("Let me compute.\n" + call("print(6 * 7)"))
    assert (obs, r, term, trunc) == ("42", 0.0, False, False)
    assert info["valid_action"] and info["anchor"] == (obs0, "42") and info["tool_reason"] == "ok"
    obs, r, term, trunc, info = env.step(call("while True: pass"))  # a runaway costs one turn
    assert (
        obs.startswith("[python: stopped after") and not term and info["tool_reason"] == "timeout"
    )
    assert info["anchor"] == (obs0, "42", obs)
    obs, r, term, trunc, info = env.step(f"<answer>The answer is {env.problem.answer:,}.</answer>")
    assert (r, term, trunc, info["success"]) == (1.0, True, False, True)
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("<answer>1</answer>")


def test_wrong_answer_first_tag_wins_and_truncation():
    env = ToolMathEnv(max_turns=2)
    env.reset(seed=0)
    wrong = env.problem.answer + 1
    obs, r, term, trunc, info = env.step(f"<answer>{wrong}</answer> {call('print(1)')}")
    assert (r, term, info["success"], info["answer"]) == (0.0, True, False, str(wrong))
    env.reset(seed=0)
    obs, r, term, trunc, info = env.step(
        f"{call('print(5)')} <answer>{env.problem.answer}</answer>"
    )
    assert (obs, term, trunc) == ("5", False, False)
    obs, r, term, trunc, info = env.step("thinking...")  # 2nd reply of 2: truncated
    assert (r, term, trunc, info["valid_action"], info["success"]) == (
        0.0,
        False,
        True,
        False,
        False,
    )


@pytest.mark.parametrize(
    "reply, error",
    [
        ("I think it is 31.", "no <tool_call>"),
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        (
            '<tool_call>{"name": "bash", "arguments": {"code": "ls"}}</tool_call>',
            "unknown tool 'bash'",
        ),
        ('<tool_call>{"name": "python", "arguments": {"cmd": "1"}}</tool_call>', 'needs {"code"'),
        ("<answer>thirty-one</answer>", "holds no number"),
    ],
)
def test_invalid_replies_do_not_move(reply, error):
    env = ToolMathEnv()
    obs0, info0 = env.reset(seed=1)
    obs, r, term, trunc, info = env.step(reply)
    assert (obs, r, term, trunc, info["valid_action"]) == (obs0, 0.0, False, False, False)
    assert error in info["error"] and info["anchor"] == info0["anchor"]


def test_hostile_tool_code_costs_only_the_turn(tmp_path):
    env = ToolMathEnv(max_turns=8, tool_timeout_s=1.0, tool_memory_mb=128)
    env.reset(seed=2)
    for code, expect in (
        ("import os\nwhile True:\n    os.fork()", "PermissionError"),
        ("x = bytearray(1 << 31)", "memory limit"),
        (f"open({str(tmp_path / 'p')!r}, 'w').write('x')", "error"),
        ("import os; print(sorted(os.environ))", "['HOME'"),
    ):
        obs, r, term, trunc, info = env.step(call(code))
        assert expect in obs and info["valid_action"] and not term, (code, obs)
    assert not (tmp_path / "p").exists()


# ---------------------------------------------------------------------------- conformance
def test_conformance_and_registration():
    env = make_text_env("grouprl/ToolMath-v0", max_turns=3)
    assert isinstance(env.unwrapped, ToolMathEnv) and "tool_call" in env.unwrapped.system_prompt
    # seed 3 plays invalid, call, call: tool runs inside the determinism replay
    check_text_env(env, seeds=(0, 3), actions=[call("print(2 + 2)"), "<answer>7</answer>"])
