"""Safe run directories (issue 14 item 8) and the command line's handling of user code that exits
or crashes (issue 15): the run directory is touched only after everything is built; resume refuses
a changed config unless allowed (and records it); presets that cannot apply say so; a saved
config.yaml re-resolves under another preset; a missing local model path is one clear error;
`module:function` rewards resolve from the working directory; a reward's SystemExit or segfault
ends the run with a message naming it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tiny_runs import arithmetic_run

from grouprl.config.loading import load_config, validate
from grouprl.runtime.checkpoint import CheckpointManager
from grouprl.runtime.run_state import CHANGES_FILE, ConfigChangedError
from grouprl.runtime.user_inputs import ModelPathError, check_model_path
from grouprl.train import train

ROOT = Path(__file__).resolve().parents[1]


def _raw(out_dir, model_dir, *overrides):
    return arithmetic_run(out_dir, model_dir, *overrides, checkpoint={"every": 1})


def _cfg(out_dir, model_dir, *overrides):
    return validate(_raw(out_dir, model_dir, *overrides))


def test_a_typo_with_overwrite_leaves_the_old_run_intact(tmp_path, tiny_model_dir):
    train(_cfg(tmp_path, tiny_model_dir))
    run_dir = tmp_path / "run"
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match="n_trian"):
        train(_cfg(tmp_path, tiny_model_dir, "run.overwrite=true", "task.options.n_trian=8"))
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert CheckpointManager(run_dir).latest().name == "step-00000001"
    # a model that cannot be built does not cost the run either
    with pytest.raises(ModelPathError):
        train(_cfg(tmp_path, tmp_path / "no-model", "run.overwrite=true"))
    assert CheckpointManager(run_dir).latest().name == "step-00000001"
    # once everything builds, overwrite starts afresh
    train(_cfg(tmp_path, tiny_model_dir, "run.overwrite=true", "train.steps=2"))
    assert CheckpointManager(run_dir).latest().name == "step-00000002"


def test_resume_refuses_a_changed_config_unless_allowed_and_records_the_change(
    tmp_path, tiny_model_dir
):
    train(_cfg(tmp_path, tiny_model_dir))
    run_dir = tmp_path / "run"
    with pytest.raises(
        ConfigChangedError, match=r"train\.lr: 0\.001 -> 0\.01.*allow_config_change"
    ):
        train(_cfg(tmp_path, tiny_model_dir, "run.resume=true", "train.lr=1e-2", "train.steps=2"))
    assert not (run_dir / CHANGES_FILE).exists()
    assert CheckpointManager(run_dir).latest().name == "step-00000001"  # nothing ran
    # train.steps alone is exempt (continuing a run), and recorded
    train(_cfg(tmp_path, tiny_model_dir, "run.resume=true", "train.steps=2"))
    first = json.loads((run_dir / CHANGES_FILE).read_text().splitlines()[0])
    assert first["changes"] == {"train.steps": [1, 2]} and first["exempt"] == ["train.steps"]
    train(_cfg(tmp_path, tiny_model_dir, "run.resume=true", "train.steps=3",
               "train.lr=1e-2", "run.allow_config_change=true"))  # fmt: skip
    last = json.loads((run_dir / CHANGES_FILE).read_text().splitlines()[-1])
    assert last["changes"]["train.lr"] == [1e-3, 1e-2] and "train.lr" not in last["exempt"]
    assert CheckpointManager(run_dir).latest().name == "step-00000003"
    resolved = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    assert resolved["train"]["lr"] == 1e-2  # the config the run continues with


def test_a_blocked_preset_warns_naming_the_keys():
    raw = {"workload": {"type": "text"}, "model": {"name_or_path": "x"},
           "task": {"name": "arithmetic"}, "algorithm": {"preset": "two_grpo"},
           "rollout": {"group_size": 8}}  # fmt: skip
    with pytest.warns(UserWarning, match=r"two_grpo.*rollout\.group_size=8 \(the preset's: 2\)"):
        cfg = validate(raw)
    assert cfg.rollout.group_size == 8  # the user's value is kept
    raw["rollout"]["group_size"] = 2  # the same value: nothing is blocked, no warning
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate(raw)


def test_a_saved_config_reused_with_another_preset_runs_that_preset(tmp_path, tiny_model_dir):
    """`grouprl train runs/x/config.yaml algorithm.preset=dapo` runs DAPO, not GRPO renamed."""
    first = _cfg(tmp_path, tiny_model_dir)
    train(first)
    saved = tmp_path / "run" / "config.yaml"
    cfg = load_config(saved, ["algorithm.preset=dapo", "run.name=again"])
    dapo = validate({"model": {"name_or_path": "x"}, "task": {"name": "arithmetic"},
                     "algorithm": {"preset": "dapo"}}).algorithm  # fmt: skip
    assert cfg.algorithm == dapo  # every DAPO setting, none of GRPO's
    assert (
        cfg.algorithm.dynamic_sampling == "zero_variance"
        and cfg.algorithm.surrogate.eps_high == 0.28
    )
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "again" / "metrics.jsonl").read_text().splitlines()]
    assert any("dynamic/rounds" in r for r in rows)  # DAPO's dynamic sampling ran
    # the resolved record of the first run still says what it ran
    resolved = yaml.safe_load((tmp_path / "run" / "config.resolved.yaml").read_text())
    assert resolved["algorithm"]["preset"] == "grpo"
    assert resolved["algorithm"]["dynamic_sampling"] == "off"


@pytest.mark.parametrize("kind", ["causal_lm", "flow", "unet"])
@pytest.mark.parametrize(
    "path", ["./does/not/exist", "/nonexistent/model", "~/nope/model", "a/b/c"]
)
def test_a_missing_local_model_path_is_one_clear_error(kind, path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = validate({"model": {"type": kind, "name_or_path": path}, "task": {"name": "arithmetic"},
                    "run": {"output_dir": str(tmp_path)}})  # fmt: skip
    with pytest.raises(ModelPathError, match=r"model\.name_or_path=.*does not exist"):
        train(cfg)
    assert not (tmp_path / "run").exists()
    check_model_path(
        validate(
            {"model": {"name_or_path": "Qwen/Qwen2.5-0.5B"}, "task": {"name": "arithmetic"}}
        ).model
    )  # a hub id: no check
    check_model_path(
        validate(
            {
                "model": {"type": "flow", "name_or_path": "my.mod:Net"},
                "task": {"name": "arithmetic"},
            }
        ).model
    )  # a user module: no check


# ---- the command line, as a user runs it -----------------------------------------------------

USER_REWARDS = '''
import ctypes
import os
import sys
import time


def score(completions, **_):
    return [float(len(c) % 2) for c in completions]


def exits(completions, **_):
    sys.exit(0)


def crashes(completions, **_):
    ctypes.string_at(0)  # reads address 0: SIGSEGV in this process


def slow(completions, **_):
    open("started", "w").close()
    time.sleep(0.5)
    return [0.0] * len(completions)


def spawns(completions, **_):
    """Double fork + setsid: a sleeper in its own session, which a per-process kill misses."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            with open("sleeper.pid", "w") as f:
                f.write(str(os.getpid()))
            time.sleep(300)
        os._exit(0)
    os.waitpid(pid, 0)
    return [0.5] * len(completions)
