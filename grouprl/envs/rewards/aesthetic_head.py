"""LAION's aesthetic MLP head (christophschuhmann/improved-aesthetic-predictor), loadable from its
released weight files.

The head maps an L2-normalised CLIP ViT-L/14 image embedding (768-d) to a score (about 1..10). Two
layouts were released; the file's keys say which one it is:
  - "linear" (sac+logos+ava1-l14-linearMSE.pth, used by DDPO and flow_grpo): Linear(d, 1024),
    Dropout, Linear(1024, 128), Dropout, Linear(128, 64), Dropout, Linear(64, 16), Linear(16, 1)
    (no activation: an affine map at inference); keys layers.{0,2,4,6,7}.
  - "relu" (ava+logos-l14-reluMSE.pth): the same widths with a ReLU after each of the first four
    Linear layers; keys layers.{0,3,6,9,11}.
The input width d is read from the file (layers.0.weight), so smaller heads load as well. Dropout is
inactive (eval mode).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

WIDTHS = (1024, 128, 64, 16)
DROPOUT = (0.2, 0.2, 0.1)


def _linear_layout(d: int) -> nn.Sequential:
    w = (d, *WIDTHS)
    return nn.Sequential(
        nn.Linear(w[0], w[1]), nn.Dropout(DROPOUT[0]),
        nn.Linear(w[1], w[2]), nn.Dropout(DROPOUT[1]),
        nn.Linear(w[2], w[3]), nn.Dropout(DROPOUT[2]),
        nn.Linear(w[3], w[4]), nn.Linear(w[4], 1),
    )  # fmt: skip


def _relu_layout(d: int) -> nn.Sequential:
    w = (d, *WIDTHS)
    return nn.Sequential(
        nn.Linear(w[0], w[1]), nn.ReLU(), nn.Dropout(DROPOUT[0]),
        nn.Linear(w[1], w[2]), nn.ReLU(), nn.Dropout(DROPOUT[1]),
        nn.Linear(w[2], w[3]), nn.ReLU(), nn.Dropout(DROPOUT[2]),
        nn.Linear(w[3], w[4]), nn.ReLU(), nn.Linear(w[4], 1),
    )  # fmt: skip


LAYOUTS: dict[str, Callable[[int], nn.Sequential]] = {
    "linear": _linear_layout,
    "relu": _relu_layout,
}


class AestheticHead(nn.Module):
    """Embedding Float[M, d] -> score Float[M]. Call it on unit-norm CLIP image embeddings."""

    def __init__(self, input_size: int = 768, layout: str = "linear") -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"unknown aesthetic head layout {layout!r}; allowed: {list(LAYOUTS)}")
        self.input_size = input_size
        self.layout = layout
        self.layers = LAYOUTS[layout](input_size)

    def forward(self, embeddings: Tensor) -> Tensor:
        return self.layers(embeddings.float()).squeeze(-1)  # [M, d] -> [M]


def _layout_keys(layout: str) -> set[str]:
    return set(AestheticHead(1, layout).state_dict())


def _read(path: Path) -> dict[str, Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # a Lightning checkpoint
    if not isinstance(state, dict):
        raise ValueError(
            f"aesthetic head {str(path)!r} holds {type(state).__name__}, not a state dict"
        )
    return state


@functools.cache
def _load(path: str) -> AestheticHead:
    state = _read(Path(path))
    keys = set(state)
    layout = next((name for name in LAYOUTS if _layout_keys(name) == keys), None)
    if layout is None:
        expected = {name: sorted(_layout_keys(name)) for name in LAYOUTS}
        raise ValueError(
            f"aesthetic head {path!r}: keys {sorted(keys)} match no known layout; expected one of "
            f"{expected}"
        )
    head = AestheticHead(int(state["layers.0.weight"].shape[1]), layout)
    head.load_state_dict({k: v.float() for k, v in state.items()})
    return head.eval().requires_grad_(False)


def load_aesthetic_head(path: str | Path) -> AestheticHead:
    """LAION's head from a local .pth / .pt / .safetensors file (layout from its keys), loaded once
    per process per file; eval mode, no grad."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"aesthetic head file {str(p)!r} does not exist")
    if p.suffix not in (".pth", ".pt", ".safetensors", ".bin", ".ckpt"):
        raise ValueError(
            f"aesthetic head {str(p)!r}: expected a .pth, .pt, .bin, .ckpt or .safetensors file"
        )
    return _load(str(p.resolve()))
