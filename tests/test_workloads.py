"""The Workload seam: each built-in workload's own values, the capability refusals, and a fourth
workload registered from this test module (nothing in grouprl edited) that trains through
`grouprl.train.train`.

The toy workload is a 4-armed bandit: the policy is a softmax over 4 logits (a real nn.Module
trained by the real loop, objectives and checkpoints), an action is one arm, the reward is 1 for
the target arm. It is the smallest policy that can learn, so one step moves probability mass.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
from torch import nn

from grouprl.config import apply_overrides, validate
from grouprl.objectives import compute_advantages, total_loss
from grouprl.runtime.build import build_optimizer
from grouprl.train import train, update
from grouprl.types import PolicyOutput, Rollout
from grouprl.workloads import WORKLOADS, build_workload, refuse_unsupported, workload_of
from grouprl.workloads.base import Capabilities, Collected, Parts, register

# ---- the toy workload ---------------------------------------------------------------------------


class BanditSettings(BaseModel):
    """The `bandit:` config section of the toy workload."""

    model_config = ConfigDict(extra="forbid")
    arms: int = Field(4, ge=2, description="number of arms")
    target: int = Field(2, ge=0, description="the arm that pays 1")
    max_len: int = Field(13, description="L_max the workload reports (checked by the loop test)")


class BanditPolicy(nn.Module):
    """pi(a) = softmax(logits)[a]; an action is one arm, so T = 1."""

    lora = None  # full fine-tuning: checkpoints save the weights with save_pretrained

    def __init__(self, arms: int) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(arms))

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        probs = torch.softmax(self.logits.detach(), -1)  # [K]
        return torch.multinomial(probs, n, replacement=True, generator=generator)  # [n]

    def log_probs(self, actions: torch.Tensor, **_: Any) -> PolicyOutput:
        logp = torch.log_softmax(self.logits, -1)[actions]  # [n, 1]
        return PolicyOutput(logp=logp)

    @contextmanager
    def reference(self):
        yield self  # no KL in these runs

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [self.logits]

    def save_pretrained(self, directory: str | Path) -> Path:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        save_file({"logits": self.logits.detach().contiguous()}, str(path / "bandit.safetensors"))
        return path

    def load_saved_weights(self, directory: str | Path) -> None:
        self.logits.data.copy_(load_file(str(Path(directory) / "bandit.safetensors"))["logits"])


class BanditWorkload:
    """A 4-armed bandit as a workload (the test's fourth modality)."""

    name: ClassVar[str] = "bandit"
    capabilities: ClassVar[Capabilities] = Capabilities()
    settings: ClassVar[type] = BanditSettings
    seen: ClassVar[list[dict]] = []  # what the loop handed to micro_loss, for the tests

    def __init__(self, parts: Parts) -> None:
        self.cfg, self.policy = parts.cfg, parts.policy
        self.s = parts.cfg.workload_settings

    @classmethod
    def build_policy(cls, cfg: Any, device: torch.device) -> BanditPolicy:
        return BanditPolicy(cfg.workload_settings.arms).to(device)

    @classmethod
    def build_rewards(cls, cfg: Any, task: Any) -> tuple[dict, dict[str, float]]:
        return {}, {"hit": 1.0}

    def max_len(self) -> int:
        return self.s.max_len

    def collect(self, policy: Any, examples: list[dict], *, first_group_id: int, step: int):
        g = self.cfg.rollout.group_size
        group_ids = torch.arange(first_group_id, first_group_id + len(examples))  # [B]
        group_ids = group_ids.repeat_interleave(g)  # [N]
        actions = policy.sample(len(group_ids)).unsqueeze(1)  # [N, 1]
        hit = (actions[:, 0] == self.s.target).float()  # [N]
        rollout = Rollout(
            group_ids=group_ids, rewards={"hit": hit}, actions=actions,
            old_logp=policy.log_probs(actions).logp.detach(),  # [N, 1]
            mask=torch.ones_like(actions, dtype=torch.bool),
        )  # fmt: skip
        return Collected(rollout)

    def postprocess(self, rollout: Rollout):
        return rollout, {"bandit/hit_rate": float(rollout.rewards["hit"].mean())}

    def prepare(self, scorer: Any, rollout: Rollout, weights: dict[str, float]):
        a = self.cfg.algorithm
        rollout.advantages = compute_advantages(
            a.advantage, rollout.rewards, rollout.group_ids, weights=weights, scale=a.scale
        )  # [N]
        return {"reward/mean": float(rollout.rewards["hit"].mean())}

    def micro_loss(self, sub: Rollout, counts: dict, *, single_pass: bool):
        BanditWorkload.seen.append({"counts": dict(counts), "groups": sub.group_ids.tolist()})
        out = self.policy.log_probs(sub.actions)
        old = out.logp.detach() if single_pass else sub.old_logp  # [n, 1]
        res = total_loss(out, old_logp=old, advantages=sub.advantages, mask=sub.mask,
                         algo=self.cfg.algorithm, counts=counts, group_ids=sub.group_ids)  # fmt: skip
        return res, old

    def after_update(self, step: int, rollout: Rollout) -> dict[str, float]:
        return {}

    def evaluate(self, examples: list[dict], *, step: int):
        p = torch.softmax(self.policy.logits.detach(), -1)[self.s.target]
        return {"hit": float(p)}, [{"p_target": float(p)}]

    def accuracy_key(self) -> str:
        return "hit"


@pytest.fixture
def bandit():
    """The toy stays registered for this module's tests only (grouprl list workloads, config
    validation in other modules never see it)."""
    register(BanditWorkload)
    BanditWorkload.seen.clear()
    yield BanditWorkload
    WORKLOADS.pop("bandit", None)


def bandit_cfg(tmp_path: Path, *overrides: str):
    raw = {
        "workload": {"type": "bandit"},
        "bandit": {"arms": 4, "target": 2},
        "run": {"output_dir": str(tmp_path), "name": "bandit", "device": "cpu", "console": False,
                "seed": 0},
        "model": {"name_or_path": "toy-bandit"},
        "task": {"name": "arithmetic", "options": {"n_train": 8, "n_eval": 2}},
        "rollout": {"prompts_per_step": 2, "group_size": 4},
        "algorithm": {"kl_coef": 0.0},
        "train": {"steps": 1, "lr": 0.5, "warmup_steps": 0},
        "eval": {"every": 0},
        "checkpoint": {"every": 0},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


# ---- a fourth workload, from outside the package ------------------------------------------------


def test_a_workload_registered_from_a_test_module_trains_one_step(bandit, tmp_path):
    cfg = bandit_cfg(tmp_path)
    assert workload_of(cfg) is bandit and cfg.workload_settings == BanditSettings()
    out = train(cfg)
    assert out["accuracy_key"] == "hit"
    assert out["before"]["hit"] == pytest.approx(0.25)  # uniform over 4 arms before the step
    lines = [
        json.loads(x) for x in (tmp_path / "bandit" / "metrics.jsonl").read_text().splitlines()
    ]
    step = next(x for x in lines if x.get("step") == 1 and "loss" in x)
    assert "bandit/hit_rate" in step and step["grad_norm"] > 0
    # the update moved mass towards the target whenever a group had a hit and a miss
    if 0 < step["bandit/hit_rate"] < 1:
        assert out["after"]["hit"] > out["before"]["hit"]
    assert (tmp_path / "bandit" / "config.resolved.yaml").exists()


def test_the_loop_uses_the_workloads_max_len(bandit, tmp_path):
    """Dr.GRPO's constant normaliser is the workload's L_max, not a text setting."""
    cfg = bandit_cfg(tmp_path, "bandit.max_len=13", "rollout.max_new_tokens=99")
    train(cfg)
    assert {s["counts"]["max_len"] for s in bandit.seen} == {13}


def _split_groups(bandit, tmp_path, *overrides):
    cfg = bandit_cfg(tmp_path, "rollout.prompts_per_step=4", "rollout.group_size=3",
                     "algorithm.minibatches=2", "train.micro_batch_size=2", *overrides)  # fmt: skip
    policy = BanditPolicy(4)
    workload = build_workload(cfg, policy=policy, weights={"hit": 1.0})
    rollout = workload.collect(policy, [{}] * 4, first_group_id=0, step=0).rollout
    rollout.rewards["hit"] = torch.arange(12.0) % 2  # every group mixed: non-zero advantages
    workload.prepare(policy, rollout, {"hit": 1.0})
    optimizer, scheduler = build_optimizer(cfg, policy)
    bandit.seen.clear()
    update(cfg, workload, policy, optimizer, scheduler, rollout)
    return [s["groups"] for s in bandit.seen]


def test_a_group_level_loss_never_splits_a_group(bandit, tmp_path):
    """TPO's loss is defined over whole groups: each micro-batch holds every row of its groups."""
    micro = _split_groups(bandit, tmp_path, "algorithm.preset=tpo")
    assert sum(len(m) for m in micro) == 12
    for m in micro:
        assert all(m.count(g) == 3 for g in set(m))  # all 3 rows of each group present
    # a per-token loss splits freely: micro-batches of 2 rows cut groups of 3
    micro = _split_groups(bandit, tmp_path)
    assert any(m.count(g) < 3 for m in micro for g in set(m))


# ---- the built-in workloads' own values ---------------------------------------------------------


def _text(tmp_path, *o):
    raw = {"run": {"output_dir": str(tmp_path)}, "model": {"name_or_path": "tiny"},
           "task": {"name": "arithmetic"}}  # fmt: skip
    return validate(apply_overrides(raw, list(o)))


def _agent(tmp_path, *o):
    raw = {"run": {"output_dir": str(tmp_path)}, "model": {"name_or_path": "tiny"},
           "task": {"name": "env", "options": {"env_id": "grouprl/FrozenLake-v0"}}}  # fmt: skip
    return validate(apply_overrides(raw, list(o)))


def _images(tmp_path, *o):
    raw = {"run": {"output_dir": str(tmp_path)}, "model": {"name_or_path": "tiny", "type": "flow"},
           "task": {"name": "image_prompts"}}  # fmt: skip
    return validate(apply_overrides(raw, list(o)))


def test_each_workload_reports_its_own_max_len(tmp_path):
    text = _text(tmp_path, "rollout.max_new_tokens=7")
    agent = _agent(tmp_path, "rollout.max_new_tokens=7", "agent.max_total_tokens=123")
    images = _images(tmp_path, "rollout.max_new_tokens=7", "diffusion.rollout_steps=5")
    got = {c.workload.type: build_workload(c, policy=None).max_len() for c in (text, agent, images)}
    assert got == {"text": 7, "agent": 123, "images": 5}


def test_each_workload_names_its_accuracy_metric(tmp_path):
    assert build_workload(_agent(tmp_path), policy=None).accuracy_key() == "success"
    text = build_workload(_text(tmp_path), policy=None, reward_fns={"format": 0, "accuracy": 0})
    assert text.accuracy_key() == "accuracy"
    images = build_workload(_images(tmp_path), policy=None, reward_fns={"aesthetic": 0})
    assert images.accuracy_key() == "aesthetic"


def _vlm(tmp_path, *o):
    raw = {"run": {"output_dir": str(tmp_path)}, "workload": {"type": "vlm"},
           "model": {"name_or_path": "tiny", "type": "vlm"}, "task": {"name": "visual_shapes"},
           "rewards": [{"name": "accuracy"}]}  # fmt: skip
    return validate(apply_overrides(raw, list(o)))


@pytest.mark.parametrize(
    ("make", "overrides", "world", "message"),
    [
        (_agent, ["train.async_mode=one_step_off"], 1, "train.async_mode one_step_off"),
        (_images, ["train.async_mode=one_step_off"], 1, "train.async_mode one_step_off"),
        (_vlm, [], 2, "several processes"),
        (_agent, ["curriculum.type=dump"], 1, "curriculum.type dump"),
        (_agent, ["rollout.max_prompt_tokens=64"], 1, "rollout.max_prompt_tokens"),
        (_images, ["rollout.max_prompt_tokens=64"], 1, "rollout.max_prompt_tokens"),
    ],
)
def test_capabilities_refuse_what_a_workload_cannot_do(tmp_path, make, overrides, world, message):
    if world == 1:  # config-only requests fail at validation, before anything is built
        with pytest.raises(ValueError, match=f"does not support {message}"):
            make(tmp_path, *overrides)
    else:
        cfg = make(tmp_path, *overrides)
        with pytest.raises(ValueError, match=f"does not support {message}"):
            refuse_unsupported(workload_of(cfg), cfg, world)


def test_images_and_agents_run_under_several_processes_with_per_sample_seeds(tmp_path):
    for cfg in (_images(tmp_path, "rollout.seeding=per_sample"),
                _agent(tmp_path, "rollout.seeding=per_sample")):  # fmt: skip
        refuse_unsupported(workload_of(cfg), cfg, world=2)  # no error


def test_text_supports_everything_the_refusals_name(tmp_path):
    cfg = _text(tmp_path, "train.async_mode=one_step_off", "rollout.seeding=per_sample",
                "rollout.max_prompt_tokens=64")  # fmt: skip
    refuse_unsupported(workload_of(cfg), cfg, world=2)  # no error
