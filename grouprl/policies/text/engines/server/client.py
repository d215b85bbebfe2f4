"""The trainer's side of `grouprl vllm-serve`: `VLLMServerEngine` (rollout.engine vllm_server).

It follows the text-engine contract (generate -> GenerationOutput, load_weights, weight_version),
so the policy, the text and agent workloads and the gateway use it as they use the in-process
VLLMEngine. Differences:
- Seeds: without caller seeds the client draws them (base, base+1, ... from its own
  `random.Random(seed)`, as VLLMEngine does), so a completion's seed never depends on which
  trainer process asked; with rollout.seeding per_sample the policy passes one per completion.
- Weights: only the trainer's main process pushes. A push opens the weight channel
  (channel.py) on first use (or when the server was restarted: another instance id), announces
  names / shapes / dtypes over HTTP, broadcasts the tensors one at a time and waits for the
  server to load them. `push(policy, processes)` is what the training loop calls: on the main
  process it pushes, on the others it only learns the new server version (broadcast over the
  trainer's own group), and their next generate asks the server for at least that version, so no
  process samples with stale weights and no extra barrier is needed. Sharded backends (fsdp2,
  ZeRO-3) hand a stream of parameters (`stream_full_weights`): every process gathers one
  parameter at a time, the main process sends it, and it is freed before the next.
- A peft policy pushes only its LoRA adapters (A, B and the scaling of each adapted weight); the
  server merges them into the base weights of its model folder (worker.py). Adapters that merge
  is not written for (peft's parameter targeting of stacked MoE experts, the default on MoE
  models: their delta is no B @ A of a linear layer, and their in-memory names are not the
  folder's) go as a full push of the merged weights in the checkpoint layout, the in-process
  engine's push (vllm_push.engine_state_dict); before, the server refused such a push with a
  KeyError for `mlp.experts.weight`.
- Each distinct tensor travels once (a tied head under its first name); the push announces the
  other names of tied tensors as aliases, and the server hands the tensor to vLLM under the names
  vLLM has modules for (vllm_push.py). The first push of a model (not of a parameter stream: a
  sharded model has no one-process forward) is checked as the in-process engine's is
  (push_check.py): the server's log-probs on a fixed probe against the trainer's.
- Versions: `weight_version` is 0 for the weights the run starts (or resumes) with, +1 per push
  after that; GenerationOutput.versions gives each completion's version on the same scale.
Every HTTP call and collective has a timeout; a server that is gone raises ServerUnavailable
naming the url and saying how to resume the run.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import torch

from grouprl.policies.text.engines.base import GenerationOutput, SamplingParams, check_generate_args
from grouprl.policies.text.engines.push_check import check_push
from grouprl.policies.text.engines.server.channel import (
    broadcast,
    channel_device,
    host_store,
    open_group,
    resolve_backend,
)
from grouprl.policies.text.engines.vllm_push import Aliases, engine_state_dict, unique_tensors

SEED_RANGE = 2**30
RESUME_HINT = (
    "restart the server (grouprl vllm-serve --model ...) and resume the run with run.resume=true"
)


class ServerUnavailable(RuntimeError):
    """The vLLM server did not answer (gone, unreachable, or past the timeout)."""


class ServerRefused(RuntimeError):
    """The vLLM server answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# (name, shape, dtype, get): get() returns the full tensor (a collective on sharded backends)
WeightSpec = tuple[str, list[int], torch.dtype, Callable[[], torch.Tensor]]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def full_specs(state: dict[str, torch.Tensor]) -> tuple[list[WeightSpec], Aliases]:
    """One spec per distinct tensor of a state dict, and the aliases of the tied ones."""
    items, aliases = unique_tensors(state)
    return [(k, list(v.shape), v.dtype, lambda v=v: v) for k, v in items], aliases


