"""Typed component configs (issue 16, item 4) and the workload section (item 1, config side):
discriminated surrogates / flow objectives / step selection / models, older flat keys migrated with
a warning naming the new spelling, a section per workload (a toy workload registered here brings
its own), typed task options."""

from __future__ import annotations

import warnings
from typing import ClassVar

import pytest
from pydantic import BaseModel, ConfigDict, Field

from grouprl.config.loading import ConfigError, config_json, load_config, validate
from grouprl.config.migration import ConfigDeprecation
from grouprl.config.surrogates import SURROGATE_MODELS, SapoSurrogate
from grouprl.workloads.base import WORKLOADS, Capabilities, register

TEXT = {
    "workload": {"type": "text"},
    "model": {"name_or_path": "x"},
    "task": {"name": "arithmetic"},
}
IMAGES = {
    "workload": {"type": "images"},
    "model": {"type": "flow", "name_or_path": "x"},
    "task": {"name": "image_prompts"},
}


def quiet(raw: dict):
    """validate() that fails on any warning (the current spelling never warns)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return validate(raw)


# ---- algorithm.surrogate ---------------------------------------------------------------------


def test_each_surrogate_family_has_a_typed_model_with_descriptions():
    from grouprl.objectives.losses import SURROGATES

    assert set(SURROGATE_MODELS) == set(SURROGATES.names())
    for name, model in SURROGATE_MODELS.items():
        assert model.model_fields["type"].default == name
        for field, info in model.model_fields.items():
            assert info.description, (name, field)


def test_a_knob_of_another_surrogate_fails_naming_the_allowed_ones():
    raw = {**TEXT, "algorithm": {"surrogate": {"type": "sapo", "eps_high": 0.3}}}
    with pytest.raises(ConfigError) as err:
        validate(raw)
    msg = str(err.value)
    assert "unknown key 'algorithm.surrogate.eps_high'" in msg
    assert "valid keys here of type 'sapo': type, tau_pos, tau_neg" in msg
    with pytest.raises(ConfigError, match=r"algorithm\.surrogate\.tau_neg: .*greater than 0"):
        validate({**TEXT, "algorithm": {"surrogate": {"type": "sapo", "tau_neg": 0}}})
    with pytest.raises(ConfigError, match="'clip', 'cispo', 'sapo'"):  # an unknown type
        validate({**TEXT, "algorithm": {"surrogate": {"type": "ppo"}}})


def test_the_nested_surrogate_resolves_and_a_preset_fills_only_its_own_type():
    cfg = quiet({**TEXT, "algorithm": {"preset": "dapo", "surrogate": {"eps_low": 0.1}}})
    assert cfg.algorithm.surrogate.model_dump() == {
        "type": "clip", "eps_low": 0.1, "eps_high": 0.28, "dual_clip_c": None
    }  # fmt: skip
    other = quiet({**TEXT, "algorithm": {"preset": "gspo", "surrogate": {"type": "sapo"}}})
    assert other.algorithm.surrogate == SapoSurrogate()  # gspo's clip range is not carried over


@pytest.mark.parametrize(
    "flat, nested",
    [
        ({"preset": "dapo", "eps_high": 0.3}, {"preset": "dapo", "surrogate": {"eps_high": 0.3}}),
        (
            {"surrogate": "sapo", "sapo_tau_neg": 2.0},
            {"surrogate": {"type": "sapo", "tau_neg": 2.0}},
        ),
        (
            {"surrogate": "clip_cov", "clip_cov_ratio": 0.01, "eps_low": 0.1},
            {"surrogate": {"type": "clip_cov", "ratio": 0.01, "eps_low": 0.1}},
        ),
        (
            {"preset": "pmd_mean", "pmd_tau": 0.05},
            {"preset": "pmd_mean", "surrogate": {"tau": 0.05}},
        ),
    ],
)
def test_old_flat_surrogate_keys_migrate_with_a_warning_to_the_same_values(flat, nested):
    with pytest.warns(ConfigDeprecation, match=r"algorithm\.surrogate") as record:
        old = validate({**TEXT, "algorithm": flat})
    key = next(k for k in flat if k not in ("preset", "surrogate"))
    assert any(f"algorithm.{key} -> algorithm.surrogate." in str(w.message) for w in record)
    assert config_json(old) == config_json(quiet({**TEXT, "algorithm": nested}))


def test_a_flat_key_of_another_family_or_a_disagreeing_one_fails():
    with pytest.raises(ConfigError, match=r"algorithm\.sapo_tau_pos applies to surrogate 'sapo'"):
        validate({**TEXT, "algorithm": {"surrogate": "clip", "sapo_tau_pos": 1.0}})
    with pytest.raises(ConfigError, match="disagree"):
        validate({**TEXT, "algorithm": {"eps_high": 0.3, "surrogate": {"eps_high": 0.2}}})


def test_a_flat_override_on_a_new_form_yaml_migrates(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("workload: {type: text}\nmodel: {name_or_path: x}\ntask: {name: arithmetic}\n")
    with pytest.warns(ConfigDeprecation, match="algorithm.eps_high -> algorithm.surrogate"):
        cfg = load_config(path, ["algorithm.eps_high=0.3"])
    assert cfg.algorithm.surrogate.eps_high == 0.3
    assert load_config(path, ["algorithm.surrogate.eps_high=0.3"]) == cfg


# ---- diffusion.objective / diffusion.train_steps ------------------------------------------------


def test_old_flat_diffusion_keys_migrate_with_a_warning_to_the_same_values():
    flat = {"objective": "awm", "sampler": "ode", "awm_clip": 0.5, "lf_timesteps": 3,
            "train_steps": "random_window", "window_size": 3}  # fmt: skip
    nested = {"objective": {"type": "awm", "clip": 0.5, "timesteps": 3}, "sampler": "ode",
              "train_steps": {"type": "random_window", "window_size": 3}}  # fmt: skip
    with pytest.warns(
        ConfigDeprecation, match=r"diffusion\.awm_clip -> diffusion\.objective\.clip"
    ):
        old = validate({**IMAGES, "diffusion": flat})
    assert config_json(old) == config_json(quiet({**IMAGES, "diffusion": nested}))
    with pytest.raises(ConfigError, match=r"diffusion\.nft_beta applies to .*diffusion_nft"):
        validate({**IMAGES, "diffusion": {"objective": "awm", "nft_beta": 0.1}})


def test_a_knob_of_another_objective_or_step_selection_fails():
    with pytest.raises(ConfigError, match=r"'diffusion\.objective\.beta'.*of type 'awm'"):
        validate({**IMAGES, "diffusion": {"objective": {"type": "awm", "beta": 0.1}}})
    with pytest.raises(ConfigError, match=r"'diffusion\.train_steps\.window_size'.*all_but_last"):
        validate({**IMAGES, "diffusion": {"train_steps": {"window_size": 2}}})


# ---- the workload section ------------------------------------------------------------------------


def test_a_text_config_carries_no_image_or_agent_fields():
    cfg = quiet(TEXT)
    assert cfg.agent is None and cfg.diffusion is None and cfg.workload_settings is None
    dumped = config_json(cfg)
    assert "agent" not in dumped and "diffusion" not in dumped
    assert "negative_prompt" not in dumped["model"] and "condition" not in dumped["model"]


@pytest.mark.parametrize(
    "extra, key",
    [
        (
            {"agent": {"max_turns": 3}},
            r"section 'agent' \(agent\.max_turns\) applies to workload 'agent' only",
        ),
        (
            {"diffusion": {"noise_level": 0.5}},
            r"section 'diffusion' \(diffusion\.noise_level\) applies to workload 'images'",
        ),
        (
            {"model": {"name_or_path": "x", "negative_prompt": "blurry"}},
            "unknown key 'model.negative_prompt'",
        ),
    ],
)
def test_a_text_config_setting_an_agent_or_image_field_fails_naming_it(extra, key):
    with pytest.raises(ConfigError, match=key):
        validate({**TEXT, **extra})


def test_an_image_config_setting_a_text_model_field_fails():
    with pytest.raises(ConfigError, match="unknown key 'model.logprob_path'.*of type 'flow'"):
        validate(
            {**IMAGES, "model": {"type": "flow", "name_or_path": "x", "logprob_path": "plain"}}
        )


def test_the_workload_and_the_model_or_task_must_agree():
    with pytest.raises(ConfigError, match="workload 'images' needs model.type flow or unet"):
        validate({**IMAGES, "model": {"name_or_path": "x"}})
    with pytest.raises(ConfigError, match="workload: {type: agent}"):
        validate({**TEXT, "task": {"name": "env", "options": {"env_id": "x"}}})
    with pytest.raises(ConfigError, match=r"unknown workload 'imgaes'.*did you mean 'images'"):
        validate({**IMAGES, "workload": {"type": "imgaes"}})


@pytest.mark.parametrize(
    "raw, name",
    [
        ({"model": {"name_or_path": "x"}, "task": {"name": "arithmetic"}}, "text"),
        ({"model": {"name_or_path": "x", "type": "unet"}, "task": {"name": "image_prompts"}},
         "images"),
        ({"model": {"name_or_path": "x"}, "task": {"name": "env", "options": {"env_id": "x"}}},
         "agent"),
    ],
)  # fmt: skip
def test_older_yaml_without_a_workload_infers_it_with_one_note(raw, name):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = validate(raw)
    notes = [w for w in record if issubclass(w.category, ConfigDeprecation)]
    assert len(notes) == 1 and f"`workload: {{type: {name}}}`" in str(notes[0].message)
    assert cfg.workload.type == name
    assert (cfg.agent is not None) == (name == "agent")
    assert (cfg.diffusion is not None) == (name == "images")


class ToySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = Field(3, ge=1, description="How wide the toy is.")
    colour: str = Field("red", description="Its colour.")


class ToyWorkload:
    name: ClassVar[str] = "toy"
    capabilities: ClassVar[Capabilities] = Capabilities()
    settings: ClassVar[type[BaseModel]] = ToySettings


@pytest.fixture
def toy():
    register(ToyWorkload)
    yield ToyWorkload
    WORKLOADS.pop("toy", None)


def test_a_workload_registered_outside_grouprl_brings_its_own_section(toy, tmp_path):
    raw = {**TEXT, "workload": {"type": "toy"}, "toy": {"width": 5}}
    cfg = quiet(raw)
    assert cfg.workload_settings == ToySettings(width=5)
    assert cfg.agent is None and cfg.diffusion is None
    dumped = config_json(cfg)
    assert dumped["toy"] == {"width": 5, "colour": "red"}  # the resolved config carries it
    import yaml

    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(dumped))
    assert load_config(path).workload_settings == cfg.workload_settings  # and reloads
    with pytest.raises(ConfigError, match=r"toy\.widht.*allowed keys: width, colour"):
        validate({**raw, "toy": {"widht": 5}})
    with pytest.raises(ConfigError, match=r"toy\.width: .*greater than or equal to 1"):
        validate({**raw, "toy": {"width": 0}})
    with pytest.raises(ConfigError, match="section 'agent' applies to workload 'agent' only"):
        validate({**raw, "agent": {}})  # an empty section is refused too
    assert quiet({**TEXT, "workload": {"type": "toy"}}).workload_settings == ToySettings()
    with pytest.raises(ConfigError, match="unknown key 'toy'"):  # only the toy workload has it
        validate({**TEXT, "toy": {"width": 5}})


def test_built_in_workload_settings_are_their_sections():
    images = quiet(IMAGES)
    assert images.workload_settings is images.diffusion is not None


# ---- task options ------------------------------------------------------------------------------


def test_task_options_are_typed_per_task():
    cfg = quiet({**TEXT, "task": {"name": "arithmetic", "options": {"n_train": 16, "ops": "+"}}})
    assert cfg.task.options == {"n_train": 16, "ops": "+"}
    with pytest.raises(ConfigError) as err:
        validate({**TEXT, "task": {"name": "arithmetic", "options": {"n_trian": 16}}})
    msg = str(err.value)
    assert "unknown option 'n_trian' (did you mean 'n_train'?)" in msg
    assert "the options of 'arithmetic' are: seed, n_train, n_eval, ops" in msg
    with pytest.raises(ConfigError, match=r"option 'n_train': .*valid integer.*got 'many'"):
        validate({**TEXT, "task": {"name": "arithmetic", "options": {"n_train": "many"}}})
    with pytest.raises(ConfigError, match=r"option 'number_use': .*'at_most_once'"):
        validate({**TEXT, "task": {"name": "countdown", "options": {"number_use": "twice"}}})
    with pytest.raises(ConfigError, match="missing required option 'source'"):
        validate({**TEXT, "task": {"name": "math"}})
    with pytest.raises(ConfigError, match=r"unknown task 'arithmatic'.*did you mean 'arithmetic'"):
        validate({**TEXT, "task": {"name": "arithmatic"}})


def test_the_json_schema_shows_the_typed_parts_in_both_modes():
    import json

    from grouprl.config import Config

    for mode in ("validation", "serialization"):
        schema = json.dumps(Config.model_json_schema(mode=mode))
        for name in ("SapoSurrogate", "AwmObjective", "SlidingWindowSteps", "ImageModelConfig"):
            assert name in schema, (mode, name)
