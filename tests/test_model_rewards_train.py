"""The model-based text rewards from a YAML config through the training loop: a reward model
replica, a groupwise LLM judge and a remote scorer on 127.0.0.1 score the same run's completions."""

from __future__ import annotations

import json
import re
from pathlib import Path

from local_servers import chat_answer, serve

from grouprl.cli import main
from grouprl.replicas import build_replica

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "text" / "arithmetic_demo.yaml"


def _handler(path, body, call):
    if path.endswith("/chat/completions"):  # groupwise: one score line per numbered completion
        n = len(re.findall(r"^\[\d+\]", body["messages"][-1]["content"], flags=re.M))
        return 200, chat_answer("\n".join(f"[{k + 1}]: {k % 10}" for k in range(n))), 0.0
    return 200, {"rewards": [float(len(c)) for c in body["completions"]]}, 0.0  # http scorer


def test_reward_model_judge_and_http_train_from_a_config(tmp_path):
    rm = build_replica("qwen2.5-rm", tmp_path / "rm")
    policy = build_replica("qwen2.5", tmp_path / "policy")
    with serve(_handler) as (url, log):
        rewards = [
            {"name": "reward_model", "weight": 0.5, "options": {"model": str(rm)}},
            {"name": "llm_judge", "weight": 0.5,
             "options": {"base_url": f"{url}/v1", "model": "judge", "mode": "groupwise"}},
            {"name": "http", "weight": 0.1, "options": {"url": f"{url}/score"}},
        ]  # fmt: skip
        rc = main(["train", str(CONFIG), f"model.name_or_path={policy}",
                   f"run.output_dir={tmp_path}", "run.name=judged", "train.steps=2",
                   "rollout.prompts_per_step=2", "rollout.group_size=3",
                   "rollout.max_new_tokens=4", "eval.every=0", "checkpoint.every=0",
                   f"rewards={json.dumps(rewards)}"])  # fmt: skip
    assert rc == 0
    rows = [json.loads(x) for x in (tmp_path / "judged" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if any(k.startswith("reward/llm_judge") for k in r))
    for name in ("reward_model", "llm_judge", "http"):
        assert any(k.startswith(f"reward/{name}") for k in step), sorted(step)
    judge_calls = [b for p, b, _ in log if p.endswith("/chat/completions")]
    assert len(judge_calls) == 4  # 2 steps x 2 groups: one request per group
    assert all(len(re.findall(r"^\[\d+\]", b["messages"][-1]["content"], flags=re.M)) == 3
               for b in judge_calls)  # fmt: skip
