"""The Python API: `Trainer(config, policy=..., reward_fns=..., dataset=..., env=...)`, its
`.train()` / `.evaluate()`, the parts it takes as objects or strings, the errors when the config
names a part too, and `grouprl eval CONFIG_OR_RUN`."""

from __future__ import annotations

import copy
import json
import runpy
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl import Trainer, load_config
from grouprl.cli import main
from grouprl.config.loading import validate
from grouprl.envs.frozenlake import TextFrozenLakeEnv
from grouprl.envs.rewards.health import RewardFailedWarning
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.tiny import char_tokenizer, tiny_qwen2
from grouprl.train import train

ROOT = Path(__file__).resolve().parents[1]

# a tiny single-turn run whose task, rewards and model the tests give in various forms
RUN = {
    "run": {"name": "run", "seed": 0, "device": "cpu", "console": False},
    "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3},
    "train": {"steps": 2, "lr": 1e-3},
}  # fmt: skip
ARITHMETIC = {"name": "arithmetic", "options": {"n_train": 8, "n_eval": 4, "ops": "+",
                                                "max_value": 9}}  # fmt: skip
# a built-in reward that varies within the groups of a random tiny model: a digit anywhere
HAS_DIGIT = [{"name": "format", "options": {"pattern": "[0-9]", "match": "search"}}]
ROWS = [{"prompt": f"{a}+{b}=", "target": str(a + b)} for a in range(4) for b in range(3)]


def run_cfg(out_dir, **sections) -> dict:
    raw = copy.deepcopy(RUN)
    raw["run"]["output_dir"] = str(out_dir)
    raw.update(copy.deepcopy(sections))
    return raw


def exact_sum(completions, target, **_):
    """1 for a completion that starts with the row's `target` column."""
    return [float(c.strip().startswith(t)) for c, t in zip(completions, target)]


def digits(completions, **_):
    """The share of digit characters: varies between completions of a random tiny model."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def final_weights(run_dir) -> dict:
    ckpt = sorted((Path(run_dir) / "checkpoints").glob("step-*"))[-1]
    return load_file(ckpt / "model" / "model.safetensors")


def run_cli(capsys, *argv):
    capsys.readouterr()  # only main's own output (not earlier runs' notes)
    status = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


# ---- each kind of object, each checked against its config-made counterpart ----------------------


def test_model_given_as_object_trains_as_the_config_would(tmp_path, tiny_model_dir, capsys):
    """The same run three ways: model.name_or_path in the config (what `grouprl train` does),
    policy= the path string, policy= the transformers model + tokenizer objects. Same numbers,
    same trained weights; the object run's config.yaml records the model as "<python>:...", and
    `grouprl eval RUN` evaluates its checkpoint (the model folder) to the run's final numbers."""
    by_config = train(validate(run_cfg(tmp_path / "a", task=ARITHMETIC, rewards=HAS_DIGIT,
                                       model={"name_or_path": str(tiny_model_dir)})))  # fmt: skip
    by_name = Trainer(run_cfg(tmp_path / "b", task=ARITHMETIC, rewards=HAS_DIGIT),
                      policy=str(tiny_model_dir))  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    by_object = Trainer(run_cfg(tmp_path / "c", task=ARITHMETIC, rewards=HAS_DIGIT), policy=model,
                        tokenizer=tokenizer)  # fmt: skip
    results = [by_config, by_name.train(), by_object.train()]
    for result in results[1:]:
        assert result["before"] == by_config["before"] and result["after"] == by_config["after"]
    weights = [final_weights(r["run_dir"]) for r in results]
    for other in weights[1:]:
        assert other.keys() == weights[0].keys()
        assert all(torch.equal(other[k], weights[0][k]) for k in weights[0])
    initial = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert not all(torch.equal(initial[k], weights[0][k]) for k in initial)  # it did train
    assert by_object.policy.model is model  # the object itself was trained
    saved = yaml.safe_load((tmp_path / "c" / "run" / "config.yaml").read_text())
    assert saved["model"] == {"name_or_path": "<python>:Qwen2ForCausalLM", "dtype": "float32"}

    status, out, _ = run_cli(capsys, "eval", tmp_path / "c" / "run", "--json")
    assert status == 0
    assert json.loads(out)["metrics"] == by_config["after"]


