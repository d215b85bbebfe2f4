"""Run config: presets fill unset fields, dotted overrides, readable errors, combination checks."""

from __future__ import annotations

import warnings

import pytest
import yaml

from grouprl.config.algorithm import AlgorithmConfig
from grouprl.config.loading import (
    Config,
    ConfigError,
    apply_overrides,
    load_config,
    save_resolved,
    validate,
)
from grouprl.config.presets import PRESETS, preset_settings


def minimal() -> dict:
    """The smallest valid raw config: the two required sections with their required keys."""
    return {
        "workload": {"type": "text"},
        "model": {"name_or_path": "tiny"},
        "task": {"name": "arithmetic"},
    }


def with_algorithm(**fields) -> dict:
    return {**minimal(), "algorithm": fields}


def write_yaml(tmp_path, raw, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


# ---- a minimal config --------------------------------------------------------------------------


def test_minimal_config_takes_defaults():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default config must not warn
        cfg = validate(minimal())
    assert isinstance(cfg, Config)
    assert cfg.model.name_or_path == "tiny"
    assert cfg.model.lora is None
    assert cfg.task.name == "arithmetic"
    assert cfg.rewards == []
    assert cfg.rollout.group_size == 8 and cfg.rollout.prompts_per_step == 8
    assert cfg.algorithm.preset == "grpo"
    assert cfg.train.lr == 1e-5
    assert cfg.run.log_backends == ["jsonl"]
    assert str(cfg.run_dir) == "runs/run"


def test_required_keys_are_named():
    with pytest.raises(ConfigError, match=r"missing required key 'model'"):
        validate({"task": {"name": "arithmetic"}})
    with pytest.raises(ConfigError, match=r"missing required key 'model\.name_or_path'"):
        validate({"model": {}, "task": {"name": "arithmetic"}})


# ---- presets -----------------------------------------------------------------------------------


def for_preset(name: str) -> dict:
    """A minimal config of the workload the preset is for (its section settings name it)."""
    sections = {key.split(".")[0] for key in preset_settings(name, sections=True)}
    if "diffusion" in sections:
        return {
            "workload": {"type": "images"},
            "model": {"name_or_path": "tiny", "type": "flow"},
            "task": {"name": "image_prompts"},
        }
    if "agent" in sections:
        return {
            "workload": {"type": "agent"},
            "model": {"name_or_path": "tiny"},
            "task": {"name": "env", "options": {"env_id": "grouprl/FrozenLake-v0"}},
        }
    return minimal()


def preset_algorithm(name: str) -> dict:
    """{"preset": name}, plus the teacher folder a distillation preset cannot carry itself."""
    if "distill" in preset_settings(name):
        return {"preset": name, "distill": {"teacher": "teacher-folder"}}
    return {"preset": name}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_applies_its_settings(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no preset may trip its own combination checks
        cfg = validate({**for_preset(name), "algorithm": preset_algorithm(name)})
    settings = preset_settings(name)
    assert settings, name
    for key, value in settings.items():
        if key in ("surrogate", "distill"):  # a mapping: its type and knobs
            got = getattr(cfg.algorithm, key).model_dump()
            assert got == {**got, **value}, name
            continue
        assert getattr(cfg.algorithm, key) == value, (name, key)
    assert cfg.algorithm.preset == name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_fields_a_preset_leaves_out_keep_the_defaults(name):
    cfg = validate(with_algorithm(**preset_algorithm(name)))
    defaults = AlgorithmConfig.model_fields
    for key, field in defaults.items():
        if key == "preset" or key in preset_settings(name):
            continue
        assert getattr(cfg.algorithm, key) == field.get_default(call_default_factory=True), key


def test_explicit_fields_override_the_preset():
    # dapo sets eps_high 0.28, token_mean and zero_variance; the user's values win
    cfg = validate(
        with_algorithm(
            preset="dapo", surrogate={"eps_high": 0.5}, aggregation="seq_mean_token_mean", epochs=2
        )
    )
    a = cfg.algorithm
    assert (a.surrogate.eps_high, a.aggregation, a.epochs) == (0.5, "seq_mean_token_mean", 2)
    # the rest of the preset still applies
    assert (a.surrogate.eps_low, a.dynamic_sampling, a.overlong_shaping) == (
        0.2, "zero_variance", "soft"
    )  # fmt: skip
    assert a.max_sampling_rounds == 10


def test_differing_presets_really_differ():
    # guards against a validator that ignores `preset`: gspo's clip range is not grpo's
    grpo = validate(with_algorithm(preset="grpo")).algorithm
    gspo = validate(with_algorithm(preset="gspo")).algorithm
    g, s = grpo.surrogate, gspo.surrogate
    assert (grpo.ratio_level, g.eps_low, g.eps_high) == ("token", 0.2, 0.2)
    assert (gspo.ratio_level, s.eps_low, s.eps_high) == ("sequence", 3e-4, 4e-4)


def test_unknown_preset_names_the_nearest():
    with pytest.raises(ConfigError, match=r"unknown preset 'dapoo'.*did you mean 'dapo'"):
        validate(with_algorithm(preset="dapoo"))


# ---- dotted overrides --------------------------------------------------------------------------


def test_load_config_with_dotted_overrides(tmp_path):
    raw = {
        **minimal(),
        "algorithm": {"surrogate": {"eps_high": 0.3}},
        "train": {"lr": 1e-3, "steps": 7},
    }
    path = write_yaml(tmp_path, raw)
    cfg = load_config(path, ["algorithm.preset=dapo", "train.lr=1e-4", "rollout.stop=['\\n']"])
    # the overridden preset fills unset fields; the YAML's explicit eps_high still wins
    assert cfg.algorithm.preset == "dapo"
    assert cfg.algorithm.aggregation == "token_mean"
    assert cfg.algorithm.dynamic_sampling == "zero_variance"
    assert cfg.algorithm.surrogate.eps_high == 0.3
    # PyYAML reads 1e-4 as a string (YAML 1.1 wants a dot); pydantic turns it into the float
    assert cfg.train.lr == pytest.approx(1e-4) and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 7  # untouched keys of an overridden section stay
    # YAML single quotes do not process escapes: '\n' is a backslash and an n, not a newline
    assert cfg.rollout.stop == ["\\n"]


def test_double_quoted_override_gives_a_newline():
    cfg = load_config(
        None, ["model.name_or_path=tiny", "task.name=countdown", 'rollout.stop=["\\n"]']
    )
    assert cfg.rollout.stop == ["\n"]
    assert cfg.task.name == "countdown"


def test_override_values_are_typed_by_yaml():
    raw = apply_overrides({}, ["a.b=3", "a.c=true", "a.d=[1, 2]", "a.e=", "f=x=y", "a.g.h=null"])
    assert raw == {"a": {"b": 3, "c": True, "d": [1, 2], "e": "", "g": {"h": None}}, "f": "x=y"}


def test_override_without_equals_sign_errors():
    with pytest.raises(ConfigError, match=r"must look like dotted\.key=value"):
        apply_overrides({}, ["train.lr"])


def test_override_through_a_value_errors():
    with pytest.raises(ConfigError, match=r"'name_or_path' is not a section"):
        apply_overrides(minimal(), ["model.name_or_path.x=1"])


def test_override_of_unknown_key_is_caught():
    with pytest.raises(ConfigError, match=r"unknown key 'train\.lrr'; did you mean 'lr'"):
        load_config(None, ["model.name_or_path=tiny", "task.name=math", "train.lrr=1e-4"])


# ---- unknown keys and wrong values -------------------------------------------------------------


def test_unknown_top_level_key_names_the_nearest():
    with pytest.raises(ConfigError) as err:
        validate({**minimal(), "algorithim": {}})
    msg = str(err.value)
    assert "unknown key 'algorithim'; did you mean 'algorithm'?" in msg
    assert "valid keys here: run, workload, model, task" in msg


@pytest.mark.parametrize(
    "raw_patch, where, nearest",
    [
        ({"model": {"name_or_path": "tiny", "lora": {"rr": 4}}}, "model.lora.rr", "r"),
        (
            {"algorithm": {"surrogate": {"type": "clip", "eps_hgih": 0.3}}},
            "algorithm.surrogate.eps_hgih",
            "eps_high",
        ),
        ({"rollout": {"groupsize": 4}}, "rollout.groupsize", "group_size"),
        ({"rewards": [{"name": "accuracy", "wieght": 2.0}]}, "rewards.0.wieght", "weight"),
    ],
)
def test_unknown_nested_key_names_the_nearest(raw_patch, where, nearest):
    with pytest.raises(ConfigError, match=rf"unknown key '{where}'; did you mean '{nearest}'\?"):
        validate({**minimal(), **raw_patch})


def test_unknown_key_without_a_near_match_lists_the_valid_keys():
    with pytest.raises(ConfigError) as err:
        validate({**minimal(), "checkpoint": {"zzzzzz": 1}})
    msg = str(err.value)
    assert "unknown key 'checkpoint.zzzzzz' (valid keys here: every, keep_last)" in msg
    assert "did you mean" not in msg


def test_wrong_literal_value_names_the_allowed_values():
    with pytest.raises(ConfigError) as err:
        validate(with_algorithm(advantage="grpoo"))
    msg = str(err.value)
    assert "algorithm.advantage" in msg and "(got 'grpoo')" in msg
    for allowed in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg", "grpo_passk"):
        assert f"'{allowed}'" in msg


def test_wrong_literal_in_a_list_names_the_slot_and_allowed_values():
    with pytest.raises(
        ConfigError, match=r"run\.log_backends\.1: .*'jsonl', 'tensorboard' or 'wandb'"
    ):
        validate({**minimal(), "run": {"log_backends": ["jsonl", "tb"]}})


def test_out_of_range_number_is_rejected():
    with pytest.raises(ConfigError, match=r"rollout\.temperature: .*greater than 0"):
        validate({**minimal(), "rollout": {"temperature": 0}})


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        validate({**minimal(), "train": {"lrr": 1}, "rollout": {"top_p": 2}})
    msg = str(err.value)
    assert "train.lrr" in msg and "rollout.top_p" in msg


# ---- combination checks ------------------------------------------------------------------------


def test_group_size_one_with_a_group_baseline_explains_why():
    with pytest.raises(ConfigError) as err:
        validate({**minimal(), "rollout": {"group_size": 1}})
    msg = str(err.value)
    assert "group_size=1" in msg and "advantage='grpo'" in msg
    assert "advantage 0" in msg and "group_size >= 2" in msg


def test_minibatches_must_divide_the_batch():
    raw = {**minimal(), "rollout": {"prompts_per_step": 3, "group_size": 4}}
    cfg = validate({**raw, "algorithm": {"minibatches": 6}})  # 12 samples / 6: fine
    assert cfg.algorithm.minibatches == 6
    with pytest.raises(ConfigError, match=r"minibatches=5 must divide .* = 12 samples"):
        validate({**raw, "algorithm": {"minibatches": 5}})


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
)
def test_sequence_ratio_with_token_style_aggregation_warns(aggregation):
    with pytest.warns(UserWarning, match=r"ratio_level='sequence' \(GSPO\)"):
        cfg = validate(with_algorithm(preset="gspo", aggregation=aggregation))
    assert cfg.algorithm.aggregation == aggregation  # a warning, not an error


def test_sapo_outside_seq_mean_token_mean_warns():
    with pytest.warns(UserWarning, match="SAPO"):
        validate(with_algorithm(preset="sapo", aggregation="token_mean"))


def test_dr_grpo_with_a_std_scale_warns():
    with pytest.warns(UserWarning, match="never divides by the std"):
        validate(with_algorithm(preset="dr_grpo", scale="group"))


def test_normalize_then_sum_needs_grpo_group():
    with pytest.raises(ConfigError, match=r"normalize_then_sum.*got 'rloo' / 'group'"):
        validate(with_algorithm(preset="rloo", reward_aggregation="normalize_then_sum"))
    with pytest.raises(ConfigError, match=r"got 'grpo' / 'batch'"):
        validate(with_algorithm(reward_aggregation="normalize_then_sum", scale="batch"))
    cfg = validate(with_algorithm(reward_aggregation="normalize_then_sum"))
    assert cfg.algorithm.reward_aggregation == "normalize_then_sum"


# ---- files -------------------------------------------------------------------------------------


def test_save_resolved_round_trips(tmp_path):
    raw = {
        **minimal(),
        "model": {"name_or_path": "tiny", "lora": {"r": 4}},
        "rewards": [{"name": "accuracy", "weight": 2.0, "options": {"k": [1, 2]}}],
        "rollout": {"stop": ["\n", "</answer>"], "group_size": 4},
        "algorithm": {"preset": "dapo", "surrogate": {"eps_high": 0.3}},
        "train": {"betas": [0.8, 0.95]},
    }
    cfg = validate(raw)
    out = tmp_path / "run" / "config.yaml"  # the parent folder does not exist yet
    save_resolved(cfg, out)
    assert out.is_file() and not out.with_suffix(".tmp").exists()
    written = yaml.safe_load(out.read_text())
    # every preset value is spelled out, so the file no longer depends on the preset table
    assert written["algorithm"]["dynamic_sampling"] == "zero_variance"
    assert written["algorithm"]["surrogate"] == {
        "type": "clip", "eps_low": 0.2, "eps_high": 0.3, "dual_clip_c": None
    }  # fmt: skip
    assert written["run"]["seed"] == 0
    again = load_config(out)
    assert again == cfg
    assert again.train.betas == (0.8, 0.95)
    assert again.rollout.stop == ["\n", "</answer>"]


def test_missing_config_file_errors(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"config file .*nope\.yaml' does not exist"):
        load_config(missing)


def test_non_mapping_yaml_errors(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- task\n")
    with pytest.raises(ConfigError, match="must hold a mapping at the top level"):
        load_config(path)


def test_empty_yaml_file_is_an_empty_mapping(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    with pytest.raises(ConfigError, match="missing required key 'model'"):
        load_config(path)
    cfg = load_config(path, ["model.name_or_path=tiny", "task.name=countdown"])
    assert cfg.task.name == "countdown"


def test_run_config_files_keep_what_the_user_set_apart_from_what_was_filled(tmp_path):
    from grouprl.config.loading import save_run_config, user_settings

    raw = {**minimal(), "algorithm": {"preset": "dapo", "surrogate": {"eps_high": 0.3}},
           "run": {"resume": True, "output_dir": str(tmp_path)}, "train": {"betas": (0.8, 0.9)}}  # fmt: skip
    cfg = validate(raw)
    cfg.train.lr = 0.5  # changed on the object after validation: also the user's
    assert user_settings(cfg) == {
        **minimal(), "algorithm": {"preset": "dapo", "surrogate": {"eps_high": 0.3}},
        "run": {"resume": True, "output_dir": str(tmp_path)}, "train": {"betas": [0.8, 0.9], "lr": 0.5},
    }  # fmt: skip
    save_run_config(cfg, tmp_path)
    mine = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert "resume" not in mine["run"]  # per-invocation flags are not settings of the run
    assert mine["algorithm"] == {"preset": "dapo", "surrogate": {"eps_high": 0.3}}
    resolved = yaml.safe_load((tmp_path / "config.resolved.yaml").read_text())
    assert resolved["algorithm"]["dynamic_sampling"] == "zero_variance"
    again = load_config(tmp_path / "config.yaml", ["run.resume=true"])
    assert again == cfg
    other = load_config(tmp_path / "config.yaml", ["algorithm.preset=grpo"])
    assert other.algorithm.dynamic_sampling == "off" and other.algorithm.surrogate.eps_high == 0.3
