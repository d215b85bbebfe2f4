"""LoRA (arXiv 2106.09685, peft) on flow / diffusion denoisers, and files diffusers pipelines load.

- `add_lora(model, settings)`: peft LoRA layers injected in place into the attention
  projections (the family's default targets unless the settings name others; one name at
  least must match a linear layer of the model, the others are named in a warning; the adapted
  modules are returned as LoRATargets, which the run logs and saves as lora_targets.json;
  diffusers models go
  through their own `add_adapter`, so `pipe.transformer.disable_adapters()` etc. keep working).
  Flow-GRPO's init: gaussian A, zero B, so the policy equals the base model at step 0. Only the
  adapter weights require grad.
- `adapters_disabled(model)`: the same weights with every LoRA layer bypassed (the KL reference).
- `save_lora(...)` writes `pytorch_lora_weights.safetensors` through the family pipeline's own
  `save_lora_weights` (keys "transformer.<module>.lora_A.weight" / "unet.<...>", with the peft config
  as adapter metadata so rank and alpha survive), which `pipe.load_lora_weights(dir)` reads.
  A user velocity module (no pipeline) gets the same key layout and metadata written directly.
- `save_model_folder(...)`: a diffusers model folder (config.json + diffusion_pytorch_model.safetensors)
  with every LoRA delta merged into the base weights, loadable by `<ModelClass>.from_pretrained`;
  for a user module only the merged weights (model.safetensors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grouprl.policies.flow.models import Family
from grouprl.policies.lora_targets import LoRATargets, resolve_targets
from grouprl.policies.text.lora import LoRASettings, merged_state_dict

LORA_FILE = "pytorch_lora_weights.safetensors"
ADAPTER = "default"
_METADATA_KEY = "lora_adapter_metadata"  # diffusers' safetensors metadata key


def flow_lora_settings(lora: LoRASettings | dict | None, family: Family) -> LoRASettings | None:
    """LoRASettings from settings, a dict of its fields (target_modules default: the family's
    attention projections) or None."""
    if lora is None or isinstance(lora, LoRASettings):
        return lora
    if not isinstance(lora, dict):
        raise TypeError(f"lora must be a LoRASettings, a dict or None, got {type(lora).__name__}")
    allowed = set(LoRASettings.__dataclass_fields__)
    if unknown := set(lora) - allowed:
        raise ValueError(f"unknown LoRA keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    return LoRASettings(**{"target_modules": list(family.lora_targets), **lora})


def _peft_config(settings: LoRASettings) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules
        if isinstance(settings.target_modules, str)  # "all-linear": peft resolves it the same
        else list(settings.target_modules),
        init_lora_weights="gaussian",
    )


def add_lora(model: torch.nn.Module, settings: LoRASettings) -> LoRATargets:
    """Inject a fresh adapter in place; the base weights are frozen, the adapter trainable.
    Returns the adapted modules, resolved before anything is injected (lora_targets'
    suffix rule; peft's semantics kept: target lists are written for every variant of a family,
    so one entry must match a linear layer and the entries that match none are named in a
    warning); flow / unet take no parameter targets (their denoisers hold no stacked expert
    weights)."""
    from peft import inject_adapter_in_model

    if not isinstance(settings.target_parameters, str):
        raise ValueError(
            f"lora.target_parameters {settings.target_parameters} cannot apply to "
            f"{type(model).__name__}: flow / unet LoRA adapts modules only (lora.target_modules)"
        )
    targets = resolve_targets(
        model, dataclasses.replace(settings, target_parameters="none"), every_entry=False
    )
    # peft gets the resolved full names: it reads a string as "all-linear" or a regex, and
    # "attention" is grouprl's (lora_targets.ATTENTION), resolved from the classes above
    config = _peft_config(dataclasses.replace(settings, target_modules=list(targets.modules)))
    try:
        if hasattr(model, "add_adapter") and hasattr(model, "_hf_peft_config_loaded"):
            model.add_adapter(config, adapter_name=ADAPTER)  # diffusers models
        else:
            inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:
        raise ValueError(
            f"LoRA target_modules {settings.target_modules} do not fit "
            f"{type(model).__name__}: {str(e).splitlines()[0]}"
        ) from None
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    adapted = sorted(n for n, m in model.named_modules() if m in set(lora_layers(model)))
    if adapted != sorted(targets.modules):
        raise ValueError(
            f"peft adapted {len(adapted)} modules of {type(model).__name__}, the resolved "
            f"lora.target_modules name {len(targets.modules)}: "
            f"{sorted(set(adapted) ^ set(targets.modules))[:6]}"
        )
    return targets


def lora_layers(model: torch.nn.Module) -> list[Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Every LoRA layer bypassed inside the block (restored after, requires_grad included)."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("adapters_disabled: the model has no LoRA layers")
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for n, p in model.named_parameters():
            p.requires_grad_(grads[n])


def lora_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """Adapter weights under peft's saved names ("<module>.lora_A.weight", no adapter name)."""
    tag = f".{ADAPTER}."
    return {
        k.replace(tag, "."): v.detach().cpu().contiguous()
        for k, v in model.state_dict().items()
        if ".lora_" in k and tag in k
    }


