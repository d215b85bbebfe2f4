"""ToolMath: arithmetic word problems solved with a sandboxed Python tool (a text env).

Each episode is one seeded word problem ("Tom has 3 boxes of 12 apples and eats 5. How many apples
are left?"). Each turn the agent either calls the tool, Hermes/Qwen style,
  <tool_call>{"name": "python", "arguments": {"code": "print(3 * 12 - 5)"}}</tool_call>
and reads back what the code printed (run by `grouprl.envs.sandbox.run_python` with small limits),
or answers, which ends the episode:
  <answer>31</answer>      reward 1.0 when the last number inside equals the answer, else 0.0.
Whichever tag comes first in the reply counts. A reply with neither, a malformed call, an unknown
tool or an answer without a number is an invalid action: the env does not move (same observation
and anchor), reward 0, info["error"] says why. The episode is truncated after `max_turns` replies.
A tool failure (timeout, memory, exception) is an ordinary observation; the episode goes on.
A tool's output is marked info["observation_role"] = "tool" (info["tool_name"] = "python"): the
rollout returns it as a `tool` message in the chat template's own form, and `tools` (the schema)
is passed to templates that render tools.

Anchors (GiGPO step groups, arXiv 2505.10978): the problem text plus every tool output so far, so
two episodes of a group that ran code with the same outputs share a state. Same seed -> same
problem. The task follows the tool-calling math examples of the agent frameworks (verl's gsm8k
tool, peers/agents.md); deviation: the problems are generated here, not taken from a dataset.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_args

import gymnasium
import numpy as np

from grouprl.envs.answers import last_number, same_answer
from grouprl.envs.gym import MAX_ACTION_CHARS, text_space
from grouprl.envs.sandbox import Isolation, SandboxResult, run_python
from grouprl.envs.tools.calls import parse_action

TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python 3 code and return what it prints (stdout, then stderr).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python code; print results"}},
            "required": ["code"],
        },
    },
}
NAMES = ("Tom", "Mia", "Ravi", "Lena", "Omar", "Sara", "Ken", "Ada")
ITEMS = ("apples", "pencils", "marbles", "cookies", "stickers", "stamps")
_PRINTABLE = frozenset(string.printable)


@dataclass(frozen=True)
class Problem:
    text: str
    answer: int


def _i(rng: np.random.Generator, low: int, high: int) -> int:
    """A uniform integer in [low, high]."""
    return int(rng.integers(low, high + 1))


def _boxes(rng: np.random.Generator) -> Problem:
    name, item = NAMES[_i(rng, 0, 7)], ITEMS[_i(rng, 0, 5)]
    a, b = _i(rng, 2, 9), _i(rng, 3, 15)
    c = _i(rng, 1, a * b - 1)
    text = f"{name} has {a} boxes of {b} {item} and gives away {c}. How many {item} are left?"
    return Problem(text, a * b - c)


def _change(rng: np.random.Generator) -> Problem:
    name, item = NAMES[_i(rng, 0, 7)], ITEMS[_i(rng, 0, 5)]
    n, price = _i(rng, 2, 9), _i(rng, 2, 20)
    bill = next(b for b in (20, 50, 100, 200) if b > n * price)
    text = (
        f"{name} buys {n} {item} at {price} dollars each and pays with a {bill}-dollar bill. "
        "How many dollars of change are due?"
    )
    return Problem(text, bill - n * price)


def _trip(rng: np.random.Generator) -> Problem:
    speed, hours, extra = _i(rng, 20, 90), _i(rng, 2, 6), _i(rng, 5, 60)
    text = (
        f"A train runs at {speed} km per hour for {hours} hours, then {extra} km more. "
        "How many km does it travel in total?"
    )
    return Problem(text, speed * hours + extra)


def _share(rng: np.random.Generator) -> Problem:
    name, item = NAMES[_i(rng, 0, 7)], ITEMS[_i(rng, 0, 5)]
    friends, each = _i(rng, 2, 9), _i(rng, 3, 25)
    text = (
        f"{name} shares {friends * each} {item} equally among {friends} friends. "
        f"How many {item} does each friend get?"
    )
    return Problem(text, each)


def _orchard(rng: np.random.Generator) -> Problem:
    rows, per_row, lost = _i(rng, 12, 99), _i(rng, 12, 99), _i(rng, 1, 99)
    text = (
        f"An orchard has {rows} rows of {per_row} trees. A storm knocks down {lost} trees. "
        "How many trees are still standing?"
    )
    return Problem(text, rows * per_row - lost)


# problem kind -> seeded generator (a new kind: one function and one line here)
PROBLEMS: dict[str, Callable[[np.random.Generator], Problem]] = {
    "boxes": _boxes,
    "change": _change,
    "trip": _trip,
    "share": _share,
    "orchard": _orchard,
}


def make_problem(rng: np.random.Generator, kinds: Sequence[str] = tuple(PROBLEMS)) -> Problem:
    """One problem of a kind drawn uniformly from `kinds`."""
    return PROBLEMS[kinds[_i(rng, 0, len(kinds) - 1)]](rng)


def printable(text: str) -> str:
    """`text` with every character outside string.printable replaced by '?' (Text space charset)."""
    return "".join(c if c in _PRINTABLE else "?" for c in text)


# sandbox reason -> the note an observation starts with (the output, if any, follows)
_TOOL_NOTES: dict[str, str] = {
    "ok": "",
    "error": "[python: the code raised an error]",
    "timeout": "[python: stopped after the {timeout_s} s time limit]",
    "memory": "[python: stopped at the {memory_mb} MB memory limit]",
    "killed": "[python: the process was killed (exit {returncode})]",
}


def tool_observation(
    result: SandboxResult, *, timeout_s: float, memory_mb: int, max_chars: int
) -> str:
    """What the agent reads after a tool call: a failure note, stdout, then the tail of stderr.

    Over `max_chars`, stdout is cut (with a marker) so the error's last lines stay readable.
    """
    note = _TOOL_NOTES[result.reason].format(
        timeout_s=timeout_s, memory_mb=memory_mb, returncode=result.returncode
    )
    err = printable("\n".join(result.stderr.strip().splitlines()[-3:]))  # a traceback's end
    out = printable(result.stdout).rstrip("\n")
    room = max_chars - sum(len(part) + 1 for part in (note, err) if part)
    if len(out) > room:
        marker = "\n[... output truncated]"
        out = out[: max(0, room - len(marker))] + marker
    text = "\n".join(part for part in (note, out, err) if part)
    return (text or "(no output: print the values you need)")[:max_chars]


_FIRST_TAG = re.compile(r"<(tool_call|answer)>", re.IGNORECASE)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|\Z)", re.IGNORECASE | re.DOTALL)


class ToolMathEnv(gymnasium.Env):
    """Word problems + a sandboxed Python tool (see the module docstring).

    max_turns:      replies per episode (tool calls, answers and invalid replies all count)
    kinds:          problem kinds to draw from (keys of PROBLEMS); default all
    tool_timeout_s: wall-clock limit of one tool run
    tool_memory_mb: memory limit of one tool run
    max_tool_chars: longest tool observation (longer output is cut with a marker)
    isolation:      sandbox isolation mode passed to run_python ("auto" picks the strongest)
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}
    tools = [TOOL_SCHEMA]

    def __init__(
        self,
        max_turns: int = 4,
        kinds: Sequence[str] | None = None,
        tool_timeout_s: float = 2.0,
        tool_memory_mb: int = 256,
        max_tool_chars: int = 512,
        isolation: Isolation = "auto",
        render_mode: str | None = None,
    ) -> None:
        kinds = tuple(PROBLEMS if kinds is None else kinds)
        unknown = [k for k in kinds if k not in PROBLEMS]
        if not kinds or unknown:
            raise ValueError(f"unknown problem kinds {unknown}: allowed are {', '.join(PROBLEMS)}")
        if max_turns < 1 or max_tool_chars < 64:
            raise ValueError(
                f"need max_turns >= 1, max_tool_chars >= 64; got {max_turns}, {max_tool_chars}"
            )
        if isolation not in get_args(Isolation):
            raise ValueError(f"isolation must be one of {get_args(Isolation)}, got {isolation!r}")
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.max_turns, self.kinds, self.render_mode = max_turns, kinds, render_mode
        self.tool_timeout_s, self.tool_memory_mb = tool_timeout_s, tool_memory_mb
        self.max_tool_chars, self.isolation = max_tool_chars, isolation
        self.observation_space = text_space(max(max_tool_chars, 512), min_length=1)
        self.action_space = text_space(MAX_ACTION_CHARS)
        self.system_prompt = (
            "You solve arithmetic word problems. You may use one tool, a Python interpreter:\n"
            f"{json.dumps(TOOL_SCHEMA)}\n"
            "To run code, reply with exactly one call such as\n"
            '<tool_call>{"name": "python", "arguments": {"code": "print(3 * 12 - 5)"}}</tool_call>\n'
            "and you will see what the code prints. When you know the result, reply with the number "
            f"only: <answer>31</answer>. You have at most {max_turns} replies."
        )
        self.problem: Problem | None = None
        self._obs, self._outputs, self._turns, self._done = "", (), 0, True

    def reset(
        self, *, seed: int | None = None, options: dict | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.problem = make_problem(self.np_random, self.kinds)
        self._obs, self._outputs, self._turns, self._done = self.problem.text, (), 0, False
        return self._obs, {"anchor": self._anchor(), "success": False}

    def _anchor(self) -> tuple[str, ...]:
        return (self.problem.text, *self._outputs)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._done or self.problem is None:
            raise RuntimeError("step() called before reset() or after the episode ended")
        if not isinstance(action, str):
            raise TypeError(f"a text env takes the assistant text (str), got {type(action)}")
        self._turns += 1
        truncated = self._turns >= self.max_turns
        first = _FIRST_TAG.search(action)
        kind = first.group(1).lower() if first else None
        if kind == "answer":
            given = last_number(_ANSWER.search(action).group(1))
            if given is not None:
                success = same_answer(given, str(self.problem.answer))
                self._done = True
                info = {"valid_action": True, "anchor": self._anchor(), "success": success}
                info |= {"answer": given, "expected": self.problem.answer}
                verdict = "correct" if success else f"wrong; the answer is {self.problem.answer}"
                return f"Your answer {given} is {verdict}.", float(success), True, False, info
            error = "the <answer> tag holds no number"
        elif kind == "tool_call":
            parsed = parse_action(action[first.start() :], fmt="tool_call")
            code = (parsed.arguments or {}).get("code")
            if parsed.ok and parsed.name == "python" and isinstance(code, str):
                return self._run_tool(code, truncated)
            error = parsed.error or (
                f"unknown tool {parsed.name!r}: the only tool is 'python'"
                if parsed.name != "python"
                else 'the python tool needs {"code": "<a string of Python>"}'
            )
        else:
            error = "no <tool_call>...</tool_call> or <answer>...</answer> in the reply"
        self._done = truncated
        info = {"valid_action": False, "error": error, "anchor": self._anchor(), "success": False}
        return self._obs, 0.0, False, truncated, info

    def _run_tool(self, code: str, truncated: bool) -> tuple[str, float, bool, bool, dict]:
        result = run_python(
            code,
            timeout_s=self.tool_timeout_s,
            memory_mb=self.tool_memory_mb,
            isolation=self.isolation,
        )
        self._obs = tool_observation(
            result,
            timeout_s=self.tool_timeout_s,
            memory_mb=self.tool_memory_mb,
            max_chars=self.max_tool_chars,
        )
        self._outputs = (*self._outputs, self._obs)
        self._done = truncated
        info = {"valid_action": True, "anchor": self._anchor(), "success": False}
        info |= {"tool_reason": result.reason, "observation_role": "tool", "tool_name": "python"}
        return self._obs, 0.0, False, truncated, info

    def render(self) -> str | None:
        return self._obs if self.render_mode == "ansi" else None
