"""How each accelerate backend wraps the policy's model (used by grouprl.runtime.distributed.dist; see its
docstring for placement, loss scaling and I/O). Chosen from accelerate's distributed type, i.e. from
the `accelerate launch --config_file` given (examples with comments: configs/accelerate/).

  ddp        MULTI_CPU / MULTI_GPU (...): torch DDP around `ScoringModule`; parameters replicated.
  fsdp2      FSDP with fsdp_version 2: accelerate's fully_shard of the decoder layers, embeddings,
             final norm + LM head and the root; parameters, gradients and AdamW moments sharded.
  deepspeed  DeepSpeed ZeRO-2 (optimizer states + gradients sharded) or ZeRO-3 (parameters too).

Sharded parameters (fsdp2, ZeRO-3) cannot generate with transformers' `generate` nor be saved by
`save_pretrained`, so these backends keep a plain full copy of the model on every process (the
policy's `model` and its HF engine's) and refresh it after every optimizer step with one full
state-dict gather; the sharded model only trains. Memory: one full model per process on top of the
shards (what gathering the parameters to generate would take anyway); at the scale where that does
not fit, generation belongs to an engine with its own weights (rollout.engine vllm_server: its
weight push gathers one parameter at a time, `stream_full_weights`, instead of the whole state
dict; the plain copy is still refreshed for saving).

What was run here (CPU, gloo): ddp end to end (tests/test_distributed.py); fsdp2 end to end through
accelerate's real FSDP2 preparation with the distributed type forced to FSDP on CPU processes
(accelerate itself runs FSDP on GPUs only; the slow test in tests/test_distributed.py): 2 processes
match 1 to 2e-6 and a 2-process checkpoint resumes on 1. Not run: DeepSpeed (no deepspeed package,
no GPU), FSDP2 on GPUs / NCCL. Known limits: LoRA is refused with fsdp2 / ZeRO-3 (adapter merging
on sharded weights is not written); with DeepSpeed the optimizer step happens inside DeepSpeed
(gradient clipping from the DeepSpeed config, `train.max_grad_norm` unused, no non-finite skip of
ours), and checkpoints hold the full weights but not DeepSpeed's optimizer partitions / fp32 master
weights, so `run.resume` refuses a DeepSpeed run (start a new run from the saved weights instead).
"""

from __future__ import annotations

from typing import Any

import torch


def backend_for(cfg: Any, dist: Any) -> Any:
    """The backend object of this launch, from accelerate's distributed type."""
    acc = dist.accelerator
    kind = acc.distributed_type.value if hasattr(acc.distributed_type, "value") else "NO"
    if kind == "FSDP":
        if acc.state.fsdp_plugin.fsdp_version != 2:
            raise ValueError("FSDP version 1 is not supported; set fsdp_version: 2 (FSDP2)")
        return FSDP2(dist)
    if kind == "DEEPSPEED":
        return DeepSpeed(dist)
    if kind == "NO" or not kind.startswith("MULTI_"):
        raise ValueError(
            f"accelerate distributed type {kind!r} with WORLD_SIZE > 1 is not supported; "
            "use a DDP (multi-CPU / multi-GPU), FSDP2 or DeepSpeed config (configs/accelerate/)"
        )
    return DDP(dist)


