"""Reading a released scorer checkpoint (a torch.save file or .safetensors) without pickle's
arbitrary code: the one place grouprl calls torch.load, with weights_only=True (torch's restricted
unpickler: tensors and plain containers only; a file asking for anything else is refused). Used
only by the explicit `grouprl convert` commands, never by a reward or a training run."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


def read_checkpoint(path: str | Path) -> dict[str, Tensor]:
    """The state dict of a checkpoint file ({"state_dict": ...} or {"model": ...} wrappers and
    "module." prefixes of DDP saves removed); an error for anything but a dict of tensors."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: Any = load_file(path)
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # the restricted unpickler refuses anything but tensors
            raise ValueError(
                f"{str(path)!r} is not a plain tensor checkpoint (torch.load weights_only "
                f"refused it: {str(e).splitlines()[0][:200]})"
            ) from None
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{str(path)!r} holds no state dict of tensors")
    return {re.sub(r"^module\.", "", k): v for k, v in state.items()}
