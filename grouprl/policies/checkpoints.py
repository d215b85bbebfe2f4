"""What the token policies (text causal LM, vision-language model) share about their weights:
the trained state (full weights, or only the trainable ones under LoRA), loading it back with the
keys checked first, and loading a saved folder's safetensors into the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from grouprl.policies.text.engines.base import unwrap_peft


def trained_state(model: Any, lora: Any) -> dict[str, Tensor]:
    """Full weights, or under LoRA only the parameters that train (adapters, and whatever else
    was left trainable)."""
    if lora is None:
        return model.state_dict()
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in names}


def load_trained_state(model: Any, lora: Any, state: dict[str, Tensor]) -> None:
    """Inverse of trained_state(); checks the keys before touching any weight."""
    expected = set(trained_state(model, lora))
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise KeyError(
            f"state dict does not match this policy: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, strict=lora is None)


def load_folder_weights(model: Any, directory: str | Path) -> None:
    """Full weights written by save_pretrained into the (possibly peft-wrapped) model. The
    lm_head may be absent (tied to the embeddings); any other missing or unexpected key is an
    error."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(directory)!r}")
    weights: dict[str, Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    missing, unexpected = unwrap_peft(model).load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(
            f"weights in {str(directory)!r} do not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
