"""The sandbox side of the code reward: the tests' layouts, the harness program, judging its report.

`normalize_tests` reads an example's tests (layouts in grouprl/envs/rewards/code.py). `program`
builds the Python source run by `run_python`: a small harness (stdlib only) plus a JSON spec with the
solution, the setup code, the assert snippets or the io inputs, and a random nonce. The harness
compiles the code, runs setup + solution + each test, and writes one JSON line per test, prefixed by
the nonce, on a duplicate of the original stdout; the solution's prints go to a capped buffer.
`judge` turns the run into (tests passed, outcome, detail); io outputs are compared here, in the
parent (expected outputs never enter the sandbox).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from grouprl.envs.sandbox import SandboxResult

STDOUT_CAP = 4096  # characters of a solution's stdout kept per io test (more if an output needs it)

_HARNESS = r"""
import io, json, os, sys

class _Sink(io.TextIOBase):
    def __init__(self, cap):
        self.cap, self.parts, self.size = cap, [], 0
    def writable(self):
        return True
    def write(self, s):
        if not isinstance(s, str):
            raise TypeError("write() argument must be str, not " + type(s).__name__)
        keep = s[: max(0, self.cap - self.size)]
        self.parts.append(keep)
        self.size += len(keep)
        return len(s)
    def getvalue(self):
        return "".join(self.parts)

def _err(e):
    try:
        text = type(e).__name__ + ": " + str(e)
    except BaseException:
        text = type(e).__name__
    return text[:300]

def _main(spec):
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="replace")
    def report(row):
        out.write(spec["nonce"] + json.dumps(row) + "\n")
        out.flush()
    try:
        code = compile(spec["code"], "solution.py", "exec")
        setup = compile(spec["setup"], "setup.py", "exec")
    except BaseException as e:
        report({"stage": "compile", "error": _err(e)})
        return
    if spec["kind"] == "assert":
        ns = {"__name__": "solution"}
        sys.stdin, sys.stdout = io.StringIO(""), _Sink(spec["cap"])
        try:
            exec(setup, ns)
            exec(code, ns)
        except BaseException as e:
            report({"stage": "load", "error": _err(e)})
            return
        for i, test in enumerate(spec["tests"]):
            try:
                exec(compile(test, "test_%d.py" % i, "exec"), ns)
            except BaseException as e:
                report({"test": i, "ok": False, "error": _err(e)})
            else:
                report({"test": i, "ok": True})
        return
    for i, stdin in enumerate(spec["inputs"]):
        sink, ns, error = _Sink(spec["cap"]), {"__name__": "__main__"}, None
        sys.stdin, sys.stdout = io.StringIO(stdin), sink
        try:
            exec(setup, ns)
            exec(code, ns)
        except SystemExit as e:
            if e.code not in (None, 0):
                error = "SystemExit: %r" % (e.code,)
        except BaseException as e:
            error = _err(e)
        report({"test": i, "stdout": sink.getvalue(), "error": error})
"""


# ---------------------------------------------------------------- tests and code


@dataclass(frozen=True)
class CodeTests:
    """One example's tests: kind "assert" (snippets) or "io" (stdin, expected stdout pairs)."""

    kind: Literal["assert", "io"]
    cases: tuple  # assert: (code, ...); io: ((stdin, stdout), ...)


def normalize_tests(value: Any, where: str) -> CodeTests:
    """An example's tests, in a layout of rewards/code.py's docstring; errors name `where`."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict) and set(value) == {"inputs", "outputs"}:
        ins, outs = value["inputs"], value["outputs"]
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise ValueError(f"{where}: tests 'inputs' / 'outputs' must be lists of equal length")
        value = [{"input": i, "output": o} for i, o in zip(ins, outs)]
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(
            f"{where}: tests must be a non-empty list of assert snippets (str) or of "
            f'{{"input", "output"}} objects, or {{"inputs": [...], "outputs": [...]}}; '
            f"got {type(value).__name__}"
        )
    if all(isinstance(t, str) for t in value):
        return CodeTests("assert", tuple(value))
    cases = []
    for j, t in enumerate(value):
        ok = isinstance(t, dict) and set(t) == {"input", "output"}
        if not ok or not all(isinstance(t[k], str) for k in ("input", "output")):
            raise ValueError(
                f"{where}: test {j} must be a {{'input': str, 'output': str}} object (or every "
                f"test an assert snippet string), got {str(t)[:80]!r}"
            )
        cases.append((t["input"], t["output"]))
    return CodeTests("io", tuple(cases))


def norm_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).strip("\n")


# ---------------------------------------------------------------- one run


def program(code: str, setup: str, tests: CodeTests, nonce: str) -> tuple[str, int]:
    """The harness program for one completion, and the stdout cap that leaves room for its reports."""
    cap = STDOUT_CAP
    spec = {"nonce": nonce, "code": code, "setup": setup, "kind": tests.kind}
    if tests.kind == "assert":
        spec["tests"] = list(tests.cases)
        room = 64 * 1024 + 400 * len(tests.cases)
    else:
        cap = max(cap, 2 * max(len(out) for _, out in tests.cases))
        spec["inputs"] = [stdin for stdin, _ in tests.cases]
        room = 64 * 1024 + len(tests.cases) * (4 * cap + 400)  # JSON may escape each character
    spec["cap"] = cap
    return _HARNESS + f"\n_main(json.loads({json.dumps(spec)!r}))\n", room


def _reports(result: SandboxResult, nonce: str) -> tuple[dict | None, dict[int, dict]]:
    """The harness's stage failure (compile / load) and its per-test reports, by test index."""
    stage, per_test = None, {}
    for line in result.stdout.splitlines():
        if not line.startswith(nonce):
            continue
        try:
            row = json.loads(line[len(nonce) :])
        except ValueError:  # cut by the output cap
            continue
        if isinstance(row, dict) and "stage" in row and stage is None:
            stage = row
        elif isinstance(row, dict) and isinstance(row.get("test"), int):
            per_test.setdefault(row["test"], row)
    return stage, per_test


def judge(result: SandboxResult, nonce: str, tests: CodeTests) -> tuple[int, str, str]:
    """(tests passed, outcome, detail) of one sandbox run."""
    stage, per_test = _reports(result, nonce)
    passed, errors = 0, []
    for i, case in enumerate(tests.cases):
        row = per_test.get(i)
        if row is None:
            continue
        if tests.kind == "assert":
            passed += row.get("ok") is True
            err = row.get("error") or ""
            if not row.get("ok") and not err.startswith("AssertionError"):
                errors.append(err)
        elif row.get("error"):
            errors.append(str(row["error"]))
        else:
            passed += norm_output(str(row.get("stdout", ""))) == norm_output(case[1])
    if result.reason != "ok":  # the process died: its reason wins
        return passed, result.reason, result.stderr[-300:]
    if stage is not None:
        err = str(stage.get("error", ""))
        kind = "syntax_error" if stage.get("stage") == "compile" else "runtime_error"
        return passed, ("memory" if err.startswith("MemoryError") else kind), err
    if len(per_test) < len(tests.cases):  # exited 0 before reporting every test (os._exit(0))
        return passed, "error", f"{len(per_test)} of {len(tests.cases)} tests reported"
    if errors:
        memory = any(e.startswith("MemoryError") for e in errors)
        return passed, "memory" if memory else "runtime_error", errors[0]
    return passed, "passed" if passed == len(tests.cases) else "failed", ""
