"""Presets use only the `algorithm:` config field names, with allowed values; DAPO's exact settings."""

from __future__ import annotations

import pytest

from grouprl.objectives.presets import PRESETS, Preset, preset_settings

# The `algorithm:` section of the run config (grouprl/config.py), hard-coded on purpose: a preset
# that drifts from the config's field names must fail here. Literal fields list their allowed values.
LITERALS: dict[str, set[str]] = {
    "advantage": {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk"},
    "scale": {"group", "batch", "none"},
    "reward_aggregation": {"sum_then_normalize", "normalize_then_sum"},
    "ratio_level": {"token", "sequence", "geometric"},
    "surrogate": {"clip", "cispo", "sapo", "reinforce", "clip_cov", "kl_cov"},
    "aggregation": {
        "token_mean",
        "seq_mean_token_mean",
        "seq_mean_token_sum",
        "seq_mean_token_sum_norm",
    },
    "kl_estimator": {"k1", "k2", "k3", "k1+", "k3+"},
    "kl_mode": {"loss", "reward"},
    "engine_correction": {
        "none",
        "token_truncate",
        "token_mask",
        "sequence_truncate",
        "sequence_mask",
    },
    "dynamic_sampling": {"off", "zero_variance"},
    "overlong_shaping": {"off", "soft"},
}
FLOATS = {
    "adv_eps", "eps_low", "eps_high", "sapo_tau_pos", "sapo_tau_neg", "clip_cov_ratio", "clip_cov_lb",
    "clip_cov_ub", "kl_cov_ratio", "kl_cov_coef", "kl_coef", "entropy_coef", "top_entropy_quantile",
    "engine_correction_max", "engine_correction_min", "overlong_buffer_frac", "overlong_factor",
}  # fmt: skip
INTS = {"max_sampling_rounds", "epochs", "minibatches"}
OPTIONAL_FLOATS = {"dual_clip_c"}
FIELDS = set(LITERALS) | FLOATS | INTS | OPTIONAL_FLOATS  # "preset" itself is not a preset setting

EXPECTED = [
    "grpo",
    "dr_grpo",
    "dapo",
    "gspo",
    "gmpo",
    "cispo",
    "sapo",
    "rloo",
    "reinforce_pp",
    "gpg",
]


def test_preset_names():
    assert list(PRESETS) == EXPECTED
    assert all(isinstance(p, Preset) and p.name == key for key, p in PRESETS.items())


@pytest.mark.parametrize("name", EXPECTED)
def test_settings_use_only_config_fields_with_valid_values(name):
    preset = PRESETS[name]
    assert preset.arxiv.count(".") == 1 and preset.summary.endswith(".")
    settings = preset_settings(name)
    assert settings["advantage"] in LITERALS["advantage"]  # every preset picks its estimator
    for key, value in settings.items():
        assert key in FIELDS, f"{name}: {key!r} is not an algorithm field"
        if key in LITERALS:
            assert value in LITERALS[key], f"{name}: {key}={value!r}"
        elif key in INTS:
            assert type(value) is int
        elif key in FLOATS:
            assert type(value) is float, f"{name}: {key}={value!r} should be a float"
        else:
            assert value is None or type(value) is float


def test_dapo_exact():
    assert preset_settings("dapo") == {
        "advantage": "grpo",
        "scale": "group",
        "surrogate": "clip",
        "ratio_level": "token",
        "eps_low": 0.2,
        "eps_high": 0.28,
        "aggregation": "token_mean",
        "kl_coef": 0.0,
        "dynamic_sampling": "zero_variance",
        "max_sampling_rounds": 10,
        "overlong_shaping": "soft",
        "overlong_buffer_frac": 0.2,
        "overlong_factor": 1.0,
    }


def test_key_values_of_other_presets():
    assert preset_settings("grpo")["kl_coef"] == 0.0 and preset_settings("grpo")["eps_high"] == 0.2
    assert preset_settings("dr_grpo")["scale"] == "none"
    assert preset_settings("dr_grpo")["aggregation"] == "seq_mean_token_sum_norm"
    gspo = preset_settings("gspo")
    assert (gspo["ratio_level"], gspo["eps_low"], gspo["eps_high"]) == ("sequence", 3e-4, 4e-4)
    assert (
        preset_settings("gmpo")["ratio_level"] == "geometric"
        and preset_settings("gmpo")["eps_low"] == 0.4
    )
    assert (
        preset_settings("cispo")["surrogate"] == "cispo"
        and preset_settings("cispo")["eps_low"] == 10.0
    )
    assert preset_settings("sapo")["surrogate"] == "sapo"
    assert (
        preset_settings("rloo")["advantage"] == "rloo"
        and preset_settings("rloo")["kl_mode"] == "reward"
    )
    assert preset_settings("reinforce_pp")["advantage"] == "reinforce_pp_baseline"
    assert (
        preset_settings("gpg")["surrogate"] == "reinforce"
        and preset_settings("gpg")["advantage"] == "gpg"
    )


def test_settings_are_copies_and_presets_read_only():
    s = preset_settings("grpo")
    s["eps_low"] = 0.5
    assert preset_settings("grpo")["eps_low"] == 0.2
    with pytest.raises(TypeError):
        PRESETS["grpo"].settings["eps_low"] = 0.5  # type: ignore[index]


def test_unknown_preset_names_nearest():
    with pytest.raises(ValueError, match="did you mean 'gspo'") as err:
        preset_settings("gpso")
    assert "allowed are" in str(err.value) and "dapo" in str(err.value)


def test_literals_match_our_registries():
    from grouprl.objectives.advantages import ADVANTAGES
    from grouprl.objectives.correction import CORRECTIONS
    from grouprl.objectives.kl import KL_ESTIMATORS

    assert set(ADVANTAGES.names()) == LITERALS["advantage"]
    assert set(KL_ESTIMATORS.names()) == LITERALS["kl_estimator"]
    assert set(CORRECTIONS.names()) == LITERALS["engine_correction"]