def lora_specs(model: Any) -> tuple[list[WeightSpec], dict[str, float]]:
    """A peft model's adapters: `NAME.weight::lora_A` / `::lora_B` for every adapted weight, and
    its scaling (worker.py merges W0 + scaling * B @ A)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    specs: list[WeightSpec] = []
    scalings: dict[str, float] = {}
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        adapters = list(module.active_adapters)
        if len(adapters) != 1:
            raise ValueError(f"vllm_server LoRA pushes take one active adapter, {name} has "
                             f"{adapters}")  # fmt: skip
        ad = adapters[0]
        if getattr(module, "fan_in_fan_out", False) or module.use_dora.get(ad, False):
            raise ValueError(f"vllm_server LoRA pushes: {name} uses fan_in_fan_out or DoRA, "
                             "which the server's merge (W0 + s * B @ A) does not cover")  # fmt: skip
        a = module.lora_A[ad].weight  # [r, in]
        b = module.lora_B[ad].weight  # [out, r]
        key = f"{name}.weight"
        scalings[key] = float(module.scaling[ad])
        specs.append((key + "::lora_A", list(a.shape), a.dtype, lambda a=a: a.detach()))
        specs.append((key + "::lora_B", list(b.shape), b.dtype, lambda b=b: b.detach()))
    if not specs:
        raise ValueError("a peft model without LoRA layers: nothing to push")
    return specs, scalings


def base_aliases(model: Any) -> Aliases:
    """The tied tensors of a peft model's base model, under the base model's own names."""
    state = model.get_base_model().state_dict()
    names = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
    return unique_tensors(names)[1]


class VLLMServerEngine:
    """A client of `grouprl vllm-serve` at `url` (see module docstring).

    timeout_s:        generate calls (the server may also be serving other trainers)
    connect_timeout_s: short calls (info, announcing a push)
    weight_timeout_s: a weight push: the channel's collectives and the server's load
    channel_host / channel_port: where the trainer's main process serves the channel's store
                      (an address the server's workers reach; port 0: a free port)
    backend:          auto (nccl with CUDA, else gloo) | gloo | nccl
    seed:             the client's request-seed stream (calls without seeds)
    push_check:       after the first push of a model: error (PushMismatch), warn or off
    """

    remote = True  # sync.push_weights: the training loop pushes through `push`

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 30.0,
        weight_timeout_s: float = 600.0,
        channel_host: str = "127.0.0.1",
        channel_port: int = 0,
        backend: str = "auto",
        seed: int = 0,
        push_check: str = "error",
    ) -> None:
        if push_check not in ("error", "warn", "off"):
            raise ValueError(f"push_check must be error, warn or off, got {push_check!r}")
        self.push_check = push_check
        self.checked = push_check == "off"  # the first push of a model is checked once
        self.last_push: dict[str, Any] = {}  # the server's not_loaded and the push's aliases
        self.url = url.rstrip("/")
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.weight_timeout_s = weight_timeout_s
        self.channel_host, self.channel_port = channel_host, channel_port
        self.backend = resolve_backend(backend)
        info = self.info()
        self.instance = info["instance"]
        self.eos_ids = list(info["eos_ids"])
        self._needed = info["version"]  # the server version generate asks for at least
        self._base: int | None = None  # the server version of this run's version 0
        self._start = info["version"]
        self._store: Any = None  # the channel's TCPStore, served by this process
        self._channel: tuple[Any, Any, str] | None = None  # (store, group, server instance)
        self.reseed(seed)

    # ---- HTTP ----------------------------------------------------------------------------------

    def _call(self, method: str, path: str, body: dict | None = None,
              timeout: float | None = None) -> dict:  # fmt: skip
        timeout = self.connect_timeout_s if timeout is None else timeout
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                msg = json.loads(exc.read())["error"]["message"]
            except Exception:  # not our JSON: the raw status line
                msg = str(exc)
            raise ServerRefused(
                exc.code, f"vLLM server {self.url} refused {method} {path} ({exc.code}): {msg}"
            ) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerUnavailable(
                f"vLLM server {self.url} did not answer {method} {path} within {timeout}s "
                f"({type(reason).__name__}: {reason}); it may have died or be unreachable: "
                f"{RESUME_HINT}"
            ) from None

    def info(self) -> dict:
        return self._call("GET", "/info")

    # ---- generation ----------------------------------------------------------------------------

    def reseed(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def request_seeds(self, n: int) -> list[int]:
        base = self._rng.randrange(SEED_RANGE)
        return [base + i for i in range(n)]

    @property
    def weight_version(self) -> int:
        """0 for the weights the run started with, +1 per push since (see module docstring)."""
        return self._needed - (self._start if self._base is None else self._base)

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        params: SamplingParams,
        *,
        greedy: bool = False,
        seeds: list[int] | None = None,
    ) -> GenerationOutput:
        check_generate_args("VLLMServerEngine", prompt_token_ids, seeds)
        if not prompt_token_ids:
            return GenerationOutput([], [], [], versions=[])
        if seeds is None:
            seeds = self.request_seeds(len(prompt_token_ids))
        body = {
            "prompt_token_ids": [list(map(int, p)) for p in prompt_token_ids],
            "seeds": [int(s) for s in seeds],
            "sampling": {"temperature": params.temperature, "top_p": params.top_p,
                         "top_k": params.top_k, "max_new_tokens": params.max_new_tokens,
                         "stop": list(params.stop)},
            "greedy": greedy,
            "min_version": self._needed,
        }  # fmt: skip
        out = self._call("POST", "/generate", body, timeout=self.timeout_s)
        base = self._start if self._base is None else self._base
        return GenerationOutput(out["completion_ids"], out["logprobs"], out["truncated"],
                                versions=[v - base for v in out["versions"]])  # fmt: skip

    # ---- weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Any) -> None:
        """One process: push a model, peft model or state dict to the server (the first push
        of a model is checked)."""
        self._set_version(self._send(*weight_specs(weights)))
        if not self.checked and not isinstance(weights, dict):
            self.check_push(weights)

    def check_push(self, model: Any) -> float:
        """push_check.py's probe against `model` after a push: the gap in nats (PushMismatch
        above the bound, or a warning with push_check 'warn')."""
        self.checked = True
        aliases = self.last_push.get("aliases")
        return check_push(self, model, self.last_push, aliases, self.push_check)

    def push(self, policy: Any, processes: Any = None) -> None:
        """The training loop's push (sync.push_weights): see the module docstring. processes:
        the trainer's Dist (is_main, world, broadcast_object), None for one process."""
        main = processes is None or processes.is_main
        stream = getattr(getattr(policy, "backend", None), "stream_full_weights", None)
        streamed = stream() if stream is not None else None  # sharded parameters only
        if streamed is not None:
            (specs, aliases), kind, scalings, collective = streamed, "full", {}, True
        else:
            specs, kind, scalings, aliases = weight_specs(policy.model)
            collective = False
        if main:
            version = self._send(specs, kind, scalings, aliases)
        else:
            version = None
            if collective:  # the gathers are collectives of the trainer's group: join them
                for spec in specs:
                    spec[3]()
        if processes is not None and processes.world > 1:
            version = processes.broadcast_object(version)
        self._set_version(version)
        if main and not collective and not self.checked:
            self.check_push(policy.model)
        self.checked = True  # a sharded model is not checked (no one-process forward)

    def _set_version(self, version: int) -> None:
        self._needed = version
        if self._base is None:  # the run's first push: its weights are version 0
            self._base = version

    def _ensure_channel(self) -> Any:
        info = self.info()
        if self._channel is not None and self._channel[2] == info["instance"]:
            return self._channel[1]
        if info["instance"] != self.instance:  # a restarted server: its versions start anew
            self.instance, self._base, self._start = info["instance"], None, info["version"]
        t = self.weight_timeout_s
        if self._store is None:  # one store per client: a new channel is a new tag in it
            self._store = host_store(self.channel_host, self.channel_port, t)
        store, tag = self._store, uuid.uuid4().hex
        world = self._call("POST", "/weights/channel", {
            "host": self.channel_host, "port": store.port, "tag": tag,
            "backend": self.backend, "timeout_s": t})["world"]  # fmt: skip
        try:
            group = open_group(store, tag, 0, world, self.backend, t, self.channel_host)
        except Exception as exc:
            raise ServerUnavailable(
                f"the weight channel to vLLM server {self.url} did not form within {t}s "
                f"({type(exc).__name__}: {exc}); check rollout.server.channel_host is reachable "
                f"from the server; {RESUME_HINT}"
            ) from None
        self._call("POST", "/weights/finish", {"timeout_s": t}, timeout=t + 10)
        self._channel = (store, group, info["instance"])
        return group

    def _send(
        self, specs: list[WeightSpec], kind: str, scalings: dict[str, float], aliases: Aliases
    ) -> int:
        """Announce, broadcast and load one push; returns the server's new version."""
        group = self._ensure_channel()
        t = self.weight_timeout_s
        params = [{"name": n, "shape": list(s), "dtype": _dtype_name(d)} for n, s, d, _ in specs]
        body = {"kind": kind, "params": params, "scalings": scalings, "aliases": aliases}
        self._call("POST", "/weights/update", body)
        device = channel_device(self.backend)
        name = None
        try:
            for name, _, dtype, get in specs:  # noqa: B007 (named in the error below)
                t_full = get()
                tensor = t_full.detach().to(device=device, dtype=dtype).contiguous()
                broadcast(group, tensor, t)
                del t_full, tensor
        except Exception as exc:
            self._channel = None
            raise ServerUnavailable(
                f"pushing weights to vLLM server {self.url} failed at {name!r} "
                f"({type(exc).__name__}: {exc}); the server may have died: {RESUME_HINT}"
            ) from None
        done = self._call("POST", "/weights/finish", {"timeout_s": t}, timeout=t + 10)
        self.last_push = {"not_loaded": done.get("not_loaded", []), "aliases": aliases}
        return done["version"]


def weight_specs(weights: Any) -> tuple[list[WeightSpec], str, dict[str, float], Aliases]:
    """(specs, kind, scalings, aliases) of a push: a peft model's adapters (lora), else the full
    weights of a transformers model or state dict (each distinct tensor once)."""
    if hasattr(weights, "get_base_model") and linear_adapters_only(weights):
        specs, scalings = lora_specs(weights)
        return specs, "lora", scalings, base_aliases(weights)
    # in the checkpoint layout, as vLLM's loaders read (a peft model: its merged weights)
    specs, aliases = full_specs(engine_state_dict(weights))
    return specs, "full", {}, aliases


def linear_adapters_only(model: Any) -> bool:
    """Whether every LoRA layer of a peft model adapts a linear layer (the server merges
    W0 + s * B @ A); False with adapters on parameters (peft's ParamWrapper: MoE expert stacks)."""
    from peft.tuners.lora import Linear, LoraLayer

    layers = [m for m in model.get_base_model().modules() if isinstance(m, LoraLayer)]
    return all(isinstance(m, Linear) for m in layers)
