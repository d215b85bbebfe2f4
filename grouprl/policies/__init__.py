"""Policies: sample groups of actions and score their log-probs (text: causal_lm; tiny test models: tiny)."""
