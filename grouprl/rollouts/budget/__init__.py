"""Rollout budgets (`rollout.budget`): where a step's samples go, from each prompt's pass history.

history.py   per-prompt pass-rate history (visits, all-pass / all-fail streaks)
greso.py     GRESO's skip rule and its self-adjusting exploration probabilities (arXiv 2506.02177)
allocate.py  G per prompt by uncertainty under a fixed total (largest-remainder rounding)
sampler.py   BudgetSampler: the prompt sampler wrapper that applies them and checkpoints them
"""
