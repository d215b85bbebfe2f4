"""The command line: bad input exits with status 2 and one clear message on stderr, no traceback."""

import json
import math

import pytest
import yaml

import grouprl.train as train_mod
import grouprl.workloads.tokens as tokens_mod
from grouprl.cli import main
from grouprl.config.loading import ConfigError
from grouprl.types import LossOutput


@pytest.fixture
def config_file(tmp_path, tiny_model_dir):
    """A tiny, fast, valid config file; tests break one thing at a time with overrides."""
    raw = {
        "run": {"name": "run", "output_dir": str(tmp_path / "runs"), "device": "cpu",
                "console": False},
        "model": {"name_or_path": str(tiny_model_dir)},
        "task": {"name": "arithmetic",
                 "options": {"n_train": 8, "n_eval": 4, "ops": "+", "max_value": 9}},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3},
        "train": {"steps": 1, "lr": 1e-3},
    }  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_cli(capsys, *argv):
    """main(argv) -> (exit status, stdout, stderr)."""
    capsys.readouterr()  # only main's own output (not earlier runs' notes)
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_clear_error(status, err, *fragments):
    assert status == 2
    assert err.startswith("grouprl: error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_unknown_key_suggests_the_nearest(capsys, config_file):
    status, out, err = run_cli(capsys, "train", config_file, "train.lrr=1e-3")
    assert_one_clear_error(status, err, "unknown key 'train.lrr'", "did you mean 'lr'?")
    assert out == ""


def test_unknown_key_in_the_file(capsys, config_file, tmp_path):
    raw = yaml.safe_load(config_file.read_text())
    raw["rollout"]["group_sise"] = 4
    config_file.write_text(yaml.safe_dump(raw))
    status, _, err = run_cli(capsys, "train", config_file)
    assert_one_clear_error(status, err, "'rollout.group_sise'", "did you mean 'group_size'?")
    assert not (tmp_path / "runs").exists()  # nothing is created for an invalid config


def test_unknown_preset_suggests_the_nearest(capsys, config_file):
    status, _, err = run_cli(capsys, "train", config_file, "algorithm.preset=grpoo")
    assert_one_clear_error(status, err, "'grpoo'", "'grpo'")


def test_wrong_value_names_the_allowed_ones(capsys, config_file):
    status, _, err = run_cli(capsys, "train", config_file, "algorithm.kl_mode=both")
    assert_one_clear_error(status, err, "algorithm.kl_mode", "'loss'", "'reward'", "both")


def test_missing_config_file(capsys, tmp_path):
    status, _, err = run_cli(capsys, "train", tmp_path / "nope.yaml")
    assert_one_clear_error(status, err, "nope.yaml", "does not exist")
    assert err.count("\n") == 1


def test_missing_model_path(capsys, config_file, tmp_path):
    missing = tmp_path / "no_such_model"
    status, _, err = run_cli(capsys, "train", config_file, f"model.name_or_path={missing}")
    assert_one_clear_error(status, err, str(missing), "does not exist")
    assert err.count("\n") == 1


def test_model_dir_without_config_json(capsys, config_file, tmp_path):
    empty = tmp_path / "empty_model"
    empty.mkdir()
    status, _, err = run_cli(capsys, "train", config_file, f"model.name_or_path={empty}")
    assert_one_clear_error(status, err, "no config.json")


def _math_task(config_file, data_path, **options):
    raw = yaml.safe_load(config_file.read_text())
    raw["task"] = {"name": "math", "options": {"source": str(data_path), **options}}
    config_file.write_text(yaml.safe_dump(raw))


def test_math_task_empty_file(capsys, config_file, tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("\n")
    _math_task(config_file, data)
    status, _, err = run_cli(capsys, "train", config_file)
    assert_one_clear_error(status, err, "empty.jsonl", "has no rows")
    assert err.count("\n") == 1


def test_math_task_missing_column(capsys, config_file, tmp_path):
    data = tmp_path / "problems.jsonl"
    rows = [{"problem": "1+1?", "solution": "2"}, {"problem": "2+3?", "solution": "5"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _math_task(config_file, data)
    status, _, err = run_cli(capsys, "train", config_file)
    assert_one_clear_error(
        status, err, "column 'question'", "problems.jsonl", "['problem', 'solution']"
    )
    # naming the columns makes the same file work as far as loading goes
    _math_task(config_file, data, question_column="problem", answer_column="solution")
    status, _, err = run_cli(capsys, "train", config_file, "task.options.max_train=2")
    assert status == 0, err


def test_math_task_bad_json_line(capsys, config_file, tmp_path):
    data = tmp_path / "broken.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n{"question": \n')
    _math_task(config_file, data)
    status, _, err = run_cli(capsys, "train", config_file)
    assert_one_clear_error(status, err, "broken.jsonl", "line 2")


def test_unknown_task_option(capsys, config_file):
    status, _, err = run_cli(capsys, "train", config_file, "task.options.n_trian=3")
    assert_one_clear_error(status, err, "n_trian", "n_train")


def test_success_then_existing_run_dir_is_refused(capsys, config_file, tmp_path):
    status, out, err = run_cli(capsys, "train", config_file)
    assert status == 0, err
    run_dir = tmp_path / "runs" / "run"
    assert "held-out accuracy before:" in out and "held-out accuracy after:" in out
    assert f"run directory: {run_dir}" in out
    metrics = (run_dir / "metrics.jsonl").read_text()

    status, _, err = run_cli(capsys, "train", config_file)
    assert_one_clear_error(status, err, "already holds a run", "run.resume=true", "run.overwrite")
    assert err.count("\n") == 1
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # the earlier run is untouched


def test_infinite_reward_is_reported(capsys, config_file, tmp_path):
    (tmp_path / "bad_reward.py").write_text(
        "def infinite(completions, **_):\n    return [float('inf')] * len(completions)\n"
    )
    raw = yaml.safe_load(config_file.read_text())
    raw["rewards"] = [{"name": f"{tmp_path / 'bad_reward.py'}:infinite"}]
    config_file.write_text(yaml.safe_dump(raw))
    status, _, err = run_cli(capsys, "train", config_file)
    assert_one_clear_error(status, err, "'infinite' returned inf", "finite number or None")


def test_non_finite_loss_is_reported(capsys, config_file, tmp_path, monkeypatch):
    real = tokens_mod.total_loss

    def nan_loss(*args, **kwargs):
        res = real(*args, **kwargs)
        return LossOutput(loss=res.loss * math.nan, metrics=res.metrics)

    monkeypatch.setattr(tokens_mod, "total_loss", nan_loss)
    # each NaN update is skipped; max_nonfinite_steps in a row stop the run (here the first)
    status, _, err = run_cli(capsys, "train", config_file, "train.max_nonfinite_steps=1")
    assert_one_clear_error(status, err, "non-finite loss", "no non-finite value was saved")
    ckpts = tmp_path / "runs" / "run" / "checkpoints"
    assert not any(p.name.startswith("step-") for p in ckpts.iterdir())


def test_debug_env_shows_the_exception(config_file, monkeypatch):
    monkeypatch.setenv("GROUPRL_DEBUG", "1")
    with pytest.raises(ConfigError, match="did you mean 'lr'"):
        main(["train", str(config_file), "train.lrr=1"])


YAML_OFF_BUG = (
    "YAML 1.1 reads off/on/yes/no as booleans, so the documented option value 'off' "
    "(dynamic_sampling, overlong_shaping) is refused unless quoted"
)


def test_off_is_a_string_in_overrides(capsys, config_file):
    from grouprl.config.loading import load_config

    cfg = load_config(config_file, ["algorithm.preset=dapo", "algorithm.dynamic_sampling=off"])
    assert cfg.algorithm.dynamic_sampling == "off"


def test_off_is_a_string_in_files(config_file):
    from grouprl.config.loading import load_config

    config_file.write_text(config_file.read_text() + "algorithm:\n  overlong_shaping: off\n")
    assert load_config(config_file).algorithm.overlong_shaping == "off"


def test_image_runs_print_the_held_out_reward_not_a_nan_accuracy(capsys, config_file, monkeypatch):
    """An image run's evaluation has a mean reward and no accuracy: the summary printed
    "held-out pickscore before: nan%" before."""
    result = {"accuracy_key": "pickscore", "before": {"reward": 0.2125}, "after": {"reward": 0.25},
              "run_dir": "runs/x"}  # fmt: skip
    monkeypatch.setattr(train_mod, "train", lambda cfg: result)
    status, out, err = run_cli(capsys, "train", config_file)
    assert status == 0, err
    assert "held-out reward before: 0.2125" in out and "held-out reward after: 0.2500" in out
    assert "nan" not in out
