"""Where LoRA adapters go, read from the module tree (arXiv:2106.09685, peft).

`resolve_targets(model, settings, scope)` turns the `lora` settings into the concrete list of
what gets an adapter, before any adapter is made:

- `target_modules: "all-linear"` (the default): every linear layer (nn.Linear, Conv1D) of the
  language model except the output head, found by peft's own all-linear resolution
  (`peft.tuners.tuners_utils._maybe_include_all_linear_layers`, which drops the layer
  `get_output_embeddings()` returns). Fused projections (Phi-3's `qkv_proj` / `gate_up_proj`) are
  linear layers like any other, so they are covered. A list keeps peft's name semantics: an entry
  matches a module whose dotted path is the entry or ends with "." + entry; every entry must match
  a linear layer, else an error lists the linear leaf names there are.
- `target_modules: "attention"` (diffusers denoisers: what the flow presets use): every linear
  layer inside one of the denoiser's attention modules, i.e. a module whose class is one of
  diffusers' attention classes (`AttentionModuleMixin`, `attention_processor.Attention`): SD3's
  and FLUX's joint-attention projections (to_q / to_k / to_v / to_out.0 and the add_* ones),
  Wan's and SANA's attn1 / attn2, whatever the family names its blocks. Read from the classes,
  not from a list of names that holds for one family (Flow-GRPO's "attn.to_q", ... matched
  nothing in Wan or SANA).
- `target_parameters: "experts"` (the default): every 3-D parameter of the language model that is
  not owned by a torch.nn layer: the stacked expert weights that transformers 5 MoE families
  (Qwen2/3-MoE, Mixtral, OLMoE, GPT-OSS, DeepSeek-V3, ...) keep as one [E, out, in] (or
  [E, in, out]) nn.Parameter instead of one nn.Linear per expert. They get peft's `ParamWrapper`
  (LoRA on an nn.Parameter: `LoraConfig.target_parameters`), which computes W + delta per expert.
  A list names parameters with the same suffix rule ("mlp.experts.gate_up_proj", or a router's
  "mlp.gate.weight"); "none" adapts no parameter.
- Routers: in these families the router is a custom module holding a 2-D weight, not a linear
  layer and not an expert stack, so neither default adapts it (it stays frozen); name it in
  target_parameters to adapt it. A router that is an nn.Linear (Qwen2-MoE's shared_expert_gate)
  is a linear layer and gets an adapter under all-linear, as with peft. A router that subclasses
  nn.Linear but returns a tuple (Llama 4's, (scores, logits)) is not: peft's LoRA layer adds its
  delta to the output tensor, so all-linear leaves it out (`_returns_tensor`, probed on one row).
- The scope: the whole model for a causal LM; for an image-text-to-text model its language model
  (`get_decoder()`), so the vision tower and projector never get adapters (train them with
  `vision_tower: trainable`).

Deviation from peft: peft's own "all-linear" on a few transformers 5 MoE types rewrites module
names through its v4 -> v5 compatibility map (`peft.utils.transformers_weight_conversion`), which
adds the router and doubles the rank of `gate_up_proj`, and moves a dense layer's real
`gate_proj` nn.Linear to the expert stack. grouprl hands peft the resolved names and checks after
injection that exactly those were adapted (`check_applied`), refusing by name otherwise.

`LoRATargets.summary()` is what the run logs once and writes as `lora_targets.json` (next to the
resolved config and in every checkpoint's model folder): module-name patterns (layer indices as
"*") with counts, and the parameter targets.
"""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TARGETS_FILE = "lora_targets.json"
ALL_LINEAR = "all-linear"
ATTENTION = "attention"
EXPERTS = "experts"
NO_PARAMETERS = "none"


@dataclass(frozen=True)
class LoRATargets:
    """Full names (in the un-wrapped model) of the modules and parameters that get adapters."""

    modules: tuple[str, ...]
    parameters: tuple[str, ...] = ()

    def summary(self) -> dict[str, Any]:
        """{"modules": {pattern: count}, "parameters": {pattern: count}, and the full names}."""
        return {
            "modules": _patterns(self.modules),
            "parameters": _patterns(self.parameters),
            "module_names": list(self.modules),
            "parameter_names": list(self.parameters),
        }

    def describe(self) -> str:
        """One line: every pattern with its count."""
        s = self.summary()
        mods = ", ".join(f"{p} x{n}" for p, n in s["modules"].items()) or "none"
        params = ", ".join(f"{p} x{n}" for p, n in s["parameters"].items()) or "none"
        return f"LoRA targets: modules {mods}; parameters {params}"


