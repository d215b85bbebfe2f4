"""Collective-aware pieces of grouprl.runtime.distributed.dist: the run directory as every process sees it (the
main process writes; the others keep quiet).
"""

from __future__ import annotations

from typing import Any

from grouprl.runtime.checkpoint import CheckpointManager, NonFiniteCheckpointError, check_all_finite


class SharedCheckpoints:
    """The main process's CheckpointManager as every process sees it: `latest` is the main's
    answer (it alone verifies, and may move a damaged checkpoint aside); `save` writes on the main
    only, after every process has built the state (collectives of sharded backends run there)."""

    def __init__(self, dist: Any, run_dir, keep_last: int | None) -> None:
        self.dist = dist
        self.manager = CheckpointManager(run_dir, keep_last=keep_last) if dist.is_main else None
        self.rejected: list[str] = []

    def latest(self, verify: bool = False):
        found = self.manager.latest(verify=verify) if self.manager else None
        self.rejected = self.manager.rejected if self.manager else []
        return self.dist.broadcast_object(found)

    def save(self, step: int, *, check_finite=None, **kwargs: Any):
        """CheckpointManager.save on the main process. The finite check runs on every process
        over its local shards (sharded backends) and all must pass before anything is written."""
        problem = None
        try:
            check_all_finite(_local(item) for item in check_finite or [])
        except NonFiniteCheckpointError as err:
            problem = str(err)
        problems = [p for p in self.dist.all_gather_object(problem) if p]
        if problems:
            raise NonFiniteCheckpointError(problems[0])
        path = self.manager.save(step, **kwargs) if self.manager else None
        self.dist.barrier()  # nobody reads or resumes a checkpoint the main is still writing
        return path


class NullLogger:
    """RunLogger's interface, writing nothing: the logger of every process but the main one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> NullLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def log(self, step: int, metrics: Any, split: str = "train") -> None:
        pass

    def log_samples(self, step: int, rows: Any) -> None:
        pass

    def print(self, msg: str) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def _local(item: Any) -> Any:
    """A tensor (or a (name, tensor) pair) with a DTensor replaced by this process's shard."""
    if isinstance(item, tuple):
        return item[0], _local(item[1])
    return item.to_local() if hasattr(item, "to_local") else item
