"""The vllm_server pieces that need no vLLM: the weight channel (a standalone gloo group, its
timeouts), the server-side LoRA merge (hand-computed), the client's errors for a server that is not
there, and the rollout.server config rule."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_distributed import free_port

from grouprl.config.loading import apply_overrides, validate
from grouprl.policies.text.engines.server.channel import (
    broadcast,
    host_store,
    join_store,
    open_group,
)
from grouprl.policies.text.engines.server.client import ServerUnavailable, VLLMServerEngine
from grouprl.policies.text.engines.server.worker import LORA_A, LORA_B, merge_lora


def test_merge_lora_is_w0_plus_scaling_b_a():
    base = {"q.weight": torch.tensor([[1.0, 0.0], [0.0, 1.0]]), "n.weight": torch.tensor([3.0])}
    adapters = {"q.weight" + LORA_A: torch.tensor([[1.0, 2.0]]),  # [r=1, in=2]
                "q.weight" + LORA_B: torch.tensor([[1.0], [-1.0]])}  # [out=2, r=1]  # fmt: skip
    merged = dict(merge_lora(base, adapters, {"q.weight": 0.5}))
    # B @ A = [[1, 2], [-1, -2]]; W0 + 0.5 * that
    assert torch.equal(merged["q.weight"], torch.tensor([[1.5, 1.0], [-0.5, 0.0]]))
    assert torch.equal(merged["n.weight"], base["n.weight"])
    with pytest.raises(KeyError, match="k.weight"):
        list(merge_lora(base, adapters, {"k.weight": 1.0}))


def test_channel_broadcasts_from_rank_0_without_a_default_group():
    store = host_store("127.0.0.1", 0, 20)
    got = {}

    def receiver():
        group = open_group(join_store("127.0.0.1", store.port, 20), "t", 1, 2, "gloo", 20,
                           "127.0.0.1")  # fmt: skip
        t = torch.empty(3, 2)
        broadcast(group, t, 20)
        got["t"] = t

    th = threading.Thread(target=receiver)
    th.start()
    group = open_group(store, "t", 0, 2, "gloo", 20, "127.0.0.1")
    sent = torch.arange(6.0).reshape(3, 2)
    broadcast(group, sent, 20)
    th.join(20)
    assert torch.equal(got["t"], sent)
    assert not torch.distributed.is_initialized()  # the trainer's global group is untouched


def test_a_peer_that_never_joins_is_an_error_not_a_hang():
    store = host_store("127.0.0.1", 0, 2)
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 (torch raises its own DistStoreError / RuntimeError)
        open_group(store, "lonely", 0, 2, "gloo", 2, "127.0.0.1")
    assert time.monotonic() - t0 < 30


def test_a_server_that_is_not_there_names_the_url_and_resume():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnavailable, match=f"vLLM server {url} did not answer GET /info.*"
                                                "run.resume=true"):  # fmt: skip
        VLLMServerEngine(url, connect_timeout_s=2)


def test_server_options_need_the_server_engine():
    raw = {"workload": {"type": "text"}, "model": {"name_or_path": "x"},
           "task": {"name": "arithmetic"},
           "rollout": {"server": {"url": "http://h:1"}}}  # fmt: skip
    with pytest.raises(Exception, match="rollout.server is set .* but rollout.engine is 'fast'"):
        validate(apply_overrides(raw, []))
    cfg = validate(apply_overrides(raw, ["rollout.engine=vllm_server"]))
    assert cfg.rollout.server.url == "http://h:1" and cfg.rollout.server.backend == "auto"
