"""The objective library shared by every modality: pure functions on [N] / [N, T] tensors.

Public entry points: compute_advantages, policy_loss, kl_penalty, aggregate, total_loss,
engine_is_weights, high_entropy_mask, entropy_bonus, and the presets.
"""

from grouprl.objectives import presets
from grouprl.objectives.advantages import ADVANTAGES, compute_advantages
from grouprl.objectives.aggregation import AGGREGATIONS, aggregate
from grouprl.objectives.correction import CORRECTIONS, engine_is_weights
from grouprl.objectives.entropy import entropy_bonus, high_entropy_mask, token_entropy_from_logits
from grouprl.objectives.kl import KL_ESTIMATORS, kl_in_reward, kl_penalty, sequence_kl
from grouprl.objectives.losses import RATIO_LEVELS, SURROGATES, policy_loss
from grouprl.objectives.objective import count_tokens, total_loss
from grouprl.objectives.presets import PRESETS, preset_settings

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "PRESETS",
    "RATIO_LEVELS",
    "SURROGATES",
    "aggregate",
    "compute_advantages",
    "count_tokens",
    "engine_is_weights",
    "entropy_bonus",
    "high_entropy_mask",
    "kl_in_reward",
    "kl_penalty",
    "policy_loss",
    "preset_settings",
    "presets",
    "sequence_kl",
    "token_entropy_from_logits",
    "total_loss",
]
