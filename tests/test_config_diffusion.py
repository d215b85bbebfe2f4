"""The `diffusion:` config section: defaults, readable errors, settings that cannot work together."""

from __future__ import annotations

import typing

import pytest

from grouprl.config.diffusion import DiffusionConfig
from grouprl.config.loading import Config, ConfigError, validate
from grouprl.policies.flow.samplers import SAMPLERS


def raw(**diffusion) -> dict:
    return {
        "workload": {"type": "images"},
        "model": {"name_or_path": "tiny", "type": "flow"},
        "task": {"name": "image_prompts"},
        "diffusion": diffusion,
    }


TEXT = {
    "workload": {"type": "text"},
    "model": {"name_or_path": "tiny"},
    "task": {"name": "arithmetic"},
}


def test_defaults_are_flow_grpo_and_text_configs_have_no_section():
    assert validate(TEXT).diffusion is None
    assert "diffusion" not in validate(TEXT).model_dump()
    d = validate(raw()).diffusion
    assert d == DiffusionConfig()
    assert (d.sampler, d.noise_level, d.rollout_steps, d.eval_steps) == ("flow_sde", 0.7, 10, 40)
    assert (d.train_steps.type, d.adv_clip_max, d.objective.type, d.objective.ratio_norm) == (
        "all_but_last", 5.0, "policy_gradient", "off"
    )  # fmt: skip
    assert (d.guidance_scale, d.train_guidance, d.shared_noise, d.num_frames) == (
        1.0,
        "same",
        "off",
        1,
    )
    assert d.shift is None
    assert "diffusion" in Config.model_fields


def test_every_field_has_a_description_and_samplers_match_the_registry():
    for name, field in DiffusionConfig.model_fields.items():
        assert field.description, name
    assert list(typing.get_args(DiffusionConfig.model_fields["sampler"].annotation)) == list(
        SAMPLERS
    )


def test_values_are_set_and_coerced():
    d = validate(
        raw(
            sampler="dance_sde",
            eta=0.3,
            height=32,
            width=64,
            train_steps={"type": "random_window", "window_range": [1, 5]},
        )  # fmt: skip
    ).diffusion
    assert (d.sampler, d.eta, d.train_steps.window_range, d.height, d.width) == (
        "dance_sde",
        0.3,
        (1, 5),
        32,
        64,
    )