'''


def _cli(tmp_path, tiny_model_dir, reward, *overrides, timeout=240, interrupt=False,
         **reward_fields):  # fmt: skip
    """Run the command line in a fresh interpreter from tmp_path/work, as the `grouprl` console
    script does: sys.path[0] is the script's own folder, not the working directory. interrupt:
    send SIGINT (Ctrl-C) once the reward has started."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "myrewards.py").write_text(USER_REWARDS)
    raw = _raw(tmp_path / "runs", tiny_model_dir)
    raw["rewards"] = [{"name": f"myrewards:{reward}", **reward_fields}]
    (work / "cfg.yaml").write_text(yaml.safe_dump(raw))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "grouprl_script.py").write_text(
        "import sys\nfrom grouprl.cli import main\nsys.exit(main())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("GROUPRL_DEBUG", None)
    cmd = [sys.executable, str(bin_dir / "grouprl_script.py"), "train", "cfg.yaml", *overrides]
    if not interrupt:
        return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    # a terminal's Ctrl-C reaches a trainer whose SIGINT is not ignored; a test run launched as a
    # background job (`cmd &` in a script) ignores SIGINT and its children inherit that, so the
    # child gets the default disposition back, as a foreground `grouprl train` has it
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.monotonic() + timeout
    while not (work / "started").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_cli_resolves_module_function_rewards_from_the_working_directory(tmp_path, tiny_model_dir):
    done = _cli(tmp_path, tiny_model_dir, "score")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = (tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines()
    assert any("reward/score" in json.loads(r) for r in rows)


def test_cli_a_reward_calling_sys_exit_0_is_an_error_exit_naming_it(tmp_path, tiny_model_dir):
    """SystemExit from a reward is that sample's error (the trainer goes on); a reward that fails
    on every sample for rewards[i].max_failed_steps steps stops the run with its name and error."""
    done = _cli(tmp_path, tiny_model_dir, "exits", max_failed_steps=1)
    assert done.returncode != 0, "SystemExit(0) from a reward ended the run as a success"
    assert "SystemExit" in done.stderr and "exits" in done.stderr, done.stderr[-3000:]


def test_cli_ctrl_c_still_stops_the_trainer(tmp_path, tiny_model_dir):
    done = _cli(tmp_path, tiny_model_dir, "slow", "train.steps=50", interrupt=True)
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr, done.stderr[-2000:]
    assert "UserCodeExit" not in done.stderr


def test_cli_a_segfaulting_reward_ends_the_run_with_a_message_naming_it(tmp_path, tiny_model_dir):
    done = _cli(tmp_path, tiny_model_dir, "crashes")
    assert done.returncode != 0
    assert "Segmentation fault" in done.stderr, done.stderr[-3000:]
    assert "myrewards.py" in done.stderr and "crashes" in done.stderr


def test_setsid_grandchildren_of_an_isolated_reward_do_not_outlive_the_run(
    tmp_path, tiny_model_dir
):
    done = _cli(tmp_path, tiny_model_dir, "spawns", timeout_s=30)
    assert done.returncode == 0, done.stderr[-3000:]
    pid = int((tmp_path / "work" / "sleeper.pid").read_text())
    assert not _alive(pid), f"the reward's setsid grandchild {pid} outlived the run"


def _alive(pid: int) -> bool:
    """Running (a zombie, killed and waiting for a parent to reap it, counts as dead)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    state = next(x for x in status.splitlines() if x.startswith("State:"))
    if "Z" in state.split()[1]:
        return False
    return True
