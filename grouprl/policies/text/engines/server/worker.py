"""Code that runs inside every vLLM worker of a `grouprl vllm-serve` server (vLLM's
`worker_extension_cls`; the server calls these methods on all workers with `collective_rpc`).

- `grouprl_join_channel`: the worker joins the weight channel (channel.py) as rank 1 + its vLLM
  rank (tensor-parallel rank), next to the trainer's rank 0.
- `grouprl_receive`: receives the announced tensors one by one (broadcast from rank 0) and loads
  them through vllm_push.load_into_vllm (vLLM's `reload_weights`), the path VLLMEngine.load_weights
  takes, streaming: each tensor is handed to vLLM's layer-wise reload as it arrives. Two kinds:
  - full: each distinct tensor of the model once, under its transformers name, with the other
    names of tied tensors as aliases (vLLM gets it under the names it has modules for).
  - lora: only LoRA adapters (`NAME.weight::lora_A` [r, in], `NAME.weight::lora_B` [out, r] and
    a scaling per NAME.weight); the worker keeps the base weights it read from the model folder
    once (one extra copy of the weights in host memory) and reloads W = W0 + scaling * B @ A
    (computed in float32, cast to W0's dtype) with every other weight as in the folder. That
    is peft's merge for plain LoRA (no DoRA, fan_in_fan_out false), so the base model of the
    trainer's peft policy must be the server's model folder. The trainer's aliases (its tied
    tensors) apply to the folder's weights too: a tied head left out of the folder reaches vLLM's
    head module under its own name where vLLM has one (else vLLM keeps a stale CPU copy of it).
If loading fails part-way, the remaining tensors are still received (and dropped), so the trainer's
broadcasts finish and the failure is reported to it over HTTP instead of as a timeout.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from grouprl.policies.text.engines.server.channel import (
    DTYPES,
    broadcast,
    channel_device,
    join_store,
    open_group,
)
from grouprl.policies.text.engines.vllm_push import load_into_vllm

LORA_A, LORA_B = "::lora_A", "::lora_B"


def base_weights(folder: str) -> dict[str, torch.Tensor]:
    """Every weight of a model folder's safetensors files (transformers names)."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"LoRA pushes merge into the base weights of the model folder, but {folder} has no "
            "*.safetensors file"
        )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def merge_lora(
    base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scalings: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base weight, with W0 + scaling * B @ A where an adapter names it."""
    for name in scalings:
        if name not in base:
            raise KeyError(f"LoRA adapter for {name!r}, which the base model folder does not have")
    for name, w in base.items():
        if name in scalings:
            a = adapters[name + LORA_A].float()  # [r, in]
            b = adapters[name + LORA_B].float()  # [out, r]
            w = (w.float() + scalings[name] * (b @ a)).to(w.dtype)  # [out, in]
        yield name, w


class WeightReceiver:
    """Mixed into vLLM's worker class (its `self.rank`, `self.vllm_config`, `reload_weights`)."""

    def grouprl_join_channel(
        self, host: str, port: int, tag: str, backend: str, timeout_s: float, world: int
    ) -> int:
        store = join_store(host, port, timeout_s)
        rank = 1 + int(self.rank)
        self._grouprl_channel = (open_group(store, tag, rank, world, backend, timeout_s, host),
                                 backend, timeout_s, store)  # fmt: skip
        return rank

    def _grouprl_stream(self, params: list[dict]) -> Iterator[tuple[str, torch.Tensor]]:
        group, backend, timeout_s, _ = self._grouprl_channel
        device = channel_device(backend)
        for p in params:
            t = torch.empty(p["shape"], dtype=DTYPES[p["dtype"]], device=device)
            broadcast(group, t, timeout_s)
            yield p["name"], t

    def grouprl_receive(
        self,
        kind: str,
        params: list[dict],
        scalings: dict[str, float],
        aliases: dict[str, list[str]] | None = None,
    ) -> dict:
        """Receive and load one push; returns load_into_vllm's report and the count received."""
        if getattr(self, "_grouprl_channel", None) is None:
            raise RuntimeError("no weight channel: the trainer has not joined this server yet")
        aliases = aliases or {}
        stream = self._grouprl_stream(params)
        try:
            if kind == "full":
                report = load_into_vllm(self, stream, aliases)
            elif kind == "lora":
                adapters = dict(stream)  # small: only the adapters travel
                if getattr(self, "_grouprl_base", None) is None:
                    self._grouprl_base = base_weights(self.vllm_config.model_config.model)
                merged = merge_lora(self._grouprl_base, adapters, scalings)
                report = load_into_vllm(self, merged, aliases)
            else:
                raise ValueError(f"unknown push kind {kind!r} (full or lora)")
        finally:
            for _ in stream:  # drain: the trainer's broadcasts must complete either way
                pass
        return {**report, "received": len(params)}
