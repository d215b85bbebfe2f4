"""The Python API: `Trainer` (a run whose parts may be given as Python objects) and
`run_evaluation` (the held-out evaluation alone, for `Trainer.evaluate` and `grouprl eval`).

    from grouprl import Trainer
    trainer = Trainer("run.yaml", policy=model, tokenizer=tok, reward_fns=my_reward,
                      dataset=[{"prompt": "2+3=", "answer": "5"}, ...])
    result = trainer.train()

The objects enter the loop through `grouprl.train.Given` (builders of the task and the policy);
every other part is built from the config as `grouprl train` builds it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import PreTrainedModel

from grouprl.config.loading import Config, apply_overrides, read_config, user_settings, validate
from grouprl.config.migration import infer_workload
from grouprl.envs.gym import env_name
from grouprl.envs.rewards.loading import python_rewards
from grouprl.envs.tasks import TaskData, build_task
from grouprl.policies.precision import DTYPES, compute_dtype_of
from grouprl.rollouts.prompt_guard import apply_prompt_guard
from grouprl.runtime.build import device_for, seed_everything
from grouprl.runtime.distributed import SINGLE
from grouprl.runtime.reward_guard import isolate_rewards, isolation_settings
from grouprl.runtime.user_inputs import (
    is_python_object,
    python_object,
    python_objects_in,
    user_code_on_path,
)
from grouprl.train import NOTHING_GIVEN, Given, UserCodeExit, close_rewards, exit_origin, train
from grouprl.workloads import build_policy, build_rewards, refuse_unsupported, workload_of
from grouprl.workloads.base import Parts
from grouprl.workloads.text import causal_lm_policy


def run_evaluation(
    cfg: Config, given: Given = NOTHING_GIVEN
) -> tuple[dict[str, float], list[dict]]:
    """The held-out evaluation alone (`Trainer.evaluate`, `grouprl eval`): builds the task,
    rewards and policy as `train` does and evaluates the policy's current weights on the eval
    split, seeded with run.seed. The run directory is neither read nor written (images: the grid
    goes to run_dir/images/, as in training)."""
    with ExitStack() as stack:
        stack.enter_context(user_code_on_path())
        try:
            kind = workload_of(cfg)
            refuse_unsupported(kind, cfg)
            seed_everything(cfg.run.seed)
            device = device_for(cfg.run.device)
            task = given.task(cfg) if given.task else build_task(cfg.task.name, **cfg.task.options)
            reward_fns, weights = build_rewards(cfg, task)
            reward_fns = isolate_rewards(
                reward_fns, isolation_settings(cfg.rewards), fail_fast=cfg.run.fail_fast
            )
            stack.callback(close_rewards, reward_fns)
            policy = given.policy(cfg, device) if given.policy else build_policy(cfg, device)
            examples = task.eval[: cfg.eval.max_examples] if cfg.eval.max_examples else task.eval
            if kind.capabilities.prompt_guard:  # as in training: over-long prompts
                _, examples = apply_prompt_guard(cfg, policy, task.train, examples)
            if not examples:
                raise ValueError(
                    f"task {cfg.task.name!r} has no held-out examples to evaluate on: give it an "
                    "eval split (e.g. task.options.eval_fraction / eval_source, or the Python "
                    "API's eval_dataset=)"
                )
            workload = kind(Parts(cfg, policy, reward_fns, weights, SINGLE))
            policy.eval()
            return workload.evaluate(examples, step=0)
        except SystemExit as exc:
            raise UserCodeExit(
                f"the evaluation stopped: {exit_origin(exc)} raised SystemExit({exc.code!r})"
            ) from exc


class Trainer:
    """The Python API: a run of `config` whose parts may be given as Python objects.

        trainer = Trainer("run.yaml", policy=model, tokenizer=tok, reward_fns=my_reward,
                          dataset=[{"prompt": "2+3=", "answer": "5"}, ...])
        result = trainer.train()      # what `grouprl train` does: {"before", "after", "run_dir", ...}
        metrics = trainer.evaluate()  # held-out metrics of the current weights

    config:       a Config, a mapping as the YAML file holds, or a YAML path; `overrides` are
                  dotted key=value strings applied to a mapping or file.
    policy:       a transformers causal LM (its tokenizer as `tokenizer=`), a ready grouprl policy
                  (e.g. a CausalLMPolicy), or a model name / path (model.name_or_path).
    reward_fns:   a function `fn(prompts=..., completions=..., **columns) -> list[float | None]`,
                  a dict name -> function, or a list of functions and reward names ('format',
                  'module:function'); `reward_weights`: name -> weight (default 1).
    dataset:      a list of dicts, a datasets.Dataset / DatasetDict, or a file / hub name: the
                  `source` of the config's task (default task: `prompts`, a "prompt" column plus
                  any columns the rewards read); `eval_dataset`: its held-out `eval_source`.
    env:          a callable returning a text gymnasium env (str observations and actions, a
                  `system_prompt`), or a registered env id: the `env_id` of an agent run.
    A part the config names too (config `rewards` and reward_fns=, model.name_or_path and
    policy=, ...) is an error naming both. The run's config.yaml records each object as
    "<python>:what" (e.g. `rewards: [{name: "<python>:reward_len"}]`); such a file may be given
    back to Trainer with the same objects.

    `self.config` is the validated Config; `self.policy` the policy, once built (by train() or
    evaluate()), whose weights later calls continue from.
    """

    def __init__(
        self,
        config: Config | dict | str | Path,
        *,
        overrides: list[str] = (),
        policy: Any = None,
        tokenizer: Any = None,
        reward_fns: Any = None,
        reward_weights: dict[str, float] | None = None,
        dataset: Any = None,
        eval_dataset: Any = None,
        env: Any = None,
    ) -> None:
        parts = TrainerArguments.sort(
            policy, tokenizer, reward_fns, reward_weights, dataset, eval_dataset, env
        )
        self.config = parts.complete(config, list(overrides))
        self.policy: Any = parts.ready_policy
        self._parts = parts
        self._given = Given(task=parts.task_builder(), policy=self._build_policy)

    def _build_policy(self, cfg: Config, device: torch.device) -> Any:
        if self.policy is None:  # built once: train() and evaluate() share its weights
            self.policy = self._parts.build_policy(cfg, device)
        return self.policy.to(device)

    def train(self) -> dict[str, Any]:
        """Train as `grouprl train` does; returns {"before", "after", "run_dir", "accuracy_key"}."""
        return train(self.config, self._given)

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics of the current weights (the initial ones before train())."""
        return run_evaluation(self.config, self._given)[0]


