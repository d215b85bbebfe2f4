"""The `code` task and the code-execution reward: extraction, test layouts, outcomes, hostile code.

Every reward call here runs real sandboxed processes (grouprl.envs.sandbox.run_python); timeouts
are short so the file stays fast.
"""

from __future__ import annotations

import json
import logging
import math
import os

import pytest

from grouprl.envs.rewards import build_reward, score_completions
from grouprl.envs.rewards.code import OUTCOMES, code_reward, extract_code
from grouprl.envs.rewards.code_harness import CodeTests, norm_output, normalize_tests
from grouprl.envs.tasks import build_task
from grouprl.envs.tasks.code import SYNTHETIC

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-4, 4) == 0", "assert add(10, 5) == 15"]
SUM_IO = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -3\n", "output": "7\n"}]


def fenced(code: str, tag: str = "python") -> str:
    return f"Here you go:\n```{tag}\n{code}\n```\nDone."


def score(reward, completions, tests, **columns):
    """Reward values and the outcome counts of one batched call."""
    values = reward(completions, tests=[tests] * len(completions), **columns)
    counts = {k.removeprefix("code/"): v for k, v in reward.pop_metrics().items() if v}
    return values, counts


@pytest.fixture
def reward():
    return code_reward(timeout_s=2.0, memory_mb=256, workers=4)


# ---- extraction and test layouts ----------------------------------------------------------------


def test_extract_code_prefers_the_last_python_block():
    text = "```python\nx = 1\n```\nthen\n```py\nx = 2\n```\n```bash\nls\n```"
    assert extract_code(text) == "x = 2"
    assert extract_code("```\ny = 3\n```") == "y = 3"  # untagged block when no python block
    assert extract_code("```bash\nls\n```\nprint(1)") == "```bash\nls\n```\nprint(1)"  # raw
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # unclosed
    assert extract_code("  print(4)  \n") == "print(4)"
    assert extract_code("print(4)", "block") == ""  # "block" never falls back to the raw text
    assert extract_code("```Python3 title\nz = 5\n```", "block") == "z = 5"
    with pytest.raises(KeyError):
        extract_code("x", "nope")