class DDP:
    """torch DistributedDataParallel (through accelerate) around the ScoringModule."""

    def __init__(self, dist: Any) -> None:
        self.dist, self.module = dist, None

    def wrap(self, policy: Any, module: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        self.module = self.dist.accelerator.prepare_model(module)
        if not isinstance(self.module, torch.nn.parallel.DistributedDataParallel):
            raise RuntimeError(f"accelerate did not wrap the model in DDP: {type(self.module)}")
        return self.module, optimizer

    def set_sync(self, is_last: bool) -> None:
        self.module.require_backward_grad_sync = is_last  # what DDP.no_sync() toggles

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()


class _PlainCopy:
    """A full, unsharded copy of the model for generation and saving (see module docstring).

    Sharded backends score with the "plain" log-prob path: the "fast" one runs the decoder once
    per group of identical prompts, a count that differs between processes, and every process
    must run the same sequence of parameter gathers / reduce-scatters."""

    scoring_path = "plain"

    def attach(self, policy: Any) -> None:
        if policy.lora is not None:
            raise ValueError(
                f"LoRA with {type(self).__name__} (sharded parameters) is not supported; use the "
                "DDP or DeepSpeed ZeRO-2 config, or train all weights"
            )
        self.sharded_model = policy.model  # trains inside the wrapped scoring module
        self.copy = policy.sampling_copy()  # the policy and its local engine sample with a copy

    def refresh(self) -> None:  # every process, after every optimizer step
        with torch.no_grad():
            self.copy.load_state_dict(self.full_state_dict())


class FSDP2(_PlainCopy):
    def __init__(self, dist: Any) -> None:
        self.dist, self.module = dist, None

    def wrap(self, policy: Any, module: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        self.attach(policy)
        self.module, optimizer = self.dist.accelerator.prepare(module, optimizer)
        self.raw_optimizer = getattr(optimizer, "optimizer", optimizer)
        return self.module, _StepHook(optimizer, self)

    def set_sync(self, is_last: bool) -> None:
        self.module.set_requires_gradient_sync(is_last)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm(self, params: list, max_norm: float | None) -> float:
        params = [p for p in params if p.grad is not None]
        bound = max_norm if max_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, bound)  # a DTensor for DTensor gradients
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        return {k.removeprefix("model."): v for k, v in sd.items()}

    def stream_full_weights(self) -> tuple[list[tuple], dict[str, list[str]]]:
        """(name, shape, dtype, get) per distinct parameter under its transformers name, and the
        other names of tied parameters (policies/tied.unique_parameters: a tied head travels once,
        the server hands it to vLLM under the names vLLM has modules for): `get()` gathers that
        one parameter (an all-gather of every process, in the same order everywhere) for a
        weight push to a vllm_server, so a push never holds more than one full parameter."""
        from grouprl.policies.tied import unique_parameters

        params, aliases = unique_parameters(self.module)
        out = []
        for name, p in params:
            get = (lambda p=p: p.full_tensor()) if hasattr(p, "full_tensor") else (lambda p=p: p)
            out.append((name.removeprefix("model."), list(p.shape), p.dtype, get))
        return out, _strip_model(aliases)

    def load_full(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = {f"model.{k}": v for k, v in state.items()}
        set_model_state_dict(self.module, full, options=StateDictOptions(full_state_dict=True))

    def optimizer_state(self) -> dict:
        """The full AdamW state in torch's own layout (parameters numbered in optimizer order),
        the layout one process and DDP save: checkpoints resume across backends and counts."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        by_name = get_optimizer_state_dict(self.module, self.raw_optimizer, options=opts)
        if not by_name:  # cpu_offload: only the main process receives the state
            return {"state": {}, "param_groups": []}
        index = {name: i for i, name in enumerate(self._names())}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]
        return {"state": {index[n]: v for n, v in by_name["state"].items()}, "param_groups": groups}

    def load_optimizer_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        names = self._names()
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
        by_name = {
            "state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": groups,
        }
        opts = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(self.module, self.raw_optimizer, by_name, options=opts)

    def _names(self) -> list[str]:
        """Parameter names (as torch.distributed.checkpoint writes them) in optimizer order."""
        name_of = {id(p): n for n, p in self.module.named_parameters()}
        return [name_of[id(p)] for g in self.raw_optimizer.param_groups for p in g["params"]]


class DeepSpeed(_PlainCopy):
    def __init__(self, dist: Any) -> None:
        self.dist, self.module = dist, None
        self.stage = int(dist.accelerator.state.deepspeed_plugin.zero_stage)

    def wrap(self, policy: Any, module: torch.nn.Module, optimizer: Any) -> tuple[Any, Any]:
        plugin = self.dist.accelerator.state.deepspeed_plugin
        if plugin.is_auto("train_micro_batch_size_per_gpu"):  # grouprl batches rows itself;
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = (
                1  # DeepSpeed wants a number
            )
        if self.stage == 3:
            self.attach(policy)
        self.module, optimizer = self.dist.accelerator.prepare(module, optimizer)
        return self.module, _StepHook(optimizer, self)

    def set_sync(self, is_last: bool) -> None:
        self.module.set_gradient_accumulation_boundary(is_last)
        self.dist.accelerator.gradient_state._set_sync_gradients(is_last)  # DS steps at the last

    def backward(self, loss: torch.Tensor) -> None:
        self.dist.accelerator.backward(loss)  # engine.backward (+ engine.step on the last)

    def clip_grad_norm(self, params: list, max_norm: float | None) -> float:
        norm = self.module.get_global_grad_norm()  # clipped inside DeepSpeed (its config)
        return 0.0 if norm is None else float(norm)

    def full_state_dict(self) -> dict:
        import deepspeed

        params = list(self.module.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            sd = self.module.module.state_dict()
            return {k.removeprefix("model."): v.clone() for k, v in sd.items()}

    def stream_full_weights(self) -> tuple[list[tuple], dict[str, list[str]]] | None:
        """ZeRO-3: as FSDP2.stream_full_weights, each parameter gathered with DeepSpeed's
        GatheredParameters on its own (written, NOT run: no deepspeed package here). ZeRO-2: None
        (the parameters are whole; the policy's model is pushed as it is)."""
        if self.stage != 3:
            return None
        import deepspeed

        from grouprl.policies.tied import unique_parameters

        def gather(p: Any) -> torch.Tensor:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                return p.data.detach().clone()

        params, aliases = unique_parameters(self.module.module)
        return [
            (name.removeprefix("model."), list(getattr(p, "ds_shape", p.shape)), p.dtype,
             lambda p=p: gather(p))
            for name, p in params
        ], _strip_model(aliases)  # fmt: skip

    def load_full(self, state: dict) -> None:
        import deepspeed

        params = list(self.module.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if self.dist.is_main:
                self.module.module.model.load_state_dict(state)

    def optimizer_state(self) -> dict:
        return {"state": {}, "param_groups": [], "deepspeed": "partitions not saved"}

    def load_optimizer_state(self, state: dict) -> None:
        raise ValueError(
            "run.resume with DeepSpeed is not supported: checkpoints hold the full weights but not "
            "DeepSpeed's optimizer partitions; start a new run with model.name_or_path set to the "
            "checkpoint's model/ folder"
        )


class _StepHook:
    """The optimizer, with the plain copy refreshed after each step and, for sharded states, full
    (unsharded) state dicts so that checkpoints resume on any process count."""

    def __init__(self, optimizer: Any, backend: Any) -> None:
        self.optimizer, self.backend = optimizer, backend

    def step(self) -> None:
        self.optimizer.step()
        if hasattr(self.backend, "copy"):
            self.backend.refresh()

    def state_dict(self) -> dict:
        return self.backend.optimizer_state()

    def load_state_dict(self, state: dict) -> None:
        self.backend.load_optimizer_state(state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # what torch.amp.GradScaler.step / unscale_ read of an optimizer
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults


def _strip_model(aliases: dict[str, list[str]]) -> dict[str, list[str]]:
    """Aliases under transformers names (the wrapped module is the policy: its `model.` prefix)."""
    return {
        k.removeprefix("model."): [n.removeprefix("model.") for n in v] for k, v in aliases.items()
    }
