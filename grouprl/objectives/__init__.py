"""The objective library shared by every modality: pure functions on [N] / [N, T] tensors.

Public entry points: compute_advantages, policy_loss, kl_penalty, aggregate, masked_mean,
total_loss, kl_loss_term, engine_is_weights, high_entropy_mask, entropy_bonus and the
likelihood-free flow losses (LIKELIHOOD_FREE: nft_loss, awm_loss). The algorithm presets that
combine them are config/presets.
"""

from grouprl.objectives.advantages import ADVANTAGES, compute_advantages
from grouprl.objectives.aggregation import (
    AGG_COUNTS,
    AGGREGATIONS,
    aggregate,
    delta_l_weights,
    masked_mean,
)
from grouprl.objectives.correction import CORRECTIONS, engine_is_weights
from grouprl.objectives.entropy import entropy_bonus, high_entropy_mask, token_entropy_from_logits
from grouprl.objectives.flow.guard import guard_log_ratio, guard_step_loss
from grouprl.objectives.flow.losses import LIKELIHOOD_FREE, awm_loss, nft_loss
from grouprl.objectives.group_losses import GROUP_SURROGATES, pmd_token_loss, tpo_loss
from grouprl.objectives.kl import KL_ESTIMATORS, kl_in_reward, kl_penalty, sequence_kl
from grouprl.objectives.losses import RATIO_LEVELS, SURROGATES, ClipRange, policy_loss
from grouprl.objectives.objective import count_tokens, kl_loss_term, total_loss
from grouprl.objectives.token_scales import (
    EGSW_MODES,
    TOKEN_SCALES,
    egsw_weights,
    prefix_share_scales,
)

__all__ = [
    "ADVANTAGES",
    "AGG_COUNTS",
    "AGGREGATIONS",
    "CORRECTIONS",
    "EGSW_MODES",
    "GROUP_SURROGATES",
    "KL_ESTIMATORS",
    "LIKELIHOOD_FREE",
    "RATIO_LEVELS",
    "SURROGATES",
    "TOKEN_SCALES",
    "aggregate",
    "awm_loss",
    "compute_advantages",
    "count_tokens",
    "delta_l_weights",
    "egsw_weights",
    "engine_is_weights",
    "entropy_bonus",
    "guard_log_ratio",
    "guard_step_loss",
    "high_entropy_mask",
    "kl_in_reward",
    "kl_loss_term",
    "kl_penalty",
    "masked_mean",
    "nft_loss",
    "pmd_token_loss",
    "policy_loss",
    "ClipRange",
    "prefix_share_scales",
    "sequence_kl",
    "token_entropy_from_logits",
    "total_loss",
    "tpo_loss",
]