def test_callable_reward_and_list_dataset(tmp_path, tiny_model, capsys):
    """A reward function and a list of dicts: the function is called with the prompts, the
    completions and the rows' columns; .evaluate() after .train() reproduces the run's final
    held-out numbers (greedy), and the config records both objects."""
    calls = []

    def reward_sum(prompts, completions, target, **kwargs):
        calls.append((list(prompts), list(target), kwargs["completion_lengths"]))
        return exact_sum(completions, target)

    trainer = Trainer(run_cfg(tmp_path), policy=tiny_model, tokenizer=char_tokenizer(),
                      reward_fns=[reward_sum, digits], reward_weights={"digits": 0.5},
                      dataset=ROWS, eval_dataset=ROWS[:4])  # fmt: skip
    assert trainer.config.task.name == "prompts"
    before = trainer.evaluate()
    result = trainer.train()
    assert result["accuracy_key"] == "reward_sum" and result["before"] == before
    assert trainer.evaluate() == result["after"]
    prompts, targets, _ = calls[-1]
    rows = {r["prompt"]: r["target"] for r in ROWS}
    assert [rows[p] for p in prompts] == targets  # each completion with its own row's column
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
               if x]  # fmt: skip
    assert any("reward/digits" in m for m in metrics)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["rewards"] == [{"name": "<python>:reward_sum", "weight": 1.0},
                                {"name": "<python>:digits", "weight": 0.5}]  # fmt: skip
    assert saved["task"] == {"name": "prompts", "options": {
        "source": "<python>:list of 12 rows", "eval_source": "<python>:list of 4 rows"}}  # fmt: skip
    status, _, err = run_cli(capsys, "eval", tmp_path / "run")  # the rows are not in its files
    assert status == 2 and "task.options.source: <python>:list of 12 rows" in err


def test_reward_errors_are_counted_as_for_config_rewards(tmp_path, tiny_model):
    """Given functions are scored as `module:function` rewards are: a batch that raises is
    retried per sample, a sample that raises costs that sample (counted in reward_errors/...),
    a reward failing on every sample is reported by the reward-health check."""

    def per_sample(completions, **_):
        if len(completions) > 1:
            raise ValueError("one at a time")
        return [1.0]

    def broken(completions, **_):
        raise ValueError("always")

    trainer = Trainer(run_cfg(tmp_path, train={"steps": 1, "lr": 1e-3}), policy=tiny_model,
                      tokenizer=char_tokenizer(), reward_fns={"ok": per_sample,
                      "broken": broken}, dataset=ROWS)  # fmt: skip
    with pytest.warns(RewardFailedWarning, match="reward 'broken' failed on all 4 samples"):
        trainer.train()
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["reward_errors/ok"] == 0.0 and step["reward_errors/broken"] == 4.0
    assert step["reward/ok"] == 1.0


def test_datasets_dataset_evaluates_as_the_list(tmp_path, tiny_model_dir):
    """A datasets.Dataset gives the same task as the list of its rows."""
    model_cfg = run_cfg(tmp_path, model={"name_or_path": str(tiny_model_dir)})
    as_list = Trainer(model_cfg, reward_fns=exact_sum, dataset=ROWS, eval_dataset=ROWS)
    as_dataset = Trainer(model_cfg, reward_fns=exact_sum, dataset=Dataset.from_list(ROWS),
                         eval_dataset=Dataset.from_list(ROWS))  # fmt: skip
    first = as_list.evaluate()
    assert first == as_dataset.evaluate() and set(first) == {"accuracy", "response_length"}
    assert as_dataset.config.task.options["source"] == "<python>:Dataset of 12 rows"
    with pytest.raises(ValueError, match="row 1 of <list of 2 rows passed from Python> is a str"):
        Trainer(model_cfg, reward_fns=exact_sum, dataset=[{"prompt": "a"}, "b"]).evaluate()
    with pytest.raises(ValueError, match="column 'prompt' is not in"):
        Trainer(model_cfg, reward_fns=exact_sum, dataset=[{"question": "a"}]).evaluate()


def test_ready_policy_object(tmp_path, tiny_model):
    """A grouprl policy object is used as it is: it evaluates as the model it wraps, and
    train() trains it."""
    policy = CausalLMPolicy(tiny_model, char_tokenizer(), engine="fast")
    parts = dict(reward_fns=digits, dataset=ROWS, eval_dataset=ROWS)
    trainer = Trainer(run_cfg(tmp_path / "a", train={"steps": 1}), policy=policy, **parts)
    assert trainer.policy is policy and trainer.config.model.dtype == "float32"
    other = Trainer(run_cfg(tmp_path / "b"), policy=tiny_qwen2(char_tokenizer()),
                    tokenizer=char_tokenizer(), **parts)  # fmt: skip
    assert trainer.evaluate() == other.evaluate()
    initial = [p.detach().clone() for p in tiny_model.parameters()]
    trainer.train()
    assert not all(torch.equal(a, b) for a, b in zip(initial, tiny_model.parameters()))


def env_factory():
    return TextFrozenLakeEnv(max_steps=3)


AGENT = {
    "agent": {"max_turns": 2, "max_turn_tokens": 6, "max_total_tokens": 400},
    "rollout": {"prompts_per_step": 2, "group_size": 2, "stop": ["</action>"]},
    "algorithm": {"preset": "gigpo", "kl_coef": 0.0},
    "train": {"steps": 1, "lr": 1e-3},
}