def test_normalize_tests_layouts_and_errors():
    assert normalize_tests(ADD_TESTS, "t") == CodeTests("assert", tuple(ADD_TESTS))
    assert normalize_tests("assert f()", "t") == CodeTests("assert", ("assert f()",))
    io = CodeTests("io", (("1 2\n", "3\n"), ("10 -3\n", "7\n")))
    assert normalize_tests(SUM_IO, "t") == io
    assert normalize_tests({"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]}, "t") == io
    for bad, match in [
        ([], "non-empty list"),
        (None, "got NoneType"),
        ({"inputs": ["1"], "outputs": []}, "equal length"),
        ([{"input": "1"}], "test 0 must be"),
        (["assert 1", {"input": "1", "output": "1"}], "test 0 must be"),
        ([{"input": 1, "output": "1"}], "test 0 must be"),
    ]:
        with pytest.raises(ValueError, match=match) as info:
            normalize_tests(bad, "row 7")
        assert "row 7" in str(info.value)


def test_output_normalisation():
    assert norm_output("3  \n\n") == norm_output("\n3") == "3"
    assert norm_output("a \nb\t\n") == "a\nb"
    assert norm_output("a\n\nb") != norm_output("a\nb")  # inner blank lines count


# ---- scoring ------------------------------------------------------------------------------------


def test_reference_solutions_of_the_synthetic_set_pass(reward):
    completions = [fenced(solution) for _, _, solution in SYNTHETIC]
    values = reward(completions, tests=[t for _, t, _ in SYNTHETIC])
    assert values == [1.0] * len(SYNTHETIC)
    assert reward.pop_metrics()["code/passed"] == len(SYNTHETIC)


def test_partial_credit_and_all_mode(reward):
    wrong = fenced("def add(a, b):\n    return a * b")  # 2, -16, 50: no test passes
    lucky = fenced("def add(a, b):\n    return a + b if a > 0 else 0")  # right on all three tests
    values, counts = score(reward, [wrong, lucky], ADD_TESTS)
    assert values == [0.0, 1.0] and counts == {"runs": 2, "failed": 1, "passed": 1}
    off_by_one = fenced("def add(a, b):\n    return a + b + (a == 10)")
    values, counts = score(reward, [off_by_one], ADD_TESTS)
    assert values == [pytest.approx(2 / 3)] and counts == {"runs": 1, "failed": 1}
    strict = code_reward(mode="all", timeout_s=2.0)
    assert strict([off_by_one, lucky], tests=[ADD_TESTS] * 2) == [0.0, 1.0]


def test_io_tests_compare_stdout_in_the_parent(reward):
    right = "a, b = map(int, input().split())\nprint(a + b)   "
    trailing = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b, end='  \\n\\n')"
    wrong = "print(3)"
    exits = "import sys\nprint(3)\nsys.exit(0)"  # exit 0 after printing is a normal end
    crash = "a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(2)"
    values, counts = score(reward, [right, trailing, wrong, exits, crash], SUM_IO)
    assert values == [1.0, 1.0, 0.5, 0.5, 0.0]
    assert counts == {"runs": 5, "passed": 2, "failed": 2, "runtime_error": 1}


def test_setup_code_runs_before_the_solution(reward):
    tests = ["assert scaled(2) == 20"]
    solution = fenced("def scaled(x):\n    return FACTOR * x")
    assert reward([solution], tests=[tests], setup_code=["FACTOR = 10"]) == [1.0]
    assert reward([solution], tests=[tests], setup_code=[""]) == [0.0]


@pytest.mark.parametrize(
    "code, outcome, value",
    [
        ("no code at all, just prose", "syntax_error", 0.0),
        ("def add(a, b) return a + b", "syntax_error", 0.0),
        ("def add(a, b):\n    return a + b\nraise ValueError('at import')", "runtime_error", 0.0),
        ("def add(a, b):\n    return a + undefined_name", "runtime_error", 0.0),
        ("import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b", "runtime_error", 0.0),
        ("import os\nos._exit(0)", "error", 0.0),  # quits before any test reports
        ("import os\ndef add(a, b):\n    os._exit(3)", "error", 0.0),
        ("def add(a, b):\n    return a + b\nx = bytearray(1 << 30)", "memory", 0.0),
        ("def add(a, b):\n    return [0] * 10**9", "memory", 0.0),
        # the first test passes, then the solution hangs: the reported test keeps its credit
        ("def add(a, b):\n    while a < 0:\n        pass\n    return a + b", "timeout", 1 / 3),
    ],
)
def test_failure_outcomes_are_counted(code, outcome, value):
    reward = code_reward(timeout_s=1.0, memory_mb=256, code_from="block_or_raw")
    values, counts = score(reward, [code], ADD_TESTS)
    assert values == [pytest.approx(value)]
    assert counts == {"runs": 1, outcome: 1}


def test_no_code_outcome_and_metric_keys():
    reward = code_reward(code_from="block", timeout_s=1.0)
    values, counts = score(reward, ["I would use a loop.", "```python\n\n```"], ADD_TESTS)
    assert values == [0.0, 0.0] and counts == {"runs": 2, "no_code": 2}
    assert set(reward.pop_metrics()) == {f"code/{k}" for k in ("runs", *OUTCOMES)}
    assert all(v == 0 for v in reward.pop_metrics().values())  # popped: reset


def test_failures_are_logged(reward, caplog):
    with caplog.at_level(logging.INFO, logger="grouprl.envs.rewards.code"):
        score(reward, ["while True: pass", fenced("def add(a, b):\n    return a + b")], ADD_TESTS)
    text = caplog.text
    assert "sample 0: timeout" in text and "1 of 2 runs failed: timeout 1" in text


def test_bad_options_and_columns_fail_clearly():
    with pytest.raises(ValueError, match=r"mode='most'.*\['fraction', 'all'\]"):
        code_reward(mode="most")
    with pytest.raises(ValueError, match="timeout_s > 0"):
        code_reward(timeout_s=0)
    reward = code_reward(timeout_s=1.0)
    with pytest.raises(KeyError, match="needs the column 'tests'"):
        reward(["x"], answer=["1"])
    with pytest.raises(ValueError, match="sample 1.*non-empty list"):
        reward(["x", "y"], tests=[ADD_TESTS, []])
    # through score_completions a malformed sample costs that sample only (NaN, counted)
    rewards, errors = score_completions(
        {"code": reward}, [fenced("def add(a, b):\n    return a + b")] * 2,
        [{"prompt": "p", "tests": ADD_TESTS}, {"prompt": "p", "tests": 42}],
    )  # fmt: skip
    assert rewards["code"][0] == 1.0 and math.isnan(rewards["code"][1]) and errors == {"code": 1}


# ---- hostile completions: each contained, scored 0, and the test process goes on -----------------

HOSTILE = {
    "infinite_loop": "while True:\n    pass",
    "fork_storm": "import os\nfor _ in range(10_000):\n    os.fork()",
    "huge_allocation": "x = bytearray(8 * 1024**3)",
    "write_outside": "open({target!r}, 'w').write('pwned')",
    "read_secret_env": "import os\nprint(os.environ.get('GROUPRL_FAKE_SECRET'))\n"
    "def add(a, b):\n    raise SystemExit(os.environ.get('GROUPRL_FAKE_SECRET', 'none'))",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', {port}), 1).send(b'hi')",
    "megabytes_of_output": "import os, sys\nsys.stdout.write('x' * 5_000_000)\n"
    "os.write(1, b'y' * 5_000_000)\nos.write(2, b'z' * 5_000_000)",
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "kill_group": "import os, signal\nos.kill(0, signal.SIGKILL)",
}


def test_hostile_completions_score_zero_and_are_contained(
    tmp_path, monkeypatch, reliability_counts
):
    import socket

    monkeypatch.setenv("GROUPRL_FAKE_SECRET", "hunter2-0c7f")
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    target = tmp_path / "pwned.txt"
    snippets = {
        k: v.format(target=str(target), port=server.getsockname()[1]) for k, v in HOSTILE.items()
    }
    reward = code_reward(timeout_s=1.0, memory_mb=256, workers=3)
    names = sorted(snippets)
    values = reward([fenced(snippets[k]) for k in names], tests=[ADD_TESTS] * len(names))
    counts = reward.pop_metrics()
    reliability_counts["code reward hostile snippets tried"] = len(names)
    contained = [k for k, v in zip(names, values) if v == 0.0]
    reliability_counts["code reward hostile snippets contained (score 0)"] = len(contained)
    assert contained == names
    assert counts["code/runs"] == len(names) and counts["code/passed"] == 0
    assert counts["code/timeout"] >= 1 and counts["code/memory"] >= 1
    assert not target.exists()
    with pytest.raises(TimeoutError):
        server.accept()  # nobody connected
    server.close()
    # and the process that scored them is alive and still scores correct code
    assert reward([fenced("def add(a, b):\n    return a + b")], tests=[ADD_TESTS]) == [1.0]
    assert os.getpid() > 0


# ---- the task -----------------------------------------------------------------------------------


def test_synthetic_task_builds_with_an_eval_split():
    task = build_task("code", eval_fraction=0.3, seed=1, timeout_s=1.0)
    assert len(task.train) == 7 and len(task.eval) == 3
    assert list(task.reward_fns) == ["code"] and task.default_reward_weights == {"code": 1.0}
    questions = {ex["question"] for ex in task.train} | {ex["question"] for ex in task.eval}
    assert len(questions) == len(SYNTHETIC)
    ex = next(e for e in task.train + task.eval if "add(a, b)" in e["question"])
    assert ex["prompt"] == (
        "Write a function add(a, b) that returns the sum of two integers.\n"
        "Your code should pass this test:\nassert add(1, 2) == 3\n"
        "Write your solution in a ```python code block."
    )
    io_ex = next(e for e in task.train + task.eval if "reverse order" in e["question"])
    assert "Example input:\na b c\nExample output:\nc b a" in io_ex["prompt"]
    assert set(ex) == {"prompt", "question", "tests", "setup_code", "solution"}


def test_jsonl_source_mbpp_layout(tmp_path):
    rows = [
        {"task_id": 1, "text": "Return x doubled.", "test_list": ["assert double(2) == 4"],
         "test_setup_code": "", "code": "def double(x): return 2 * x"},
        {"task_id": 2, "text": "Return PI.", "test_list": ["assert pi() == BIG"],
         "test_setup_code": "BIG = 3", "truncated": True},  # a reserved name stays out of examples
    ]  # fmt: skip
    path = tmp_path / "mbpp.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = build_task(
        "code", source=str(path), question_column="text", tests_column="test_list",
        setup_column="test_setup_code", system_prompt="You write Python.", timeout_s=1.0,
    )  # fmt: skip
    assert [e["setup_code"] for e in task.train] == ["", "BIG = 3"]
    assert task.train[0]["prompt"][0] == {"role": "system", "content": "You write Python."}
    assert "truncated" not in task.train[1]
    rewards, errors = score_completions(
        task.reward_fns,
        [fenced("def double(x):\n    return x + x"), fenced("def pi():\n    return BIG")],
        task.train,
        extra={"truncated": [False, False], "max_new_tokens": 8},
    )
    assert rewards["code"].tolist() == [1.0, 1.0] and errors == {"code": 0}


