"""Presets use only the `algorithm:` config field names, with allowed values; DAPO's exact settings."""

from __future__ import annotations

import pytest

from grouprl.config.loading import validate
from grouprl.config.presets import PRESETS, Preset, preset_settings

EXPECTED = [
    "grpo", "dr_grpo", "dapo", "gspo", "gmpo", "cispo", "sapo", "rloo", "reinforce_pp", "gpg",
    "lambda_grpo", "pmd_mean", "tpo", "delta_l", "dump", "egsw", "entropy_only", "two_grpo", "gigpo",
    "hint", "replay", "greso", "treerpo", "tree_grpo", "opd",
]  # fmt: skip
MINIMAL = {
    "workload": {"type": "text"},
    "model": {"name_or_path": "x"},
    "task": {"name": "arithmetic"},
}


def resolved(obj, value):
    """The resolved counterpart of a preset value: for a typed part's mapping (algorithm.surrogate)
    the typed model's values of the mapping's keys."""
    if isinstance(value, dict) and hasattr(obj, "model_fields"):
        return {k: getattr(obj, k) for k in value}
    if isinstance(value, list | tuple) and isinstance(obj, list) and len(obj) == len(value):
        return type(value)(resolved(o, v) for o, v in zip(obj, value))  # rollout.hooks
    return obj


def test_preset_names():
    assert list(PRESETS)[: len(EXPECTED)] == EXPECTED  # the flow presets follow (test_flow_presets)
    assert all(isinstance(p, Preset) and p.name == key for key, p in PRESETS.items())


@pytest.mark.parametrize("name", EXPECTED)
def test_every_setting_is_a_config_field_and_lands_in_the_resolved_config(name):
    """Validated through the real Config: unknown field names or disallowed values fail here, and
    every setting (algorithm fields and "section.field" ones) appears in the resolved config."""
    preset = PRESETS[name]
    assert preset.arxiv.count(".") == 1 and preset.summary.endswith(".")
    own = {"distill": {"teacher": "teacher-folder"}} if name == "opd" else {}  # never a preset's
    cfg = validate({**MINIMAL, "algorithm": {"preset": name, **own}})
    settings = preset_settings(name)
    assert "advantage" in settings  # every preset picks its estimator
    for key, value in settings.items():
        got = resolved(getattr(cfg.algorithm, key), value)
        assert got == value, (name, key)
        assert type(got) is type(value), (name, key)
        if isinstance(value, dict):
            assert all(type(got[k]) is type(v) for k, v in value.items()), (name, key)
    for key, value in preset_settings(name, sections=True).items():
        section, field = key.split(".")
        if getattr(cfg, section) is None:  # another workload's section (agent: gigpo)
            continue
        assert resolved(getattr(getattr(cfg, section), field), value) == value, (name, key)


def test_preset_for_another_section_yields_to_an_explicit_value():
    cfg = validate({**MINIMAL, "algorithm": {"preset": "two_grpo"}, "rollout": {"group_size": 4}})
    assert cfg.rollout.group_size == 4
    assert validate({**MINIMAL, "algorithm": {"preset": "two_grpo"}}).rollout.group_size == 2


def test_dapo_exact():
    assert preset_settings("dapo") == {
        "advantage": "grpo",
        "scale": "group",
        "surrogate": {"type": "clip", "eps_low": 0.2, "eps_high": 0.28},
        "ratio_level": "token",
        "aggregation": "token_mean",
        "kl_coef": 0.0,
        "dynamic_sampling": "zero_variance",
        "max_sampling_rounds": 10,
        "overlong_shaping": "soft",
        "overlong_buffer_frac": 0.2,
        "overlong_factor": 1.0,
    }


def test_key_values_of_other_presets():
    grpo = preset_settings("grpo")
    assert grpo["kl_coef"] == 0.0 and grpo["surrogate"]["eps_high"] == 0.2
    assert preset_settings("dr_grpo")["scale"] == "none"
    assert preset_settings("dr_grpo")["aggregation"] == "seq_mean_token_sum_norm"
    gspo = preset_settings("gspo")
    assert (gspo["ratio_level"], gspo["surrogate"]) == (
        "sequence", {"type": "clip", "eps_low": 3e-4, "eps_high": 4e-4}
    )  # fmt: skip
    gmpo = preset_settings("gmpo")
    assert gmpo["ratio_level"] == "geometric" and gmpo["surrogate"]["eps_low"] == 0.4
    assert preset_settings("cispo")["surrogate"] == {
        "type": "cispo",
        "eps_low": 10.0,
        "eps_high": 0.2,
    }
    assert preset_settings("sapo")["surrogate"] == {"type": "sapo", "tau_pos": 1.0, "tau_neg": 1.05}
    assert (
        preset_settings("rloo")["advantage"] == "rloo"
        and preset_settings("rloo")["kl_mode"] == "reward"
    )
    assert preset_settings("reinforce_pp")["advantage"] == "reinforce_pp_baseline"
    assert (
        preset_settings("gpg")["surrogate"] == {"type": "reinforce"}
        and preset_settings("gpg")["advantage"] == "gpg"
    )


def test_settings_are_copies_and_presets_read_only():
    s = preset_settings("grpo")
    s["kl_coef"] = 0.5
    s["surrogate"]["eps_low"] = 0.5  # a nested mapping is a copy too
    assert preset_settings("grpo")["kl_coef"] == 0.0
    assert preset_settings("grpo")["surrogate"]["eps_low"] == 0.2
    with pytest.raises(TypeError):
        PRESETS["grpo"].settings["kl_coef"] = 0.5  # type: ignore[index]


def test_unknown_preset_names_nearest():
    with pytest.raises(ValueError, match="did you mean 'gspo'") as err:
        preset_settings("gpso")
    assert "allowed are" in str(err.value) and "dapo" in str(err.value)


def test_config_literals_match_our_registries():
    from typing import get_args

    from grouprl.config.algorithm import AlgorithmConfig
    from grouprl.objectives.advantages import ADVANTAGES
    from grouprl.objectives.aggregation import AGGREGATIONS
    from grouprl.objectives.correction import CORRECTIONS
    from grouprl.objectives.kl import KL_ESTIMATORS
    from grouprl.objectives.losses import RATIO_LEVELS, SURROGATES

    def allowed(name):
        return set(get_args(AlgorithmConfig.model_fields[name].annotation))

    assert allowed("advantage") == set(ADVANTAGES.names())
    assert allowed("kl_estimator") == set(KL_ESTIMATORS.names())
    assert allowed("engine_correction") == set(CORRECTIONS.names())
    from grouprl.config.surrogates import SURROGATE_MODELS

    assert set(SURROGATE_MODELS) == set(SURROGATES.names())  # one typed model per family
    assert allowed("ratio_level") == set(RATIO_LEVELS.names())
    assert allowed("aggregation") == set(AGGREGATIONS.names())