def test_env_factory_runs_an_agent_as_the_env_id_does(tmp_path, tiny_model_dir):
    """env= a callable returning a text env trains the same agent as the registered id with the
    same settings; the config names the task `env` and records the factory."""
    calls = []

    def counted():
        calls.append(1)
        return env_factory()

    options = {"n_eval": 2}
    by_id = Trainer(run_cfg(tmp_path / "a", task={"name": "env", "options": {
        **options, "env_kwargs": {"max_steps": 3}}}, **AGENT), policy=str(tiny_model_dir),
        env="grouprl/FrozenLake-v0").train()  # fmt: skip
    trainer = Trainer(run_cfg(tmp_path / "b", task={"options": options}, **AGENT),
                      policy=str(tiny_model_dir), env=counted)  # fmt: skip
    result = trainer.train()
    assert calls and result["accuracy_key"] == "success"
    assert result["before"] == by_id["before"] and result["after"] == by_id["after"]
    assert trainer.evaluate() == result["after"]
    saved = yaml.safe_load((tmp_path / "b" / "run" / "config.yaml").read_text())
    assert saved["task"]["name"] == "env"
    assert saved["task"]["options"]["env_id"].startswith("<python>:")
    assert saved["task"]["options"]["env_id"].endswith("counted")


# ---- what may not be given twice, or at all -------------------------------------------------------


@pytest.mark.parametrize(
    ("sections", "kwargs", "message"),
    [
        ({"rewards": [{"name": "format"}]}, {"reward_fns": digits},
         r"config sets rewards=\['format'\] and Trainer was given reward_fns="),
        ({"model": {"name_or_path": "some/model"}}, {"policy": "MODEL"},
         r"config sets model.name_or_path='some/model' and Trainer was given policy="),
        ({"task": {"name": "prompts", "options": {"source": "data.jsonl"}}}, {"dataset": ROWS},
         r"config sets task.options.source='data.jsonl' and Trainer was given dataset="),
        ({"task": ARITHMETIC}, {"env": env_factory},
         r"config sets task.name='arithmetic' and Trainer was given env="),
        ({"model": {"dtype": "bfloat16"}}, {"policy": "MODEL"},
         r"model.dtype='bfloat16' and the policy= object computes in float32"),
        ({"rewards": [{"name": "<python>:digits"}]}, {},
         r"rewards\[0\].name: '<python>:digits'.*give them to Trainer again \(reward_fns=\)"),
        ({}, {"reward_fns": lambda completions, **_: [0.0] * len(completions)},
         "has no usable __name__"),
        ({}, {"reward_fns": [digits, digits]}, "two rewards are named 'digits'"),
        ({}, {"env": env_factory, "reward_fns": digits}, "reward_fns= do not apply"),
        ({"task": {"name": "env"}}, {"reward_fns": digits},
         "config sets task.name='env' and Trainer was given reward_fns="),
        ({}, {"reward_weights": {"digits": 2.0}}, "reward_weights= applies to reward_fns="),
        ({}, {"reward_fns": digits, "reward_weights": {"other": 2.0}},
         r"reward_weights names \['other'\]"),
    ],
)  # fmt: skip
def test_a_part_given_twice_is_an_error_naming_both(tmp_path, tiny_model, sections, kwargs,
                                                    message):  # fmt: skip
    kwargs = dict(kwargs)
    if kwargs.get("policy") == "MODEL":
        kwargs.update(policy=tiny_model, tokenizer=char_tokenizer())
    with pytest.raises(ValueError, match=message):
        Trainer(run_cfg(tmp_path, **sections), **kwargs)


def test_policy_arguments_that_cannot_apply(tmp_path, tiny_model):
    with pytest.raises(ValueError, match="give its tokenizer too"):
        Trainer(run_cfg(tmp_path), policy=tiny_model)
    with pytest.raises(ValueError, match="tokenizer= goes with a transformers model"):
        Trainer(run_cfg(tmp_path), policy="some/model", tokenizer=char_tokenizer())
    with pytest.raises(TypeError, match=r"Linear has no \['sample'"):
        Trainer(run_cfg(tmp_path), policy=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="rollout.engine='vllm' loads the model"):
        Trainer(run_cfg(tmp_path, rollout={"engine": "vllm"}), policy=tiny_model,
                tokenizer=char_tokenizer(), reward_fns=digits, dataset=ROWS,
                eval_dataset=ROWS).evaluate()  # fmt: skip


