"""Stopping a run on non-finite steps: an update whose loss or gradient is NaN / inf is skipped
(grouprl/train.py update: the weights stay untouched), and train.max_nonfinite_steps such steps in
a row stop the run with NonFiniteLossError, so checkpoints only ever hold finite values."""

from __future__ import annotations

from typing import Any


class NonFiniteLossError(RuntimeError):
    """train.max_nonfinite_steps steps in a row had a NaN/inf loss or gradient (each such update
    was skipped, so the weights and checkpoints hold finite values only)."""


def check_nonfinite_streak(cfg: Any, logger: Any, step: int, metrics: dict, streak: int) -> int:
    """Count steps in a row with a skipped update; print each; stop the run at the limit."""
    skipped = metrics.get("skipped_nonfinite", 0.0)
    if not skipped:
        return 0
    streak += 1
    limit = cfg.train.max_nonfinite_steps
    what = "loss" if metrics.get("skipped_nonfinite/loss") else "gradient"
    logger.print(
        f"step {step}: non-finite {what}; {int(skipped)} update(s) skipped, weights untouched "
        f"({streak} step(s) in a row, train.max_nonfinite_steps={limit})"
    )
    if streak >= limit:
        raise NonFiniteLossError(
            f"stopping at step {step}: {streak} step(s) in a row had a non-finite {what} "
            f"(train.max_nonfinite_steps={limit}); those updates were skipped and no non-finite "
            "value was saved. Lower train.lr, check the rewards, or use dtype float32"
        )
    return streak
