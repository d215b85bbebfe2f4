"""`grouprl list presets|rewards|tasks|workloads|envs` (one name, a TAB, a one-line summary, read
from the registries) and `import grouprl.envs` registering grouprl's gymnasium ids."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grouprl.cli import main, summary_line

ROOT = Path(__file__).resolve().parents[1]


def _listed(capsys, kind: str) -> dict[str, str]:
    assert main(["list", kind]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(line.count("\t") == 1 for line in lines), lines
    return dict(line.split("\t") for line in lines)


def test_list_presets_rewards_tasks_read_the_registries(capsys):
    from grouprl.config.presets import PRESETS
    from grouprl.envs.rewards import REWARDS
    from grouprl.envs.tasks import TASKS

    presets = _listed(capsys, "presets")
    assert list(presets) == list(PRESETS)
    assert presets["dapo"] == " ".join(PRESETS["dapo"].summary.split())
    rewards = _listed(capsys, "rewards")
    assert list(rewards) == list(REWARDS)
    assert rewards["accuracy"] == "Correctness reward, 1.0 / 0.0 per completion."
    tasks = _listed(capsys, "tasks")
    assert list(tasks) == list(TASKS)
    assert tasks["math"].startswith("Math task (e.g. GSM8K")  # "e.g." does not end the sentence
    assert all(tasks.values()) and all(rewards.values()) and all(presets.values())


def test_list_workloads_follows_the_registry(capsys, monkeypatch):
    import grouprl.workloads  # noqa: F401
    from grouprl.workloads import base

    class ToyWorkload:
        """A toy workload for this test. More text that is not the summary."""

        name = "toy"

    monkeypatch.setitem(base.WORKLOADS, "toy", ToyWorkload)
    listed = _listed(capsys, "workloads")
    assert list(listed) == list(base.WORKLOADS)
    assert all(listed.values()) and not any(v.startswith("See the") for v in listed.values())
    assert listed["toy"] == "A toy workload for this test."
    ToyWorkload.summary = "From the summary field."
    assert _listed(capsys, "workloads")["toy"] == "From the summary field."


def test_list_envs_names_the_registered_gymnasium_ids(capsys):
    from grouprl.envs.gym import ENV_IDS

    envs = _listed(capsys, "envs")
    assert set(ENV_IDS) <= set(envs)
    assert envs["grouprl/Sokoban-v0"].startswith("Sokoban-lite as a text env")


def test_unknown_list_kind_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["list", "models"])
    assert exit_.value.code == 2
    assert "invalid choice: 'models'" in capsys.readouterr().err


def test_summary_line_is_the_first_sentence_of_the_first_paragraph():
    def f():
        """First sentence, e.g. this one. Second sentence.

        Body."""

    assert summary_line(f) == "First sentence, e.g. this one."
    assert summary_line(lambda: None) == ""

    class Deferring:
        """See the module docstring. Details."""

    assert summary_line(Deferring) == summary_line(sys.modules[__name__])
    assert summary_line(Deferring).startswith("`grouprl list presets|rewards|tasks|workloads|envs`")


def test_importing_grouprl_envs_registers_the_gymnasium_ids():
    """A fresh interpreter: `import grouprl.envs` alone makes the ids usable, and loads no policy.
    grouprl's own __init__ (the Python API, which imports everything) is bypassed, so that what is
    measured is grouprl.envs' own imports."""
    code = (
        "import sys, types\n"
        "root = types.ModuleType('grouprl'); root.__path__ = [sys.argv[1]]\n"
        "sys.modules['grouprl'] = root  # the package without its __init__\n"
        "import gymnasium\n"
        "assert 'grouprl/FrozenLake-v0' not in gymnasium.registry\n"
        "import grouprl.envs\n"
        "env = gymnasium.make('grouprl/FrozenLake-v0')\n"
        "obs, info = env.reset(seed=0)\n"
        "assert isinstance(obs, str) and obs, obs\n"
        "assert 'grouprl/Sokoban-v0' in gymnasium.registry\n"
        "loaded = [m for m in sys.modules if m.startswith(('grouprl.policies', 'grouprl.train'))]\n"
        "assert not loaded, loaded\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "grouprl")], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_listing_whose_reader_left_ends_quietly():
    """`grouprl list presets | head -1`: here the reader (`true`) is gone before the listing is
    written, so every write meets a closed pipe."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        f"{sys.executable} -m grouprl list presets | true; echo ${{PIPESTATUS[0]}}",
        shell=True, executable="/bin/bash", capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=120,
    )  # fmt: skip
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.stdout.strip() == "0"


@pytest.mark.parametrize("name", ["reward_model", "llm_judge", "http"])
def test_model_based_rewards_list_every_option_in_their_docstring(capsys, name):
    import inspect

    from grouprl.envs.rewards import REWARDS

    factory = REWARDS[name]
    doc = inspect.getdoc(factory)
    listed = [line.split(":")[0] for line in doc.split("Options:\n", 1)[1].splitlines() if line]
    assert listed == list(inspect.signature(factory).parameters)
    assert _listed(capsys, "rewards")[name] == summary_line(factory)