def _patterns(names: tuple[str, ...]) -> dict[str, int]:
    """Names with every numeric path segment (layer, expert index) as "*", with counts."""
    counts = Counter(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", n) for n in names)
    return dict(sorted(counts.items()))


def _matches(name: str, entry: str) -> bool:
    """peft's list rule: the entry is the whole dotted path or its tail after a dot."""
    return name == entry or name.endswith(f".{entry}")


def _scope_prefix(model: Any, scope: Any) -> str:
    if scope is None or scope is model:
        return ""
    names = [n for n, m in model.named_modules() if m is scope]
    if not names:
        raise ValueError(f"LoRA scope {type(scope).__name__} is not a sub-module of the model")
    return names[0] + "."


def linear_layers(model: Any, scope: Any = None) -> tuple[list[str], str | None]:
    """(names of the linear layers in `scope` outside the output head, name of the output head)
    by peft's all-linear resolution on the whole model."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

    config = _maybe_include_all_linear_layers(LoraConfig(target_modules=ALL_LINEAR), model)
    prefix = _scope_prefix(model, scope)
    head_module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = next((n for n, m in model.named_modules() if m is head_module), None)
    modules = dict(model.named_modules())
    names = sorted(
        n
        for n in config.target_modules
        if n.startswith(prefix) and n != head and _returns_tensor(modules.get(n))
    )
    return names, head


def _returns_tensor(module: Any) -> bool:
    """False for an nn.Linear subclass whose own forward returns something else than a tensor
    (peft's LoRA Linear adds its delta to the output): probed on one zero row."""
    import torch

    if not isinstance(module, torch.nn.Linear) or type(module).forward is torch.nn.Linear.forward:
        return True
    try:
        with torch.no_grad():
            out = module(module.weight.new_zeros(1, module.in_features))  # [1, in]
    except Exception:  # a forward that needs more than one row: peft's wrapping decides, as before
        return True
    return isinstance(out, torch.Tensor)


def expert_parameters(model: Any, scope: Any = None) -> list[str]:
    """Names of the 3-D parameters in `scope` held by a module that is not a torch.nn layer
    (a Conv1d's [out, in, k] weight is not an expert stack)."""
    prefix = _scope_prefix(model, scope)
    out = []
    for mod_name, module in model.named_modules():
        if not mod_name.startswith(prefix) or type(module).__module__.startswith("torch."):
            continue
        for p_name, p in module.named_parameters(recurse=False):
            if p.ndim == 3:
                out.append(f"{mod_name}.{p_name}")
    return sorted(out)


def _attention_classes() -> tuple[type, ...]:
    """diffusers' attention module classes (the mixin of 0.35+ attention classes, and the older
    generic Attention that SANA and the UNets still use); () without diffusers."""
    try:
        from diffusers.models.attention import AttentionModuleMixin
        from diffusers.models.attention_processor import Attention
    except ImportError:  # pragma: no cover - diffusers is a dependency
        return ()
    return (AttentionModuleMixin, Attention)


def attention_linears(model: Any, linears: list[str]) -> list[str]:
    """The names among `linears` that sit inside a diffusers attention module of `model`."""
    kinds = _attention_classes()
    owners = [n for n, m in model.named_modules() if kinds and isinstance(m, kinds)]
    return [n for n in linears if any(n.startswith(f"{o}.") for o in owners)]


def _convolutions(model: Any, scope: Any = None) -> list[str]:
    """Names of the torch convolution layers in `scope` (never part of all-linear)."""
    import torch

    prefix = _scope_prefix(model, scope)
    kinds = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    return [n for n, m in model.named_modules() if n.startswith(prefix) and isinstance(m, kinds)]


def _leaf(name: str) -> str:
    """The last path segment, or the last two when it is an index (`to_out.0`)."""
    parts = name.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


def _leaf_names(names: list[str]) -> str:
    leaves = sorted({_leaf(n) for n in names})
    return ", ".join(leaves) if leaves else "none"


def resolve_targets(
    model: Any, settings: Any, scope: Any = None, every_entry: bool = True
) -> LoRATargets:
    """The modules and parameters `settings` (target_modules, target_parameters, dropout) names
    in `model` (a transformers model, not yet peft-wrapped), limited to `scope` (a sub-module:
    a VLM's language model); one clear error when an entry matches nothing. every_entry=False
    (diffusers denoisers, whose lists are written for all variants of a family: SD3's last
    block has no to_add_out): one matching entry is enough, the others are named in a
    warning."""
    linears, head = linear_layers(model, scope)
    experts = expert_parameters(model, scope)
    wanted = settings.target_modules
    if isinstance(wanted, str):
        if wanted not in (ALL_LINEAR, ATTENTION):
            raise ValueError(
                f"lora.target_modules must be {ALL_LINEAR!r}, {ATTENTION!r} or a list of module "
                f"names, got {wanted!r}"
            )
        modules = linears if wanted == ALL_LINEAR else attention_linears(model, linears)
        if wanted == ATTENTION and not modules:
            raise ValueError(
                f"lora.target_modules {ATTENTION!r} selects the linear layers of diffusers "
                f"attention modules, and {type(model).__name__} has none; use {ALL_LINEAR!r} or "
                f"module names (its linear layers: {_leaf_names(linears)})"
            )
    else:
        # an explicit list may also name the output head, or a convolution (peft adapts
        # Conv1d / 2d / 3d too: a user velocity module's conv layers)
        pool = linears + _convolutions(model, scope) + ([head] if head else [])
        missing = [e for e in wanted if not any(_matches(n, e) for n in pool)]
        if missing and (every_entry or len(missing) == len(wanted)):
            stacked = (
                f"; its MoE expert weights ({_leaf_names(experts)}) are 3-D parameters, adapted "
                "through lora.target_parameters"
                if experts
                else ""
            )
            raise ValueError(
                f"lora.target_modules {missing} match no linear layer of "
                f"{type(model).__name__}; its linear layers are named: {_leaf_names(pool)} "
                f"(or use {ALL_LINEAR!r}){stacked}"
            )
        if missing:
            warnings.warn(
                f"lora.target_modules {missing} match no linear layer of {type(model).__name__} "
                "(the other entries do)",
                stacklevel=2,
            )
        modules = [n for n in pool if any(_matches(n, e) for e in wanted)]
    want_p = settings.target_parameters
    if isinstance(want_p, str):
        if want_p not in (EXPERTS, NO_PARAMETERS):
            raise ValueError(
                f"lora.target_parameters must be {EXPERTS!r}, {NO_PARAMETERS!r} or a list of "
                f"parameter names, got {want_p!r}"
            )
        parameters = experts if want_p == EXPERTS else []
    else:
        prefix = _scope_prefix(model, scope)
        inside = set(modules)
        pool = [
            n
            for n, p in model.named_parameters()
            if n.startswith(prefix) and p.ndim in (2, 3) and n.rsplit(".", 1)[0] not in inside
        ]
        missing = [e for e in want_p if not any(_matches(n, e) for n in pool)]
        if missing:
            raise ValueError(
                f"lora.target_parameters {missing} match no 2-D / 3-D parameter of "
                f"{type(model).__name__}; 3-D (expert) parameters: {_leaf_names(experts)}"
            )
        parameters = [n for n in pool if any(_matches(n, e) for e in want_p)]
    if parameters and settings.dropout:
        raise ValueError(
            f"lora.dropout={settings.dropout} cannot apply to parameter targets "
            f"({_leaf_names(parameters)} of {type(model).__name__}: peft's ParamWrapper has no "
            "input dropout); set lora.dropout: 0 or lora.target_parameters: none"
        )
    if not modules and not parameters:
        raise ValueError(
            f"LoRA resolves to no target in {type(model).__name__}: lora.target_modules "
            f"{wanted!r} and lora.target_parameters {want_p!r} select nothing"
        )
    return LoRATargets(tuple(modules), tuple(parameters))


def check_applied(peft_model: Any, targets: LoRATargets) -> None:
    """peft adapted exactly the resolved targets (its transformers-5 MoE name conversion may
    move names: refused by name rather than trained on another set)."""
    tuner = peft_model.base_model
    got_m = set(getattr(tuner, "targeted_module_names", []))
    got_p = set(getattr(tuner, "targeted_parameter_names", []))
    # a ParamWrapper's module is recorded as a targeted module too
    owners = {p.rsplit(".", 1)[0] for p in targets.parameters}
    lost_m = sorted(set(targets.modules) - got_m)
    extra_m = sorted(got_m - set(targets.modules) - owners)
    lost_p, extra_p = (
        sorted(set(targets.parameters) - got_p),
        sorted(got_p - set(targets.parameters)),
    )
    if lost_m or extra_m or lost_p or extra_p:
        raise ValueError(
            f"peft did not adapt the resolved LoRA targets of "
            f"{type(peft_model.get_base_model()).__name__} (its transformers-5 MoE name "
            f"conversion renames them): not adapted {(lost_m + lost_p)[:6]}, adapted instead "
            f"{(extra_m + extra_p)[:6]}; list lora.target_modules without these layers"
        )


def write_targets(targets: LoRATargets, directory: str | Path) -> Path:
    """directory/lora_targets.json (written through a temporary file)."""
    path = Path(directory) / TARGETS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(targets.summary(), indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
