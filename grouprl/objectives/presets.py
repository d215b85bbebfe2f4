"""Named algorithms = settings of the `algorithm:` config section (objectives are orthogonal pieces).

A preset fills the algorithm fields it cares about; every field it leaves out takes the config
default. Field names are exactly those of the `algorithm:` section of grouprl/config.py.

Choices and deviations (sources: METHODS.md, peers/text.md):
  grpo          kl_coef 0.0, although DeepSeekMath (arXiv 2402.03300) used beta 0.04 with k3. TRL
                defaults to beta 0 and later work (DAPO, Dr. GRPO) drops the KL for verifiable rewards;
                with 0 no reference model is loaded. kl_estimator k3 is set so that raising kl_coef
                gives the paper's estimator.
  dr_grpo       seq_mean_token_sum_norm = Dr. GRPO's constant normaliser (max length).
  dapo          overlong_buffer_frac 0.2 = L_cache / L_max = 4096 / 20480 of the verl recipe;
                max_sampling_rounds 10 = the recipe's max_num_gen_batches.
  gspo          clip range 3e-4 / 4e-4 (GSPO paper, verl example), seq_mean_token_mean as verl forces.
  gmpo          eps 0.4 / 0.4 (log-space clip). GMPO ignores the aggregation mode (plain mean over
                sequences); seq_mean_token_mean is the sequence-level mode closest to it.
  cispo         eps_low 10 (no lower bound) / eps_high 0.2 from verl's example; MiniMax-M1's own value
                of eps_high is unconfirmed. TRL's cispo caps the ratio at an absolute 5.0 instead.
  rloo          TRL's RLOO: sequence-level ratio, KL folded into the reward with k1 and beta 0.05.
                Deviation: our "sequence" ratio is length-normalised (GSPO form, exp of the mean token
                log-ratio) while TRL's RLOO exponentiates the summed log-ratio.
  reinforce_pp  verl's REINFORCE++-baseline example: k2 KL in the loss, coef 0.001, token_mean.
  gpg           plain REINFORCE surrogate, token_mean, no KL, no reference (verl example).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from grouprl.objectives.flow_presets import FLOW_PRESETS


@dataclass(frozen=True)
class Preset:
    """A named algorithm: where it comes from, one sentence on what it is, and its settings."""

    name: str
    arxiv: str
    summary: str
    settings: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # read-only view, so no caller can edit a shared preset in place
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))


_CLIP = {"surrogate": "clip", "ratio_level": "token"}
_NO_KL = {"kl_coef": 0.0}
_GRPO_CORE = {
    "advantage": "grpo",
    "scale": "group",
    **_CLIP,
    "eps_low": 0.2,
    "eps_high": 0.2,
    "aggregation": "seq_mean_token_mean",
    **_NO_KL,
}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "grpo",
            "2402.03300",
            "Group-normalised advantages with a PPO clipped surrogate (DeepSeekMath).",
            {
                "advantage": "grpo",
                "scale": "group",
                **_CLIP,
                "eps_low": 0.2,
                "eps_high": 0.2,
                "aggregation": "seq_mean_token_mean",
                **_NO_KL,
                "kl_estimator": "k3",
                "kl_mode": "loss",
            },
        ),
        Preset(
            "dr_grpo",
            "2503.20783",
            "GRPO without std scaling or length normalisation, which bias it (Dr. GRPO).",
            {
                "advantage": "dr_grpo",
                "scale": "none",
                **_CLIP,
                "eps_low": 0.2,
                "eps_high": 0.2,
                "aggregation": "seq_mean_token_sum_norm",
                **_NO_KL,
            },
        ),
        Preset(
            "dapo",
            "2503.14476",
            "Clip-higher, token-mean loss, zero-variance dynamic sampling and soft overlong penalty.",
            {
                "advantage": "grpo",
                "scale": "group",
                **_CLIP,
                "eps_low": 0.2,
                "eps_high": 0.28,
                "aggregation": "token_mean",
                **_NO_KL,
                "dynamic_sampling": "zero_variance",
                "max_sampling_rounds": 10,
                "overlong_shaping": "soft",
                "overlong_buffer_frac": 0.2,
                "overlong_factor": 1.0,
            },
        ),
        Preset(
            "gspo",
            "2507.18071",
            "Sequence-level (length-normalised) importance ratio with a tiny clip range (Qwen GSPO).",
            {
                "advantage": "grpo",
                "scale": "group",
                "surrogate": "clip",
                "ratio_level": "sequence",
                "eps_low": 3e-4,
                "eps_high": 4e-4,
                "aggregation": "seq_mean_token_mean",
                **_NO_KL,
            },
        ),
        Preset(
            "gmpo",
            "2507.20673",
            "Geometric mean of token ratios, clipped in log space with a wide range (GMPO).",
            {
                "advantage": "grpo",
                "scale": "group",
                "surrogate": "clip",
                "ratio_level": "geometric",
                "eps_low": 0.4,
                "eps_high": 0.4,
                "aggregation": "seq_mean_token_mean",
                **_NO_KL,
            },
        ),
        Preset(
            "cispo",
            "2506.13585",
            "Clip the stop-gradient importance weight, not the update; every token keeps a gradient.",
            {
                "advantage": "grpo",
                "scale": "group",
                "surrogate": "cispo",
                "ratio_level": "token",
                "eps_low": 10.0,
                "eps_high": 0.2,
                "aggregation": "token_mean",
                **_NO_KL,
            },
        ),
        Preset(
            "sapo",
            "2511.20347",
            "Smooth sigmoid gate on the token ratio instead of a hard clip (Qwen SAPO).",
            {
                "advantage": "grpo",
                "scale": "group",
                "surrogate": "sapo",
                "ratio_level": "token",
                "sapo_tau_pos": 1.0,
                "sapo_tau_neg": 1.05,
                "aggregation": "seq_mean_token_mean",
                **_NO_KL,
            },
        ),
        Preset(
            "rloo",
            "2402.14740",
            "Leave-one-out baseline, sequence-level clipped ratio, KL folded into the reward.",
            {
                "advantage": "rloo",
                "surrogate": "clip",
                "ratio_level": "sequence",
                "eps_low": 0.2,
                "eps_high": 0.2,
                "aggregation": "seq_mean_token_mean",
                "kl_coef": 0.05,
                "kl_estimator": "k1",
                "kl_mode": "reward",
            },
        ),
        Preset(
            "reinforce_pp",
            "2501.03262",
            "Group-mean baseline whitened over the batch, PPO clip, k2 KL in the loss (REINFORCE++).",
            {
                "advantage": "reinforce_pp_baseline",
                **_CLIP,
                "eps_low": 0.2,
                "eps_high": 0.2,
                "aggregation": "token_mean",
                "kl_coef": 0.001,
                "kl_estimator": "k2",
                "kl_mode": "loss",
            },
        ),
        Preset(
            "gpg",
            "2504.02546",
            "Plain policy gradient with a rescaled group baseline; no ratio, clip, KL or reference.",
            {
                "advantage": "gpg",
                "surrogate": "reinforce",
                "ratio_level": "token",
                "aggregation": "token_mean",
                **_NO_KL,
            },
        ),
        # ---- methods of the field (issue 8; formulas in METHODS.md) ----
        Preset(
            "lambda_grpo",
            "2509.21154",
            "GRPO with each token's loss divided by the number of group members sharing its prefix.",
            {**_GRPO_CORE, "token_scale": "prefix_share"},
        ),
        Preset(
            "pmd_mean",
            "2602.05933",
            "Leave-one-out advantage; squared-error regression of the sequence log-ratio onto A/tau.",
            {
                "advantage": "rloo",
                "surrogate": "pmd",
                "ratio_level": "token",
                "pmd_tau": 0.01,
                "aggregation": "seq_mean_token_mean",
                **_NO_KL,
            },
        ),
        Preset(
            "tpo",
            "2604.06159",
            "Cross-entropy fit of the group softmax to the old policy tilted by exp(u / eta).",
            {
                "advantage": "tpo",
                "surrogate": "tpo",
                "ratio_level": "token",
                "tpo_eta": 1.0,
                **_NO_KL,
            },
        ),
        Preset(
            "delta_l",
            "2509.07558",
            "GRPO advantages with length weights L^-alpha normalised over the batch, constant normaliser.",
            {
                "advantage": "grpo",
                "scale": "group",
                **_CLIP,
                "eps_low": 0.2,
                "eps_high": 0.3,
                "dual_clip_c": 3.0,
                "aggregation": "delta_l",
                "delta_l_alpha": 0.75,
                **_NO_KL,
            },
        ),
        Preset(
            "dump",
            "2504.09710",
            "GRPO with a UCB curriculum over data sources scored by mean |advantage|.",
            {
                **_GRPO_CORE,
                "kl_coef": 0.001,
                "kl_estimator": "k3",
                "kl_mode": "loss",
                "curriculum.type": "dump",
            },
        ),
        Preset(
            "egsw",
            "2503.22456",
            "GRPO re-weighted by a group softmax of (advantage + alpha * entropy) / P (partly unconfirmed).",
            {**_GRPO_CORE, "egsw": "sequence", "egsw_alpha": 0.1, "egsw_temperature": 1.0},
        ),
        Preset(
            "entropy_only",
            "2504.20571",
            "No policy-gradient term: only a token-mean entropy bonus (+0.001), no KL, temperature 0.6.",
            {
                **_GRPO_CORE,
                "pg_coef": 0.0,
                "entropy_coef": 0.001,
                "aggregation": "token_mean",
                "rollout.temperature": 0.6,
            },
        ),
        Preset(
            "two_grpo",
            "2510.00977",
            "Plain GRPO with groups of two (a DPO-like contrastive pair per prompt).",
            {**_GRPO_CORE, "rollout.group_size": 2},
        ),
        Preset(
            "gigpo",
            "2505.10978",
            "Multi-turn agents: episode advantage plus step advantage from identical anchor states.",
            {
                **_GRPO_CORE,
                "kl_coef": 0.01,
                "kl_estimator": "k3",
                "kl_mode": "loss",
                "agent.credit": "gigpo",
                "agent.gamma": 0.95,
                "agent.omega": 1.0,
                "agent.norm": "mean_std_norm",
                "agent.invalid_penalty": 0.1,
            },
        ),
    ]
}

# image / video presets (flow_grpo, dance_grpo, ddpo, diffusion_nft ...), documented in flow_presets.py
PRESETS.update({spec["name"]: Preset(**spec) for spec in FLOW_PRESETS})


def preset_settings(name: str, *, sections: bool = False) -> dict[str, object]:
    """A fresh copy of the preset's `algorithm:` settings, or with sections=True its settings for
    other sections, keyed "section.field" (e.g. two_grpo's "rollout.group_size").

    An unknown name raises, naming the nearest preset.
    """
    if not isinstance(name, str) or name not in PRESETS:  # a YAML list or mapping is no name
        close = difflib.get_close_matches(str(name), list(PRESETS), n=1, cutoff=0.0)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown preset {name!r}: allowed are {', '.join(sorted(PRESETS))}{hint}")
    return {k: v for k, v in PRESETS[name].settings.items() if ("." in k) == sections}