def test_unknown_key_names_the_nearest():
    with pytest.raises(ConfigError) as err:
        validate(raw(noise_levle=0.9))
    msg = str(err.value)
    assert "unknown key 'diffusion.noise_levle'; did you mean 'noise_level'?" in msg
    assert "valid keys here: sampler, noise_level, eta" in msg


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("sampler", "sde", ["flow_sde", "dance_sde", "cps", "ode", "ddim"]),
        (
            "train_steps",
            {"type": "window"},
            ["all_but_last", "random_fraction", "random_window", "sliding_window"],
        ),
        ("objective", {"type": "nft"}, ["policy_gradient", "diffusion_nft", "awm"]),
        ("shared_noise", "on", ["off", "group"]),
        ("objective", {"ratio_norm": "guard"}, ["off", "grpo_guard"]),
        ("train_guidance", "cfg", ["same", "none"]),
    ],
)
def test_wrong_literal_names_the_key_and_the_allowed_values(field, value, allowed):
    with pytest.raises(ConfigError) as err:
        validate(raw(**{field: value}))
    msg = str(err.value)
    bad = (
        value["ratio_norm" if "ratio_norm" in value else "type"]
        if isinstance(value, dict)
        else value
    )
    assert f"diffusion.{field}" in msg and repr(bad) in msg
    for option in allowed:
        assert f"'{option}'" in msg


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"noise_level": -0.1}, r"diffusion\.noise_level: .*greater than or equal to 0"),
        ({"rollout_steps": 0}, r"diffusion\.rollout_steps: .*greater than or equal to 1"),
        ({"guidance_scale": 0.5}, r"diffusion\.guidance_scale: .*greater than or equal to 1"),
        (
            {"train_steps": {"type": "random_fraction", "fraction": 1.5}},
            r"diffusion\.train_steps\.fraction: .*less than or equal to 1",
        ),
        ({"adv_clip_max": 0}, r"diffusion\.adv_clip_max: .*greater than 0"),
    ],
)
def test_out_of_range_numbers_are_rejected(fields, match):
    with pytest.raises(ConfigError, match=match):
        validate(raw(**fields))


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"sampler": "ode"}, "sampler='ode' has no step log-probs"),
        ({"noise_level": 0.0}, "noise_level=0 is deterministic"),
        ({"sampler": "ddim", "eta": 0.0}, "eta=0 is deterministic"),
        ({"sampler": "cps", "noise_level": 1.2}, r"needs noise_level in \[0, 1\]"),
        (
            {"objective": {"type": "awm"}, "sampler": "ode", "adv_clip_max": None},
            "set adv_clip_max",
        ),
        (
            {"objective": {"type": "diffusion_nft", "ratio_norm": "grpo_guard"}},
            r"unknown key 'diffusion\.objective\.ratio_norm'.*of type 'diffusion_nft'",
        ),
        ({"rollout_steps": 1}, "needs rollout_steps >= 2"),
        (
            {"objective": {"type": "diffusion_nft"}, "sampler": "ode", "rollout_steps": 1},
            r"= 1\.\.0;",
        ),
        (
            {"objective": {"type": "awm", "timesteps": 13}, "rollout_steps": 14},
            r"= 1\.\.12; objective.timesteps=13",
        ),
        (
            {"train_steps": {"type": "random_window", "window_size": 7}, "rollout_steps": 6},
            r"\[0, 7\)",
        ),
        (
            {"train_steps": {"type": "sliding_window", "window_range": [2, 12]}},
            "does not fit rollout_steps=10",
        ),
    ],
)
def test_settings_that_cannot_work_together_fail_with_why(fields, match):
    with pytest.raises(ConfigError, match=match):
        validate(raw(**fields))


def test_combinations_that_do_work():
    ok = [
        {"objective": {"type": "awm", "timesteps": 6}, "sampler": "ode"},
        {"objective": {"type": "diffusion_nft"}, "sampler": "ode", "rollout_steps": 2},
        {"train_steps": {"type": "random_window", "window_size": 3}, "rollout_steps": 6},  # [0, 3)
        {"train_steps": {"type": "sliding_window", "window_size": 4}, "rollout_steps": 25},
        {"sampler": "cps", "noise_level": 1.0},
        {"sampler": "ddim", "eta": 1.0},
    ]
    for fields in ok:
        d = validate(raw(**fields)).diffusion
        for key, value in fields.items():
            got = getattr(d, key)
            if isinstance(value, dict):
                got = {k: getattr(got, k) for k in value}
            assert got == value, (fields, key)


def test_the_dotted_override_path_reaches_the_section():
    from grouprl.config.loading import apply_overrides

    cfg = validate(apply_overrides(raw(), ["diffusion.sampler=dance_sde", "diffusion.eta=0.25"]))
    assert (cfg.diffusion.sampler, cfg.diffusion.eta) == ("dance_sde", 0.25)


@pytest.mark.parametrize("model_type", ["flow", "unet"])
def test_per_sample_seeding_is_accepted_for_image_rollouts(model_type):
    """Image rollouts draw each group from torch's RNG seeded by (run.seed, group id)."""
    image = {
        "workload": {"type": "images"},
        "model": {"name_or_path": "tiny", "type": model_type},
        "task": {"name": "image_prompts"},
    }
    assert validate({**image, "rollout": {"seeding": "per_sample"}}).rollout.seeding == "per_sample"
    validate({**image, "rollout": {"seeding": "global"}})
    validate({**TEXT, "rollout": {"seeding": "per_sample"}})  # text: fine
