"""GRESO: skip prompts predicted to give a zero-variance group, before sampling them.

Source: "Act Only When It Pays: Efficient Reinforcement Learning for LLM Reasoning via Selective
Rollouts" (Zheng et al., arXiv 2506.02177); official code Infini-AI-Lab/GRESO
(verl/trainer/ttis/presampling_selector.py `filter_examples_all_probabilistic`, the exploration
update in verl/trainer/ppo/ray_trainer.py, settings in train-scripts/*_greso.sh).

A prompt whose group had all rewards equal in its recent visits tends to stay so (temporal
consistency). Each prompt keeps the number z of its most recent consecutive visits that were
all-pass ("easy") or all-fail ("hard"). Before sampling, it is skipped with probability

    P_skip = 1 - max(p^z, min_keep)        (z = 0: never skipped; min_keep = 0.01)

with p = p_easy for an easy streak, p_hard for a hard one (the exploration probabilities: the
chance of sampling it again after one zero-variance visit). After each step, each p moves by
p_step = 0.01 so that the share of zero-variance groups among those sampled tracks a target
(25% in the paper's runs; 1/3 of it for easy groups, 2/3 for hard ones, "more exploration on hard
examples, because they are more likely to change"):

    observed_easy >= target * easy_share        -> p_easy = max(p_easy - p_step, p_min)  (skip more)
    otherwise                                   -> p_easy = min(p_easy + p_step, p_max)
    (the same for p_hard with target * (1 - easy_share)),   p_min = 0.05, p_max = 0.95,
    initial p_easy = p_hard = 0.5.

Deviations:
- Easy / hard are defined on pass / fail of the correctness reward (history.py: reward >=
  rollout.budget.pass_threshold), not on the official code's reward means (>= 0.98 easy,
  <= 0.11 hard, its format reward being 0.1). With a 0/1 correctness reward they coincide.
- Skipped prompts are replaced by further draws from the sampler, so every step samples exactly
  rollout.prompts_per_step groups. The official trainer instead draws fixed-size dataloader
  batches, filters them, and accumulates until an adaptive sampling batch size is reached (its
  "adaptive batch size" estimated from the zero-variance ratio); that estimate is not needed here.
  To bound the loop, after max_draws x prompts_per_step draws in one call the remaining slots take
  the next draws unfiltered (counted as budget/forced_prompts; never reached with min_keep > 0 in
  practice).
- The random draws come from the sampler's own seeded RNG (checkpointed), not torch's global RNG.
- As in the official code, the exploration probabilities change only after the first pass over
  the data (its `epoch > 0`), from the groups sampled during the step (all its dynamic-sampling
  rounds).
"""

from __future__ import annotations


def skip_probability(streak: int, p: float, min_keep: float = 0.01) -> float:
    """1 - max(p^streak, min_keep) for a prompt with `streak` consecutive zero-variance visits of
    one kind (0 when streak is 0)."""
    if streak < 0 or not 0 < p < 1 or not 0 < min_keep <= 1:
        raise ValueError(f"need streak >= 0, 0 < p < 1, 0 < min_keep <= 1; got {streak}, {p}, "
                         f"{min_keep}")  # fmt: skip
    return 0.0 if streak == 0 else 1.0 - max(p**streak, min_keep)


def prompt_skip_probability(
    easy_streak: int, hard_streak: int, p_easy: float, p_hard: float, min_keep: float = 0.01
) -> float:
    """A prompt's skip probability: from its all-pass streak if it has one, else its all-fail
    streak (the official code tests the easy rule first; at most one streak is non-zero)."""
    if easy_streak > 0:
        return skip_probability(easy_streak, p_easy, min_keep)
    return skip_probability(hard_streak, p_hard, min_keep)


def adjust_exploration(
    p: float, observed: float, target: float, *, step: float, low: float, high: float
) -> float:
    """One step of the exploration probability: down by `step` (skip more) when the observed
    zero-variance share reached its target, else up; kept in [low, high]."""
    return max(p - step, low) if observed >= target else min(p + step, high)