@pytest.mark.parametrize(
    "rows, options, match",
    [
        ([{"question": "q", "tests": ["assert 1"]}], {"tests_column": "test_list"},
         r"column 'test_list' is not in .*columns: \['question', 'tests'\]"),
        ([{"question": "q", "tests": ["assert 1"]}, {"question": "", "tests": ["assert 1"]}], {},
         "row 1 .*'question' must be a non-empty string"),
        ([{"question": "q", "tests": 5}], {}, "row 0 .*column 'tests'.*non-empty list"),
        ([{"question": "q", "tests": ["a"], "setup": 3}], {"setup_column": "setup"},
         "row 0 .*'setup' must be a string"),
    ],
)  # fmt: skip
def test_loading_errors_name_the_row_and_column(tmp_path, rows, options, match):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=match):
        build_task("code", source=str(path), **options)


def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_task("code", source=str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        build_task("code", source=str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match=r"placeholders \['answer'\]"):
        build_task("code", prompt_template="{question} {answer}")


def test_code_reward_is_a_registered_reward():
    reward = build_reward("code", mode="all", timeout_s=1.0)
    assert reward([fenced("def add(a, b):\n    return a + b")], tests=[ADD_TESTS]) == [1.0]


# ---- a run ----------------------------------------------------------------------------------------


def test_training_on_the_code_task_logs_outcomes(tmp_path, tiny_model_dir):
    from grouprl.config.loading import validate
    from grouprl.train import train

    cfg = validate({
        "run": {"name": "code", "output_dir": str(tmp_path), "device": "cpu", "console": False},
        "model": {"name_or_path": str(tiny_model_dir)},
        "task": {"name": "code", "options": {"eval_fraction": 0.2, "timeout_s": 1.0}},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8},
        "train": {"steps": 1, "lr": 1e-3},
    })  # fmt: skip
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "code" / "metrics.jsonl").open()]
    (step,) = [r for r in rows if r["split"] == "train"]
    assert step["code/runs"] == 4 and step["reward/code"] == 0.0  # random weights write no code
    assert sum(step[f"code/{k}"] for k in OUTCOMES) == 4