# Trainer argument -> the config key it fills (objects: a "<python>:what" record there)
_ARGUMENT_KEYS = {
    "policy": "model.name_or_path",
    "dataset": "task.options.source",
    "eval_dataset": "task.options.eval_source",
    "env": "task.options.env_id",
    "reward_fns": "rewards",
}


@dataclass
class TrainerArguments:
    """The Trainer's arguments, sorted into what they set in the config (a string as it is, an
    object as its "<python>:what" record) and the objects the run is built from."""

    settings: dict[str, Any]  # Trainer argument -> its config value (string or record)
    rewards: list[dict[str, Any]] | None  # the `rewards` entries reward_fns= makes
    model: tuple[Any, Any] | None = None  # (transformers model, tokenizer)
    ready_policy: Any = None  # a grouprl policy object
    dtype: str | None = None  # model.dtype of a model / policy object
    task_objects: dict[str, Any] | None = None  # task option -> object (source, env_id ...)
    reward_objects: dict[str, Any] | None = None  # reward key -> function

    @classmethod
    def sort(
        cls, policy, tokenizer, reward_fns, reward_weights, dataset, eval_dataset, env
    ) -> TrainerArguments:
        parts = cls(settings={}, rewards=None, task_objects={}, reward_objects={})
        if tokenizer is not None and not isinstance(policy, PreTrainedModel):
            raise ValueError("tokenizer= goes with a transformers model given as policy=")
        if isinstance(policy, str | Path):
            parts.settings["policy"] = str(policy)
        elif isinstance(policy, PreTrainedModel):
            if tokenizer is None:
                raise ValueError(
                    f"policy= is a transformers model ({type(policy).__name__}); give its "
                    "tokenizer too: Trainer(config, policy=model, tokenizer=tokenizer)"
                )
            parts.model = (policy, tokenizer)
            parts.dtype = _dtype_name(compute_dtype_of(policy), DTYPES)
            parts.settings["policy"] = python_object(type(policy).__name__)
        elif policy is not None:
            missing = [m for m in _POLICY_METHODS if not callable(getattr(policy, m, None))]
            if missing:
                raise TypeError(
                    f"policy= must be a transformers model (with tokenizer=), a grouprl policy "
                    f"or a model name / path; {type(policy).__name__} has no {missing}"
                )
            parts.ready_policy = policy
            dtype = getattr(policy, "compute_dtype", None)
            parts.dtype = None if dtype is None else _dtype_name(dtype, DTYPES)
            parts.settings["policy"] = python_object(type(policy).__name__)
        for argument, value in (("dataset", dataset), ("eval_dataset", eval_dataset)):
            if isinstance(value, str):
                parts.settings[argument] = value
            elif value is not None:
                parts.task_objects[_ARGUMENT_KEYS[argument].rsplit(".", 1)[-1]] = value
                rows = f" of {len(value)} rows" if isinstance(value, list | Dataset) else ""
                parts.settings[argument] = python_object(type(value).__name__ + rows)
        if env is not None:
            if dataset is not None or eval_dataset is not None or reward_fns is not None:
                raise ValueError(
                    "env= runs an agent in an environment, which gives the rewards and the "
                    "episodes' seeds: dataset=, eval_dataset= and reward_fns= do not apply"
                )
            if isinstance(env, str):
                parts.settings["env"] = env
            elif callable(env):
                parts.task_objects["env_id"] = env
                parts.settings["env"] = python_object(env_name(env))
            else:
                raise TypeError(f"env= must be a callable returning a text env or an env id, "
                                f"got {type(env).__name__}")  # fmt: skip
        if reward_weights is not None and reward_fns is None:
            raise ValueError("reward_weights= applies to reward_fns=; the config's `rewards` "
                             "entries carry their own weights")  # fmt: skip
        if reward_weights is not None:
            parts.settings["reward_weights"] = dict(reward_weights)
        if reward_fns is not None:
            rewards = python_rewards(reward_fns)
            weights = dict(reward_weights or {})
            unknown = sorted(set(weights) - set(rewards))
            if unknown:
                raise ValueError(f"reward_weights names {unknown}, which reward_fns does not "
                                 f"give (rewards: {list(rewards)})")  # fmt: skip
            parts.rewards = []
            for key, fn in rewards.items():
                name = fn if isinstance(fn, str) else python_object(key)
                if not isinstance(fn, str):
                    parts.reward_objects[key] = fn
                parts.rewards.append({"name": name, "weight": float(weights.get(key, 1.0))})
            parts.settings["reward_fns"] = [r["name"] for r in parts.rewards]
        return parts

    def complete(self, config: Config | dict | str | Path, overrides: list[str]) -> Config:
        """The run's Config: `config` plus what the arguments set; a part set twice is an error
        naming both, as is a "<python>:..." record whose object is not given."""
        if isinstance(config, Config):
            if overrides:
                raise ValueError("overrides= applies to a config mapping or file, not a Config")
            if not self.settings:
                return config
            raw = user_settings(config)
            if isinstance(raw.get("task"), dict) and "options" in raw["task"]:
                raw["task"]["options"] = dict(config.task.options)  # Dataset objects as they are
        elif isinstance(config, dict):
            raw = apply_overrides(copy.deepcopy(config), overrides)
        elif isinstance(config, str | Path):
            raw = read_config(config, overrides)
        else:
            raise TypeError(f"config must be a Config, a mapping or a YAML path, got "
                            f"{type(config).__name__}")  # fmt: skip
        self._fill(raw)
        if self.settings and "workload" not in raw:  # the parts given say which: no old config
            raw["workload"] = {"type": infer_workload(raw)}
        left = {k: v for k, v in python_objects_in(raw).items()
                if not _given_key(k, self.settings)}  # fmt: skip
        if left:
            raise ValueError(
                "the config names objects given from Python ("
                + ", ".join(f"{k}: {v!r}" for k, v in left.items())
                + "); give them to Trainer again ("
                + ", ".join(sorted({f"{_argument_of(k)}=" for k in left}))
                + ")"
            )
        return validate(raw)

    def _fill(self, raw: dict) -> None:
        """Put what the arguments set into the raw config (in place), refusing a part the config
        names already."""

        def named(value: Any) -> bool:  # set by the config itself (a record is not)
            return value is not None and not is_python_object(value)

        def conflict(key: str, value: Any, argument: str) -> ValueError:
            return ValueError(
                f"the config sets {key}={value!r} and Trainer was given {argument}=: give "
                "this part in one place only"
            )

        s = self.settings
        if "policy" in s:
            model = _section(raw, "model")
            if named(model.get("name_or_path")):
                raise conflict("model.name_or_path", model["name_or_path"], "policy")
            model["name_or_path"] = s["policy"]
            if self.model is not None and model.get("type", "causal_lm") != "causal_lm":
                raise conflict("model.type", model["type"], "policy")
            if self.dtype is not None:
                if model.get("dtype", self.dtype) != self.dtype:
                    raise ValueError(
                        f"the config sets model.dtype={model['dtype']!r} and the policy= object "
                        f"computes in {self.dtype}; convert the model or drop model.dtype"
                    )
                model["dtype"] = self.dtype
        task_keys = [a for a in ("dataset", "eval_dataset", "env") if a in s]
        if task_keys:
            task = _section(raw, "task")
            wanted = "env" if "env" in s else "prompts"
            task.setdefault("name", wanted)
            if (task["name"] == "env") != (wanted == "env"):
                raise conflict("task.name", task["name"], task_keys[0])
            options = task.setdefault("options", {})
            if not isinstance(options, dict):
                raise ValueError(f"task.options must be a mapping, got {options!r}")
            for argument in task_keys:
                option = _ARGUMENT_KEYS[argument].rsplit(".", 1)[-1]
                if named(options.get(option)):
                    raise conflict(f"task.options.{option}", options[option], argument)
                options[option] = s[argument]
        if self.rewards is not None:
            task = raw.get("task") if isinstance(raw.get("task"), dict) else {}
            if task.get("name") == "env":  # the environment gives the rewards
                raise conflict("task.name", "env", "reward_fns")
            mine = raw.get("rewards") or []
            names = [r.get("name") if isinstance(r, dict) else r for r in mine]
            if mine and names != s["reward_fns"]:
                raise conflict("rewards", names, "reward_fns")
            if mine and "reward_weights" in s:
                raise conflict("rewards", mine, "reward_weights")
            raw["rewards"] = mine or self.rewards  # the config's entries keep their settings

    def task_builder(self) -> Callable[[Any], TaskData] | None:
        """cfg -> the task with the objects as its options, plus the reward functions given
        (config `rewards` entries "<python>:key" name them as the task's own), or None."""
        if not self.task_objects and not self.reward_objects:
            return None

        def build(cfg: Config) -> TaskData:
            task = build_task(cfg.task.name, **{**cfg.task.options, **self.task_objects})
            task.reward_fns.update({python_object(k): fn for k, fn in self.reward_objects.items()})
            return task

        return build

    def build_policy(self, cfg: Config, device: torch.device) -> Any:
        """The policy: the given one, one over the given transformers model, or the config's."""
        if self.ready_policy is not None:
            return self.ready_policy
        if self.model is not None:
            return causal_lm_policy(cfg, device, loaded=self.model)
        return build_policy(cfg, device)


_POLICY_METHODS = ("sample", "log_probs", "trainable_parameters", "state_dict", "save_pretrained")


def _dtype_name(dtype: torch.dtype, names: dict[str, torch.dtype]) -> str:
    for name, value in names.items():
        if value == dtype:
            return name
    raise ValueError(f"the policy computes in {dtype}; grouprl trains in one of {list(names)}")


def _section(raw: dict, name: str) -> dict:
    section = raw.setdefault(name, {})
    if not isinstance(section, dict):
        raise ValueError(f"config section {name!r} must be a mapping, got {section!r}")
    return section


def _argument_of(key: str) -> str:
    """The Trainer argument that gives the object a config key's record stands for."""
    if key.startswith("rewards["):
        return "reward_fns"
    return next((a for a, k in _ARGUMENT_KEYS.items() if k == key), key)


def _given_key(key: str, settings: dict[str, Any]) -> bool:
    return _argument_of(key) in settings
