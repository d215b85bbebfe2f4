"""LoRA adapters (arXiv:2106.09685) for the causal-LM and vision-language policies, through peft.

Settings, wrapping a transformers model with an adapter on the targets resolved from its module
tree (policies/lora_targets.py: every linear layer but the output head, and stacked MoE expert
weights through peft's parameter targeting), and the merged weights written by
`save_pretrained` (W + delta under the original parameter names, so the folder loads as a plain
transformers model). The reference policy under LoRA is the same weights with the adapter
disabled (see causal_lm.py); nothing here changes that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from grouprl.policies.lora_targets import ALL_LINEAR, EXPERTS, LoRATargets, check_applied


@dataclass
class LoRASettings:
    """LoRA adapter settings (peft). target_modules: "all-linear" (every linear layer of the
    language model but the output head) or module names (peft's suffix rule); target_parameters:
    "experts" (stacked 3-D MoE expert weights), "none" or parameter names. See lora_targets.py."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | list[str] = ALL_LINEAR
    target_parameters: str | list[str] = EXPERTS


def lora_settings(lora: LoRASettings | dict | None) -> LoRASettings | None:
    """LoRASettings from a LoRASettings, a dict of its fields (unknown keys fail) or None."""
    if lora is None or isinstance(lora, LoRASettings):
        return lora
    if isinstance(lora, dict):
        allowed = set(LoRASettings.__dataclass_fields__)
        if unknown := set(lora) - allowed:
            raise ValueError(f"unknown LoRA keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        return LoRASettings(**lora)
    raise TypeError(f"lora must be a LoRASettings, a dict or None, got {type(lora).__name__}")


def add_lora(model: Any, settings: LoRASettings, targets: LoRATargets) -> Any:
    """The model wrapped by peft with a fresh adapter on exactly `targets` (resolve_targets);
    only adapter weights require grad."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(targets.modules),
        target_parameters=list(targets.parameters) or None,
        task_type="CAUSAL_LM",
    )
    wrapped = get_peft_model(model, config)
    check_applied(wrapped, targets)
    return wrapped


def _unwrapped(key: str) -> str:
    """A peft-wrapped state-dict key under its original name (every `base_layer` hop removed:
    nested ParamWrappers give `experts.base_layer.base_layer.down_proj`)."""
    return ".".join(part for part in key.split(".") if part != "base_layer")


def merged_state_dict(base: Any) -> dict[str, Tensor]:
    """The base model's weights with each LoRA delta added, under the original parameter names.
    Deltas are matched to weights by identity: an nn.Linear's weight (lora.Linear) or the
    nn.Parameter a ParamWrapper adapts (an [E, out, in] expert stack); added in float32, stored
    in the weight's dtype."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    merged: dict[int, Tensor] = {}  # id(base weight) -> W + sum of deltas
    for module in base.modules():
        if not isinstance(module, LoraLayer):
            continue
        if isinstance(module, ParamWrapper):
            weight = module.get_param()  # [E, out, in] / [E, in, out] / [out, in]
        else:
            weight = module.get_base_layer().weight  # [out, in]
        w = merged.get(id(weight), weight.detach())
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                delta = module.get_delta_weight(adapter).detach()  # same shape as the weight
                w = (w.float() + delta.float()).to(weight.dtype)
        merged[id(weight)] = w
    state = {}
    for key, value in base.state_dict(keep_vars=True).items():
        if ".lora_" in key:
            continue
        state[_unwrapped(key)] = merged.get(id(value), value).detach().cpu().contiguous()
    return state
