"""LoRA adapters (arXiv:2106.09685) for the causal-LM policy, through peft.

Settings, wrapping a transformers model with an adapter, and the merged weights written by
`save_pretrained` (W + delta under the original parameter names, so the folder loads as a plain
transformers model). The reference policy under LoRA is the same weights with the adapter disabled
(see causal_lm.py); nothing here changes that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


@dataclass
class LoRASettings:
    """LoRA adapter settings (peft). target_modules default: the attention projections of
    Qwen2/Llama-style models; add gate_proj/up_proj/down_proj for the MLP."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )


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


def add_lora(model: Any, settings: LoRASettings) -> Any:
    """The model wrapped by peft with a fresh adapter; only adapter weights require grad."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def merged_state_dict(base: Any) -> dict[str, Tensor]:
    """The base model's weights with each LoRA delta added, under the original parameter names."""
    from peft.tuners.lora import LoraLayer

    state = {}
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            w = module.get_base_layer().weight.detach()  # [out, in]
            for adapter in module.active_adapters:
                w = w + module.get_delta_weight(adapter).detach().to(w.dtype)  # [out, in]
            deltas[f"{name}.weight"] = w
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        state[key] = deltas.get(key, value).detach().cpu().contiguous()
    return state
