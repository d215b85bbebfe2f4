"""Code-execution reward: run each completion's code against the example's tests in the sandbox.

`code_reward(...)` returns a `CodeReward`, a batched reward function
`fn(completions, tests=[...], setup_code=[...], **_) -> list[float | None]` (the protocol of
envs/rewards/loading.py) that also counts every outcome for the metrics (`pop_metrics`).

Tests (one example's `tests` column, see `normalize_tests`) come in two kinds:
  assert  a list of Python snippets, run one after the other in the namespace of the solution
          (MBPP's `test_list`: "assert add(1, 2) == 3"); a test passes when it raises nothing.
  io      a list of {"input": str, "output": str}, or {"inputs": [...], "outputs": [...]} (APPS
          style): the solution runs as a script (`__name__ == "__main__"`) once per test with that
          stdin; it passes when its stdout equals the output after normalisation (trailing
          whitespace of each line and leading / trailing blank lines removed).

One `run_python` call per completion runs a small harness (code_harness.py) that compiles the code,
runs the setup code, the solution and every test, and reports one line per test on a duplicate of
the original stdout, prefixed by a random per-call nonce; the solution's own prints go to a capped
buffer. The parent compares io outputs itself (the expected outputs never enter the sandbox). When
the run dies (timeout, memory, killed) the tests reported so far keep their result, the others fail.

Score (`mode`): "fraction" = passed / total tests, "all" = 1.0 only when every test passed.
Outcomes counted per completion (metrics `code/<outcome>`, failures logged): passed, failed (ran,
some answer wrong), no_code, syntax_error, runtime_error (an exception other than a failed assert),
timeout, memory, killed, error (the process exited abnormally, e.g. os._exit). Every one scores what
its reported tests earn, so hostile code scores 0 and the run goes on.

Limits and deviations: the harness and the solution share one interpreter, so a completion written
to defeat the harness (reading the nonce from the harness's frames and printing forged lines) can
fake passes; the sandbox keeps it contained either way. MBPP / HumanEval evaluation code checks the
exit status of one script per problem instead; per-test reports here give partial credit.
"""

from __future__ import annotations

import logging
import math
import re
import secrets
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from grouprl.envs.rewards.code_harness import CodeTests, judge, normalize_tests, program
from grouprl.envs.rewards.loading import column, completion_texts
from grouprl.envs.sandbox import Isolation, run_python

_log = logging.getLogger(__name__)

OUTCOMES = ("passed", "failed", "no_code", "syntax_error", "runtime_error", "timeout", "memory",
            "killed", "error")  # fmt: skip
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "python3", "py"}


def _block_or_raw(text: str) -> str:
    return _last_block(text) or text.strip()


