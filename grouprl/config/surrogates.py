"""`algorithm.surrogate`: one typed model per policy-gradient surrogate family, picked by `type`.

Each model holds exactly the knobs of its family (grouprl/objectives/losses.py's SURROGATES, where
the formulas and their papers are); a knob of another family is an error naming the allowed ones.
`policy_loss` takes one of these objects.

FLAT_KEYS maps the flat `algorithm:` keys of older configs (`eps_high`, `sapo_tau_pos` ...) to
their field here; grouprl/config/algorithm.py migrates them with a warning.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from grouprl.config.section import Section


class ClipSurrogate(Section):
    """PPO clip (arXiv 1707.06347); eps_high > eps_low is DAPO's clip-higher; optional dual clip."""

    type: Literal["clip"] = Field("clip", description="PPO clipped ratio.")
    eps_low: float = Field(0.2, ge=0, description="Lower clip range (1 - eps_low).")
    eps_high: float = Field(0.2, ge=0, description="Upper clip range (1 + eps_high).")
    dual_clip_c: float | None = Field(
        None, gt=1, description="Dual-clip bound c for A < 0 (arXiv 1912.09729; None: off)."
    )


class CispoSurrogate(Section):
    """MiniMax-M1 CISPO (arXiv 2506.13585): clip the stop-gradient importance weight."""

    type: Literal["cispo"] = Field("cispo", description="Clipped IS-weight policy gradient.")
    eps_low: float = Field(0.2, ge=0, description="Lower weight bound (1 - eps_low).")
    eps_high: float = Field(0.2, ge=0, description="Upper weight bound (1 + eps_high).")


class SapoSurrogate(Section):
    """Qwen SAPO (arXiv 2511.20347): a sigmoid gate on the token ratio instead of a hard clip."""

    type: Literal["sapo"] = Field("sapo", description="Soft adaptive gate.")
    tau_pos: float = Field(1.0, gt=0, description="Gate temperature for A > 0.")
    tau_neg: float = Field(1.05, gt=0, description="Gate temperature for A <= 0.")


class ReinforceSurrogate(Section):
    """GPG (arXiv 2504.02546): -A logp, no ratio and no clip."""

    type: Literal["reinforce"] = Field("reinforce", description="Plain policy gradient.")


class ClipCovSurrogate(Section):
    """Clip-Cov (arXiv 2505.22617): PPO clip plus detaching a random share of high-cov tokens."""

    type: Literal["clip_cov"] = Field("clip_cov", description="PPO clip + covariance clip.")
    eps_low: float = Field(0.2, ge=0, description="Lower clip range (1 - eps_low).")
    eps_high: float = Field(0.2, ge=0, description="Upper clip range (1 + eps_high).")
    dual_clip_c: float | None = Field(
        None, gt=1, description="Dual-clip bound c for A < 0 (None: off)."
    )
    ratio: float = Field(2e-4, gt=0, le=1, description="Share of the valid tokens detached.")
    lb: float = Field(1.0, description="Covariance lower bound of the candidates.")
    ub: float = Field(5.0, description="Covariance upper bound of the candidates.")


class KlCovSurrogate(Section):
    """KL-Cov (arXiv 2505.22617): -A rho plus a |log rho| penalty on the top-cov tokens."""

    type: Literal["kl_cov"] = Field("kl_cov", description="Unclipped ratio + covariance KL.")
    ratio: float = Field(2e-4, gt=0, le=1, description="Share of the valid tokens penalised.")
    coef: float = Field(1.0, ge=0, description="Penalty coefficient.")


class PmdSurrogate(Section):
    """PMD-mean (arXiv 2602.05933): regression of the sequence log-ratio onto A / tau."""

    type: Literal["pmd"] = Field("pmd", description="Policy mirror descent, mean partition.")
    tau: float = Field(0.01, gt=0, description="Temperature tau.")


class TpoSurrogate(Section):
    """TPO (arXiv 2604.06159): cross-entropy of the group softmax to an advantage-tilted target."""

    type: Literal["tpo"] = Field("tpo", description="Target policy optimisation (whole groups).")
    eta: float = Field(1.0, gt=0, description="Target temperature eta.")


SurrogateConfig = Annotated[
    ClipSurrogate
    | CispoSurrogate
    | SapoSurrogate
    | ReinforceSurrogate
    | ClipCovSurrogate
    | KlCovSurrogate
    | PmdSurrogate
    | TpoSurrogate,
    Field(discriminator="type"),
]

SURROGATE_MODELS: dict[str, type[Section]] = {
    m.model_fields["type"].default: m
    for m in (
        ClipSurrogate, CispoSurrogate, SapoSurrogate, ReinforceSurrogate,
        ClipCovSurrogate, KlCovSurrogate, PmdSurrogate, TpoSurrogate,
    )
}  # fmt: skip

# flat `algorithm:` key of older configs -> field of algorithm.surrogate
FLAT_KEYS = {
    "eps_low": "eps_low",
    "eps_high": "eps_high",
    "dual_clip_c": "dual_clip_c",
    "sapo_tau_pos": "tau_pos",
    "sapo_tau_neg": "tau_neg",
    "clip_cov_ratio": "ratio",
    "clip_cov_lb": "lb",
    "clip_cov_ub": "ub",
    "kl_cov_ratio": "ratio",
    "kl_cov_coef": "coef",
    "pmd_tau": "tau",
    "tpo_eta": "eta",
}
# the flat keys that a family reads under a shared new name (clip_cov_ratio vs kl_cov_ratio)
FLAT_KEY_FAMILY = {
    "clip_cov_ratio": "clip_cov", "clip_cov_lb": "clip_cov", "clip_cov_ub": "clip_cov",
    "kl_cov_ratio": "kl_cov", "kl_cov_coef": "kl_cov", "sapo_tau_pos": "sapo",
    "sapo_tau_neg": "sapo", "pmd_tau": "pmd", "tpo_eta": "tpo",
}  # fmt: skip