def test_a_trainer_config_file_is_taken_back_with_the_same_objects(tmp_path, tiny_model):
    """A run's config.yaml records the objects; given back with them it builds the same run."""
    first = Trainer(run_cfg(tmp_path, train={"steps": 1}), policy=tiny_model,
                    tokenizer=char_tokenizer(), reward_fns=digits, dataset=ROWS,
                    eval_dataset=ROWS[:2])  # fmt: skip
    first.train()
    again = Trainer(tmp_path / "run" / "config.yaml", overrides=["run.name=again"],
                    policy=tiny_model, tokenizer=char_tokenizer(), reward_fns=digits,
                    dataset=ROWS, eval_dataset=ROWS[:2])  # fmt: skip
    assert again.config.rewards == first.config.rewards
    assert again.config.task == first.config.task
    assert again.evaluate() == first.evaluate()


def test_a_config_object_takes_the_parts_it_leaves_open(tmp_path, tiny_model_dir):
    """A validated Config (model and task named) with reward functions given: they are its
    rewards, and the task's eval split is evaluated with them."""
    cfg = validate(run_cfg(tmp_path, task=ARITHMETIC, model={"name_or_path": str(tiny_model_dir)}))
    trainer = Trainer(cfg, reward_fns=[digits, "accuracy"])
    assert [r.name for r in trainer.config.rewards] == ["<python>:digits", "accuracy"]
    metrics = trainer.evaluate()
    assert set(metrics) == {"accuracy", "response_length"}  # "accuracy": the task's own reward
    assert Trainer(cfg).config is cfg
    with pytest.raises(ValueError, match="config sets model.name_or_path="):
        Trainer(cfg, policy="other/model")


def test_load_config_is_exported(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "x"}, "task": ARITHMETIC}))
    assert load_config(path, ["train.steps=3"]).train.steps == 3


# ---- grouprl eval ---------------------------------------------------------------------------------


def test_grouprl_eval_of_a_config_and_of_its_finished_run(tmp_path, tiny_model_dir, capsys):
    """`grouprl eval CONFIG` evaluates the configured model (the run's "before" numbers),
    `grouprl eval RUN` the run's newest checkpoint (its "after" numbers); both read only. The
    run (docs/python_api.py's, from files) learns enough to tell the two apart."""
    (tmp_path / "rows.jsonl").write_text(
        "".join(json.dumps({"prompt": f"say a {i}:", "letter": "a"}) + "\n" for i in range(40))
    )
    (tmp_path / "rewards.py").write_text(
        "def letter_share(completions, letter, **_):\n"
        "    return [sum(ch == w for ch in c) / max(len(c), 1) for c, w in zip(completions, letter)]\n"
    )
    raw = run_cfg(
        tmp_path / "runs",
        model={"name_or_path": str(tiny_model_dir)},
        task={"name": "prompts", "options": {"source": str(tmp_path / "rows.jsonl"),
                                             "eval_fraction": 0.2}},
        rewards=[{"name": f"{tmp_path / 'rewards.py'}:letter_share"}],
        rollout={"prompts_per_step": 4, "group_size": 8, "max_new_tokens": 4},
        train={"steps": 20, "lr": 1e-2},
    )  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = train(load_config(path))
    assert result["before"]["accuracy"] < result["after"]["accuracy"]
    run_dir = Path(result["run_dir"])
    files = sorted(p for p in run_dir.rglob("*"))

    status, out, _ = run_cli(capsys, "eval", path, "--json")
    assert status == 0 and json.loads(out)["metrics"] == result["before"]
    status, out, _ = run_cli(capsys, "eval", run_dir, "--json")
    got = json.loads(out)
    assert status == 0 and got["metrics"] == result["after"]
    assert got["checkpoint"].endswith("step-00000020")
    status, out, _ = run_cli(capsys, "eval", run_dir)
    assert status == 0 and f"accuracy: {result['after']['accuracy']:.4f}" in out
    assert sorted(p for p in run_dir.rglob("*")) == files  # nothing written

    status, _, err = run_cli(capsys, "eval", tmp_path)  # a config.yaml, no checkpoints
    assert status == 2 and "has no intact checkpoint" in err
    status, _, err = run_cli(capsys, "eval", tmp_path / "runs")
    assert status == 2 and "holds no config.yaml or config.resolved.yaml" in err


# ---- the notebook-style example -------------------------------------------------------------------


def test_docs_python_api_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace = runpy.run_path(str(ROOT / "docs" / "python_api.py"), run_name="__main__")
    out = capsys.readouterr().out
    result, after = namespace["result"], namespace["after"]
    assert after == result["after"] and result["before"] == namespace["before"]
    assert after["accuracy"] > result["before"]["accuracy"]
    assert f"held-out accuracy after: {after['accuracy']:.2f}" in out
    assert (tmp_path / "runs" / "python-api" / "checkpoints").is_dir()


def test_tiny_model_builder_is_deterministic():
    """The example relies on tiny_qwen2 building the same weights for the same seed."""
    a, b = tiny_qwen2(char_tokenizer()), tiny_qwen2(char_tokenizer())
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
