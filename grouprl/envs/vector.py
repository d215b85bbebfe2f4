"""Vector execution: the live episodes of a batch reset and step together, not one after another.

A multi-turn rollout generates one turn for every live episode in one batched engine call; the env
side then has N steps to run. How they run (config `agent.env_execution`, option strings):

  "sequential"  in this process, one after another. Cheapest for small pure-Python envs
                (FrozenLake, Sokoban-lite: microseconds a step), so it is the default.
  "threads"     a pool of `agent.env_workers` threads runs the steps at once. Pays when a step
                waits rather than computes: a sandboxed tool call (ToolMath runs a subprocess), a
                remote simulator, or envs that live in their own process (env_step_timeout_s).
  "processes"   every env lives in its own forked process (as with env_step_timeout_s, see
                runtime/env_guard.py) and the thread pool drives them, so CPU-bound Python envs
                step in parallel on several cores; a crash or hang costs only its episode.

gymnasium's own vector envs (SyncVectorEnv / AsyncVectorEnv) are not used: they step every
sub-env on every call and reset finished ones automatically (or leave that to a mask), while
episodes here end at different turns and a finished env must never be stepped again. Results
always come back in the order of the envs given, whatever the mode, so a rollout is the same
in every mode for the same seeds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

EnvExecution = Literal["sequential", "threads", "processes"]
ENV_EXECUTIONS: tuple[str, ...] = ("sequential", "threads", "processes")


class VectorRunner:
    """Runs one method on many envs at once; a context manager that owns its thread pool."""

    def __init__(self, mode: EnvExecution = "sequential", workers: int = 8) -> None:
        if mode not in ENV_EXECUTIONS:
            raise ValueError(f"env_execution must be one of {ENV_EXECUTIONS}, got {mode!r}")
        if workers < 1:
            raise ValueError(f"env_workers must be >= 1, got {workers}")
        self.mode, self.workers = mode, workers
        self._pool: ThreadPoolExecutor | None = None

    @property
    def own_process(self) -> bool:
        """Whether each env should be made in its own process."""
        return self.mode == "processes"

    def __enter__(self) -> VectorRunner:
        if self.mode != "sequential":
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="grouprl-env")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def map(self, fn: Callable[[Any, Any], Any], envs: Sequence[Any], args: Sequence[Any]) -> list:
        """[fn(env, arg) for each pair], run per the mode; results in input order. The first
        exception (in input order) is re-raised after every call has finished."""
        if len(envs) != len(args):
            raise ValueError(f"{len(envs)} envs but {len(args)} arguments")
        if self._pool is None or len(envs) < 2:
            return [fn(env, arg) for env, arg in zip(envs, args)]
        futures = [self._pool.submit(fn, env, arg) for env, arg in zip(envs, args)]
        return [f.result() for f in futures]

    def step(self, envs: Sequence[Any], actions: Sequence[str]) -> list[tuple]:
        """env.step(action) for every pair: [(obs, reward, terminated, truncated, info)]."""
        return self.map(lambda env, action: env.step(action), envs, actions)

    def reset(self, envs: Sequence[Any], seeds: Sequence[int]) -> list[tuple]:
        """env.reset(seed=seed) for every pair: [(obs, info)]."""
        return self.map(lambda env, seed: env.reset(seed=seed), envs, seeds)
