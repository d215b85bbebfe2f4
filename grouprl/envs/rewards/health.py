"""Reward health across steps: a reward that fails on every sample of a step is reported, and
after `rewards[i].max_failed_steps` such steps in a row the run stops.

Without this, a reward that raises on every sample (e.g. a TRL-style function called the wrong
way) gives NaN rewards, zero advantages and grad_norm 0: the run "succeeds" and learns nothing.
`RewardHealth.observe` is called once per step with the step's failure counts (in-process
failures from score_completions plus the isolated rewards' reward_errors / reward_timeouts) and
the number of samples scored; it warns with the reward's name and its first error (the last line
of the traceback), and raises RewardFailedError at the limit. A step where the reward works on
at least one sample resets its count.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

DEFAULT_MAX_FAILED_STEPS = 3


class RewardFailedError(RuntimeError):
    """A reward function failed on every sample for max_failed_steps steps in a row."""


class RewardFailedWarning(RuntimeWarning):
    """A reward function failed on every sample of one step."""


class RewardHealth:
    """Consecutive all-failed steps per reward name; limits: name -> max_failed_steps."""

    def __init__(self, limits: Mapping[str, int]) -> None:
        for name, limit in limits.items():
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ValueError(f"reward {name!r}: max_failed_steps must be >= 1, got {limit!r}")
        self.limits = dict(limits)
        self.streak = {name: 0 for name in limits}

    def observe(
        self, step: int, failures: Mapping[str, float], scored: int, first_errors: Mapping[str, str]
    ) -> None:
        """failures: name -> samples failed this step; scored: samples each reward saw."""
        for name, limit in self.limits.items():
            failed = failures.get(name, 0.0)
            if scored == 0 or failed < scored:
                self.streak[name] = 0
                continue
            self.streak[name] += 1
            first = first_errors.get(name, "no error text was recorded")
            what = (
                f"reward {name!r} failed on all {scored} samples of step {step} "
                f"({self.streak[name]} such step(s) in a row, limit max_failed_steps={limit}); "
                f"first error: {first}"
            )
            if self.streak[name] >= limit:
                raise RewardFailedError(
                    what + ". The run stops: with every reward NaN nothing is learned. Fix the "
                    "function (reward functions are called with keyword arguments, e.g. "
                    "def f(completions, **kwargs)) or raise rewards[i].max_failed_steps."
                )
            warnings.warn(what, RewardFailedWarning, stacklevel=2)