def save_lora(
    model: torch.nn.Module, family: Family, settings: LoRASettings, directory: Path,
    weight_name: str = LORA_FILE,
) -> Path:  # fmt: skip
    """Write directory/<weight_name> (pytorch_lora_weights.safetensors) in the diffusers LoRA
    format. A second expert's file (weight_name of experts.lora_file) holds the same
    "transformer." keys: diffusers loads it with load_lora_weights(..., weight_name=...,
    load_into_transformer_2=True)."""
    state = lora_state_dict(model)
    meta = _peft_config(settings).to_dict()
    if isinstance(settings.target_modules, str):  # "attention" / "all-linear": what was adapted
        layers = set(lora_layers(model))
        meta["target_modules"] = sorted(n for n, m in model.named_modules() if m in layers)
    else:
        meta["target_modules"] = sorted(meta["target_modules"])
    directory.mkdir(parents=True, exist_ok=True)
    if family.pipeline is not None:
        import diffusers

        pipe_cls = getattr(diffusers, family.pipeline)
        pipe_cls.save_lora_weights(
            directory,
            **{f"{family.folder}_lora_layers": state,
               f"{family.folder}_lora_adapter_metadata": meta},
            weight_name=weight_name,
        )  # fmt: skip
    else:
        from safetensors.torch import save_file

        prefixed = {f"{family.folder}.{k}": v for k, v in state.items()}
        packed = {f"{family.folder}.{k}": v for k, v in meta.items()}
        metadata = {"format": "pt", _METADATA_KEY: json.dumps(packed, sort_keys=True, default=list)}
        save_file(prefixed, str(directory / weight_name), metadata=metadata)
    return directory / weight_name


def load_lora(
    model: torch.nn.Module, family: Family, settings: LoRASettings, directory: Path,
    weight_name: str = LORA_FILE,
) -> None:  # fmt: skip
    """Load save_lora's file into the model's adapter; keys, shapes and alpha must all match."""
    from safetensors import safe_open

    path = Path(directory) / weight_name
    if not path.is_file():
        raise FileNotFoundError(f"no {weight_name} in {str(directory)!r}")
    prefix = f"{family.folder}."
    with safe_open(str(path), framework="pt") as f:
        saved = {k[len(prefix) :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
        metadata = json.loads((f.metadata() or {}).get(_METADATA_KEY, "{}"))
    alpha = metadata.get(f"{prefix}lora_alpha")
    if alpha is not None and float(alpha) != float(settings.alpha):
        raise ValueError(
            f"{path} was saved with lora alpha {alpha}, this policy uses {settings.alpha}"
        )
    params = dict(model.named_parameters())
    named = {k: k.replace(".lora_A.", f".lora_A.{ADAPTER}.").replace(
        ".lora_B.", f".lora_B.{ADAPTER}.") for k in saved}  # fmt: skip
    expected = {n for n in params if ".lora_" in n and f".{ADAPTER}." in n}
    missing, unexpected = expected - set(named.values()), set(named.values()) - expected
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match this policy's adapter: missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]}"
        )
    with torch.no_grad():
        for k, name in named.items():
            if params[name].shape != saved[k].shape:
                raise ValueError(
                    f"{path}: {k} has shape {tuple(saved[k].shape)}, the adapter expects "
                    f"{tuple(params[name].shape)} (a different LoRA rank?)"
                )
        for k, name in named.items():
            params[name].copy_(saved[k])


def save_model_folder(model: torch.nn.Module, directory: Path) -> Path:
    """Merged full weights: a diffusers model folder, or model.safetensors for a user module."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if lora_layers(model):
        state = merged_state_dict(model)
    else:
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if hasattr(model, "save_config"):  # diffusers ModelMixin
        model.save_config(directory)
        save_file(state, str(directory / "diffusion_pytorch_model.safetensors"))
    else:
        save_file(state, str(directory / "model.safetensors"))
    return directory


def load_model_folder(model: torch.nn.Module, directory: Path) -> None:
    """Load save_model_folder's weights into a model without LoRA (strict: every key must match)."""
    from safetensors.torch import load_file

    for name in ("diffusion_pytorch_model.safetensors", "model.safetensors"):
        if (Path(directory) / name).is_file():
            state = load_file(str(Path(directory) / name))
            break
    else:
        raise FileNotFoundError(f"no model weights (*.safetensors) in {str(directory)!r}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"weights in {str(directory)!r} do not match the model: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
