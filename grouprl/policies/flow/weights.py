"""The weights a flow / diffusion policy manages around its denoiser: LoRA or full fine-tuning, the
frozen reference, the "old" weights of the likelihood-free objectives, and checkpoints.

- reference: under LoRA the same weights with the adapter bypassed; under full fine-tuning a frozen
  deep copy made on first use (so only runs with a KL or a reference term pay for it).
- old weights (DiffusionNFT arXiv 2509.16117, AWM arXiv 2509.25050): a copy of the trainable
  weights, swapped into the live parameters for a no-grad forward and swapped back after;
  `update_old(d)` sets old <- d old + (1 - d) current (the first call copies the current weights).
  Swapping restores the original storage, so a graph built before the swap still backpropagates
  into the right values.
- two experts (experts.DenoiserExperts): an adapter on each trained expert, the frozen expert
  untouched; checkpoints write one LoRA file per trained expert (experts.lora_file) and, for a
  full model, one model folder per expert (transformer/, transformer_2/).
- state_dict: the full weights, or only the adapter weights under LoRA, plus "old::<name>" once old
  weights exist (a resumed run keeps them).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grouprl.policies.base import OLD
from grouprl.policies.flow import lora as flow_lora
from grouprl.policies.flow.experts import DenoiserExperts, lora_file
from grouprl.policies.flow.models import Family
from grouprl.policies.lora_targets import LoRATargets, write_targets
from grouprl.policies.precision import master_weights
from grouprl.policies.text.lora import LoRASettings


class FlowWeights:
    """Weights of `model` as a policy trains them (module docstring)."""

    def __init__(self, model: torch.nn.Module, family: Family, lora: LoRASettings | None) -> None:
        self.model, self.family, self.lora = model, family, lora
        # the adapted modules, resolved from the module tree: logged and saved with the run
        # (with two experts, each name is prefixed by its expert's folder)
        self.lora_targets: LoRATargets | None = None
        if lora is not None:
            found = {n: flow_lora.add_lora(net, lora) for n, net in self._trained_nets().items()}
            self.lora_targets = (
                next(iter(found.values()))
                if not isinstance(model, DenoiserExperts)
                else LoRATargets(
                    modules=tuple(f"{n}.{m}" for n, t in found.items() for m in t.modules),
                    parameters=tuple(f"{n}.{p}" for n, t in found.items() for p in t.parameters),
                )
            )
        master_weights(model)  # trainable weights (and so AdamW's moments) in float32
        self._ref_model: Any = None
        self._old: dict[str, Tensor] | None = None

    def _nets(self) -> dict[str, torch.nn.Module]:
        """{folder name: denoiser}: both experts of a DenoiserExperts, else the one model."""
        if isinstance(self.model, DenoiserExperts):
            return dict(self.model.experts.items())
        return {self.family.folder: self.model}

    def _trained_nets(self) -> dict[str, torch.nn.Module]:
        if isinstance(self.model, DenoiserExperts):
            return {n: self.model.experts[n] for n in self.model.trained}
        return self._nets()

    def _file(self, name: str) -> str:
        experts = isinstance(self.model, DenoiserExperts)
        return lora_file(name) if experts else flow_lora.LORA_FILE

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    @contextlib.contextmanager
    def reference_model(self) -> Iterator[torch.nn.Module]:
        """The module to score the reference with (adapter bypassed, or the frozen copy)."""
        if self.lora is not None:
            with flow_lora.adapters_disabled(self.model):
                yield self.model
            return
        if self._ref_model is None:
            self._ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        yield self._ref_model

    def update_old(self, decay: float) -> None:
        if not 0 <= decay <= 1:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        with torch.no_grad():
            if self._old is None:
                self._old = {k: p.detach().clone() for k, p in self.trainable().items()}
                return
            for k, p in self.trainable().items():
                self._old[k].mul_(decay).add_(p.detach(), alpha=1 - decay)

    @contextlib.contextmanager
    def old_weights(self) -> Iterator[None]:
        if self._old is None:
            raise ValueError("no old weights yet: call update_old(decay) once first")
        named = self.trainable()
        saved = {k: p.data for k, p in named.items()}
        try:
            for k, p in named.items():
                p.data = self._old[k]
            yield
        finally:
            for k, p in named.items():
                p.data = saved[k]

    def to(self, device: torch.device | str) -> None:
        for m in (self.model, self._ref_model):
            if m is not None:
                m.to(device)
        if self._old is not None:
            self._old = {k: v.to(device) for k, v in self._old.items()}

    def state_dict(self) -> dict[str, Tensor]:
        names = set(self.trainable()) if self.lora is not None else None
        state = {k: v for k, v in self.model.state_dict().items() if names is None or k in names}
        if self._old is not None:
            state.update({f"{OLD}{k}": v for k, v in self._old.items()})
        return state

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Inverse of state_dict(); checks every key before touching any weight."""
        old = {k[len(OLD) :]: v for k, v in state.items() if k.startswith(OLD)}
        own = {k: v for k, v in state.items() if not k.startswith(OLD)}
        expected = {k for k in self.state_dict() if not k.startswith(OLD)}
        bad_old = set(old) - set(self.trainable())
        if set(own) != expected or bad_old:
            raise KeyError(
                f"state dict does not match this policy: missing {sorted(expected - set(own))[:5]}, "
                f"unexpected {sorted((set(own) - expected) | bad_old)[:5]}"
            )
        self.model.load_state_dict(own, strict=self.lora is None)
        if old:
            device = next(iter(self.model.parameters())).device
            self._old = {k: v.detach().clone().to(device) for k, v in old.items()}

    def save(self, directory: Path, merge_lora: bool) -> set[str]:
        """LoRA file (under LoRA; one per trained expert) and / or the merged model folder
        <directory>/<family folder> (one per expert); returns the model folders written."""
        if self.lora is not None:
            for name, net in self._trained_nets().items():
                flow_lora.save_lora(net, self.family, self.lora, directory, self._file(name))
            write_targets(self.lora_targets, directory)
        if self.lora is not None and not merge_lora:
            return set()
        for name, net in self._nets().items():
            flow_lora.save_model_folder(net, directory / name)
        return set(self._nets())

    def load(self, directory: Path) -> None:
        if self.lora is not None:
            for name, net in self._trained_nets().items():
                flow_lora.load_lora(net, self.family, self.lora, directory, self._file(name))
        else:
            for name, net in self._nets().items():
                flow_lora.load_model_folder(net, directory / name)


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute the denoiser's block activations in backward (diffusers' own switch, which the
    transformer and UNet blocks read when grad is enabled); an error for a model without one."""
    if not getattr(model, "_supports_gradient_checkpointing", False) or not hasattr(
        model, "enable_gradient_checkpointing"
    ):
        raise ValueError(
            f"model.gradient_checkpointing: {type(model).__name__} has no gradient checkpointing "
            "(diffusers ModelMixin with _supports_gradient_checkpointing); set it to false"
        )
    model.enable_gradient_checkpointing()
