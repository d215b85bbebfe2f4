"""BudgetSampler: the prompt sampler wrapper that applies rollout.budget and checkpoints it.

Same interface as rollouts/prompt_sampler.PromptSampler (`next(n)`, `state_dict()`,
`load_state_dict()`), plus what the loop calls around each step (grouprl/rollouts/step.py rollout_step):

  group_sizes(examples)   G per drawn example (allocate), or None (every group rollout.group_size)
  observe(rollout, step)  after each sampling round: every sampled group's passes go into the
                          history (before dynamic sampling drops any group)
  finish_step()           after the step's rounds: GRESO's exploration update; the step's metrics

greso (greso.py) skips drawn prompts with its skip probability and draws more; allocate
(allocate.py) sets the group sizes of the drawn prompts; greso_allocate does both. The whole state
(inner sampler position, history, exploration probabilities, RNG) is plain JSON-able values, so a
resumed run draws and allocates exactly as an uninterrupted run would.
"""

from __future__ import annotations

import random
from typing import Any

from grouprl.rollouts.budget.allocate import allocate_group_sizes
from grouprl.rollouts.budget.greso import adjust_exploration, prompt_skip_probability
from grouprl.rollouts.budget.history import PassHistory, group_outcomes, prompt_key
from grouprl.types import Rollout

SELECTS = {"greso", "greso_allocate"}  # rollout.budget types that skip prompts (GRESO)
ALLOCATES = {"allocate", "greso_allocate"}  # types that set G per prompt


class BudgetSampler:
    """Wraps a PromptSampler; `settings` is a rollout.budget model (greso, allocate or both)."""

    def __init__(self, inner: Any, settings: Any, *, group_size: int, seed: int) -> None:
        if settings.type not in SELECTS | ALLOCATES:
            raise ValueError(f"BudgetSampler needs rollout.budget greso, allocate or "
                             f"greso_allocate, got {settings.type!r}")  # fmt: skip
        self.inner, self.s, self.group_size = inner, settings, group_size
        self.selects, self.allocates = settings.type in SELECTS, settings.type in ALLOCATES
        self.history = PassHistory(settings.window)
        self._rng = random.Random(seed * 1_000_003 + 17)
        self.p_easy = getattr(settings, "p_easy", None)
        self.p_hard = getattr(settings, "p_hard", None)
        self._reset_step()

    def _reset_step(self) -> None:
        self._counts = dict.fromkeys(
            ("drawn", "skipped", "predicted", "forced", "groups", "all_pass", "all_fail"), 0
        )
        self._sizes: list[int] = []

    def _key(self, example: dict) -> str:
        return prompt_key(example, self.s.key_column)

    # ---- before sampling --------------------------------------------------------------------

    def next(self, n: int) -> list[dict]:
        """n examples; greso: each drawn one is skipped with its skip probability and replaced."""
        if not self.selects:
            out = self.inner.next(n)
            self._counts["drawn"] += n
            return out
        out: list[dict] = []
        limit = self.s.max_draws * n
        draws = 0
        while len(out) < n:
            ex = self.inner.next(1)[0]
            draws += 1
            self._counts["drawn"] += 1
            easy, hard = self.history.streaks(self._key(ex))
            if easy or hard:
                self._counts["predicted"] += 1
            if draws > limit:  # bounded loop: keep the rest unfiltered
                self._counts["forced"] += 1
                out.append(ex)
                continue
            p = prompt_skip_probability(easy, hard, self.p_easy, self.p_hard, self.s.min_keep)
            if p > 0 and self._rng.random() < p:
                self._counts["skipped"] += 1
                continue
            out.append(ex)
        return out

    def group_sizes(self, examples: list[dict]) -> list[int] | None:
        """allocate: one G per example summing to len(examples) x group_size; else None."""
        if not self.allocates:
            self._sizes += [self.group_size] * len(examples)
            return None
        rates = [self.history.pass_rate(self._key(ex), self.s.prior_passes, self.s.prior_fails)
                 for ex in examples]  # fmt: skip
        sizes = allocate_group_sizes(rates, len(examples) * self.group_size, self.s.min_group_size)
        self._sizes += sizes
        return sizes

    # ---- after sampling ---------------------------------------------------------------------

    def observe(self, rollout: Rollout, step: int) -> None:
        """Record every group of one sampling round (all of them, before any filter)."""
        outcomes = list(group_outcomes(rollout, self.s.key_column, self.s.pass_threshold))
        for key, passes, n in outcomes:
            self.history.record(key, step, passes, n)
            self._counts["groups"] += 1
            self._counts["all_pass"] += int(passes == n)
            self._counts["all_fail"] += int(passes == 0)

    def finish_step(self) -> dict[str, float]:
        """GRESO's exploration update from this step's groups, then the step's budget/ metrics."""
        c = self._counts
        groups = max(c["groups"], 1)
        easy, hard = c["all_pass"] / groups, c["all_fail"] / groups
        s = self.s
        if self.selects and c["groups"] and getattr(self.inner, "epoch", 1) > 0:
            target = s.target_zero_variance
            kw = dict(step=s.p_step, low=s.p_min, high=s.p_max)
            self.p_easy = adjust_exploration(self.p_easy, easy, target * s.easy_share, **kw)
            self.p_hard = adjust_exploration(self.p_hard, hard, target * (1 - s.easy_share), **kw)
        sizes = self._sizes or [self.group_size]
        m = {
            "budget/skipped_prompts": float(c["skipped"]),
            "budget/predicted_zero_variance": float(c["predicted"]),
            "budget/forced_prompts": float(c["forced"]),
            "budget/G_min": float(min(sizes)),
            "budget/G_max": float(max(sizes)),
            "budget/zero_variance_frac": easy + hard,
            "budget/all_pass_frac": easy,
            "budget/all_fail_frac": hard,
            "budget/prompts_tracked": float(len(self.history)),
        }
        if self.selects:
            m["budget/p_easy"], m["budget/p_hard"] = self.p_easy, self.p_hard
        self._reset_step()
        return m

    # ---- checkpoint -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain lists, numbers and strings (the trainer state's JSON)."""
        version, internal, gauss = self._rng.getstate()
        return {
            "type": self.s.type,
            "inner": self.inner.state_dict(),
            "history": self.history.state_dict(),
            "p_easy": self.p_easy,
            "p_hard": self.p_hard,
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict() output; a state of another budget type is refused unchanged."""
        if state.get("type") != self.s.type:
            raise ValueError(
                f"the checkpoint's rollout.budget type is {state.get('type')!r}, the config's is "
                f"{self.s.type!r}: resume needs the same budget"
            )
        history = PassHistory(self.s.window)
        history.load_state_dict(state["history"])  # raises before anything changes
        self.inner.load_state_dict(state["inner"])
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self.history, self.p_easy, self.p_hard = history, state["p_easy"], state["p_hard"]
        self._reset_step()