def _last_block(text: str) -> str:
    """The last ```python block (unclosed: to the end), else the last untagged ``` block, else ''."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    for wanted in (_PYTHON_TAGS, {""}):
        found = [body for tag, body in blocks if tag in wanted]
        if found:
            return found[-1].strip()
    return ""


CodeFrom = Literal["block_or_raw", "block"]
CODE_FROM: dict[str, Callable[[str], str]] = {"block_or_raw": _block_or_raw, "block": _last_block}


def extract_code(text: str, code_from: CodeFrom = "block_or_raw") -> str:
    """The code in a completion: the last ```python block, or (block_or_raw) the whole text."""
    return CODE_FROM[code_from](text)


# ---------------------------------------------------------------- the reward


def _fraction(passed: int, total: int) -> float:
    return passed / total


def _all_pass(passed: int, total: int) -> float:
    return float(passed == total)


CodeScore = Literal["fraction", "all"]
SCORES: dict[str, Callable[[int, int], float]] = {"fraction": _fraction, "all": _all_pass}


@dataclass(frozen=True)
class CodeRewardDefaults:
    """The defaults of the code reward's options, declared once: `code_reward` and the code task
    (envs/tasks/code.py, which passes them through) both read them from `CODE_REWARD_DEFAULTS`."""

    mode: CodeScore = "fraction"
    timeout_s: float = 5.0
    memory_mb: int = 256
    workers: int = 4
    code_from: CodeFrom = "block_or_raw"
    isolation: Isolation = "auto"


CODE_REWARD_DEFAULTS = CodeRewardDefaults()
_D = CODE_REWARD_DEFAULTS


class CodeReward:
    """The batched code-execution reward (see the module docstring and `code_reward`)."""

    def __init__(self, mode: CodeScore, timeout_s: float, memory_mb: int, workers: int,
                 code_from: CodeFrom, isolation: Isolation, tests_column: str,
                 setup_column: str | None) -> None:  # fmt: skip
        for option, value, allowed in (("mode", mode, SCORES), ("code_from", code_from, CODE_FROM)):
            if value not in allowed:
                raise ValueError(f"code reward {option}={value!r}: allowed are {list(allowed)}")
        if not (math.isfinite(timeout_s) and timeout_s > 0) or memory_mb < 32 or workers < 1:
            raise ValueError(
                f"code reward needs timeout_s > 0, memory_mb >= 32, workers >= 1; got "
                f"{timeout_s}, {memory_mb}, {workers}"
            )
        self.score, self.timeout_s, self.memory_mb = SCORES[mode], timeout_s, memory_mb
        self.workers, self.code_from, self.isolation = workers, code_from, isolation
        self.tests_column, self.setup_column = tests_column, setup_column
        self.counts: Counter = Counter()

    def run_one(self, completion: str, tests: CodeTests, setup: str = "") -> tuple[float, str, str]:
        """(reward, outcome, detail) of one completion against its tests."""
        code = extract_code(completion, self.code_from)
        if not code:
            return self.score(0, len(tests.cases)), "no_code", ""
        nonce = f"@@grouprl-{secrets.token_hex(8)}@@"
        source, room = program(code, setup, tests, nonce)
        result = run_python(source, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                            isolation=self.isolation, output_cap=room)  # fmt: skip
        passed, outcome, detail = judge(result, nonce, tests)
        return self.score(passed, len(tests.cases)), outcome, detail

    def __call__(self, completions: list[str], **columns: Any) -> list[float | None]:
        n = len(completions)
        raw_tests = column(columns, self.tests_column, n, "code")
        setups: Any = [""] * n  # the setup column is optional: most datasets have none
        if self.setup_column is not None and self.setup_column in columns:
            setups = column(columns, self.setup_column, n, "code")
        jobs = []
        texts = completion_texts(completions)  # strings or TRL message lists
        for i, (text, tests, setup) in enumerate(zip(texts, raw_tests, setups)):
            if not isinstance(text, str) or not isinstance(setup, str | None):
                raise TypeError(f"code reward: sample {i} needs str completion and setup code")
            jobs.append((text, normalize_tests(tests, f"code reward, sample {i}"), setup or ""))
        with ThreadPoolExecutor(max_workers=min(self.workers, max(n, 1))) as pool:
            results = list(pool.map(lambda job: self.run_one(*job), jobs))
        outcomes = Counter(outcome for _, outcome, _ in results)
        self.counts.update(outcomes)
        self.counts["runs"] += n
        failures = {k: v for k, v in outcomes.items() if k not in ("passed", "failed")}
        for i, (_, outcome, detail) in enumerate(results):
            if outcome in failures:
                _log.info("code reward: sample %d: %s %s", i, outcome, detail.strip()[-200:])
        if failures:
            _log.warning("code reward: %d of %d runs failed: %s", sum(failures.values()), n,
                         ", ".join(f"{k} {v}" for k, v in sorted(failures.items())))  # fmt: skip
        return [score for score, _, _ in results]

    def pop_metrics(self) -> dict[str, float]:
        """Outcome counts since the last call (`code/<outcome>`, `code/runs`), then reset."""
        out = {f"code/{k}": float(self.counts.get(k, 0)) for k in ("runs", *OUTCOMES)}
        self.counts.clear()
        return out


def code_reward(
    mode: CodeScore = _D.mode,
    timeout_s: float = _D.timeout_s,
    memory_mb: int = _D.memory_mb,
    workers: int = _D.workers,
    code_from: CodeFrom = _D.code_from,
    isolation: Isolation = _D.isolation,
    tests_column: str = "tests",
    setup_column: str | None = "setup_code",
) -> CodeReward:
    """Reward = tests passed by the completion's code, run in the sandbox (module docstring).

    mode:         "fraction" (passed / total) or "all" (1.0 only when every test passes)
    timeout_s:    wall-clock limit of one completion's run (all its tests together)
    memory_mb:    address-space limit of that run
    workers:      completions run in parallel (each is one sandboxed process)
    code_from:    "block_or_raw" (the last ```python block, else the whole completion) or "block"
    isolation:    sandbox isolation mode ("auto": the strongest this machine offers)
    tests_column, setup_column: example columns with the tests and code run before the solution
    """
    return CodeReward(mode, timeout_s, memory_mb, workers, code_from, isolation, tests_column,
                      setup_column)  # fmt: skip
