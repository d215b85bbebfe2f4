"""Processes that user code starts in a reward / env worker, setsid daemons included, end with the
worker (grouprl/runtime/process_tree.py). The end-to-end check through `grouprl train` is in
test_run_dir.py; these call the isolation wrappers directly."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from daemons import spawn_daemon

from grouprl.runtime.env_guard import GuardedEnv
from grouprl.runtime.process_tree import descendants, kill_tree
from grouprl.runtime.reward_guard import IsolatedReward

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def _alive(pid: int) -> bool:
    try:
        state = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if x.startswith("State:"))  # fmt: skip
    except FileNotFoundError:
        return False
    return "Z" not in state.split()[1]  # a zombie is dead, waiting to be reaped


def test_an_isolated_rewards_daemon_ends_with_close(tmp_path):
    pid_file = tmp_path / "daemon.pid"

    def reward(completions, **_):
        spawn_daemon(pid_file)
        return [1.0] * len(completions)

    fn = IsolatedReward(reward, "spawner", timeout_s=30)
    assert fn(["a"]) == [1.0]
    daemon = int(pid_file.read_text())
    assert _alive(daemon) and daemon in descendants(fn._pool[0].pid)  # kept in the tree
    fn.close()
    assert not _alive(daemon)


def test_a_daemon_of_a_reward_past_its_deadline_ends_with_its_worker(tmp_path):
    pid_file = tmp_path / "daemon.pid"

    def reward(completions, **_):
        spawn_daemon(pid_file)
        time.sleep(60)

    fn = IsolatedReward(reward, "hangs", timeout_s=1.5)
    assert fn(["a"]) == [None]  # timed out: the worker was killed and replaced
    assert not _alive(int(pid_file.read_text()))
    fn.close()


class _SpawningEnv:
    def __init__(self, pid_file: Path) -> None:
        self.pid_file = pid_file

    def reset(self, seed=None, options=None):
        return "start", {}

    def step(self, action):
        spawn_daemon(self.pid_file)
        return "obs", 0.0, False, False, {}


def test_an_env_processs_daemon_ends_with_close(tmp_path):
    pid_file = tmp_path / "daemon.pid"
    env = GuardedEnv(lambda: _SpawningEnv(pid_file), timeout_s=30, fail_fast=True)
    env.reset(seed=0)
    env.step("go")
    daemon = int(pid_file.read_text())
    assert _alive(daemon)
    env.close()
    assert not _alive(daemon)


def test_kill_tree_kills_a_whole_tree_and_nothing_else(tmp_path):
    pid_file = tmp_path / "daemon.pid"
    outsider = os.fork()
    if outsider == 0:
        time.sleep(300)
        os._exit(0)
    root = os.fork()
    if root == 0:
        from grouprl.runtime.process_tree import become_subreaper

        become_subreaper()
        spawn_daemon(pid_file)
        time.sleep(300)
        os._exit(0)
    try:
        for _ in range(500):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.01)
        daemon = int(pid_file.read_text())
        assert daemon in descendants(root)
        kill_tree(root)
        os.waitpid(root, 0)
        assert not _alive(daemon) and _alive(outsider)
    finally:
        os.kill(outsider, 9)
        os.waitpid(outsider, 0)
