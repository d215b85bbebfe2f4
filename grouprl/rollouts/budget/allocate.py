"""G per prompt by uncertainty, under a fixed total number of samples.

Idea from "Knapsack RL: Unlocking Exploration of LLMs via Optimizing Budget Allocation" (Li et al.,
arXiv 2509.25849) and AR3PO (more responses for hard prompts, fewer for easy ones): spend a fixed
rollout budget where a group is likely to carry signal. The rule here is a simpler proportional
one: with p_i a prompt's smoothed pass rate (history.py: Beta(a, b)-smoothed over its recent
visits, a / (a + b) = 0.5 for an unseen prompt),

    w_i = sqrt(p_i (1 - p_i))                       (the std of a 0/1 reward at pass rate p_i)
    G_i = m + share of R = total - m * n            (m = min_group_size, n = prompts)
          share_i = R * w_i / sum_j w_j, rounded by largest remainder: floor(share_i), then the
          R - sum floor units go one each to the largest fractional parts (ties: lower index)

so sum_i G_i = total exactly, every G_i >= m, and equal pass rates give equal groups (a uniform
split when all w_i = 0, which the smoothing prior only allows when a or b is 0).

Deviations from Knapsack RL: no knapsack solve (its value of a budget is the probability of a
non-zero-variance group times an information gain, maximised by dynamic programming over
discrete budgets); no per-prompt cap other than the total; no fallback pass that re-sends the
budget of solved prompts to unsolved ones. The pass rate comes from past visits (before this
step's sampling), as Knapsack RL's does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def uncertainty(p: float) -> float:
    """sqrt(p (1 - p)): the std of a 0/1 reward with pass rate p."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"a pass rate must be in [0, 1], got {p}")
    return math.sqrt(p * (1.0 - p))


def largest_remainder(shares: Sequence[float], total: int) -> list[int]:
    """Integers summing to `total` from non-negative real shares summing to `total`: floors, then
    one more unit each to the largest fractional parts (ties: the lower index first)."""
    floors = [math.floor(s + 1e-9) for s in shares]  # 1e-9: 2.9999999 from float sums is 3
    left = total - sum(floors)
    if left < 0 or left > len(shares):
        raise ValueError(f"shares {list(shares)} do not sum to {total}")
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - floors[i]), i))
    for i in order[:left]:
        floors[i] += 1
    return floors


def allocate_group_sizes(pass_rates: Sequence[float], total: int, min_size: int = 2) -> list[int]:
    """One G per prompt: min_size each, the rest of `total` in proportion to sqrt(p (1 - p))."""
    n = len(pass_rates)
    if n == 0:
        raise ValueError("no prompts to allocate samples to")
    if min_size < 1 or total < n * min_size:
        raise ValueError(
            f"a total of {total} samples cannot give {n} prompts at least {min_size} each "
            "(rollout.budget.min_group_size must be <= rollout.group_size)"
        )
    w = [uncertainty(p) for p in pass_rates]
    rest = total - n * min_size
    s = sum(w)
    shares = [rest * x / s for x in w] if s > 0 else [rest / n] * n
    return [min_size + g for g in largest_remainder(shares, rest)]
