"""Replicas: tiny random-weight copies of the model families the shipped configs and the README
name, built in code and saved in the folder layout of the hub download (for tests and smoke runs).

    from grouprl.replicas import REPLICAS, build_replica
    build_replica("sd3.5-medium", "/tmp/sd35")      # then model.name_or_path=/tmp/sd35
    python -m grouprl.replicas --list
    python -m grouprl.replicas sd3.5-medium /tmp/sd35
    python -m grouprl.replicas sweep    # every registered architecture -> the support matrix

`REPLICAS` maps a name to its builder `fn(folder) -> folder`; each family's module docstring names
the real model it copies and the settings copied (diffusion.py: image / video pipelines and the
CLIP reward models; text.py: Qwen2.5, Qwen3, Qwen3-MoE, Llama 3.2, Mistral v0.3, Mixtral, GPT-2,
Gemma 2 and Phi-3 with their chat templates, chat_templates.py; vision.py: the image-text-to-text
families). The sweep (sweep/) builds tiny models of every architecture transformers registers from
their config classes, not from this registry, and checks this registry's diffusion pipelines.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from grouprl.replicas.diffusion import DIFFUSION_REPLICAS
from grouprl.replicas.text import TEXT_REPLICAS
from grouprl.replicas.vision import VISION_REPLICAS

REPLICAS: dict[str, Callable[[str | Path], Path]] = {
    **DIFFUSION_REPLICAS,
    **TEXT_REPLICAS,
    **VISION_REPLICAS,
}


def build_replica(name: str, folder: str | Path) -> Path:
    """Build the replica `name` into `folder` (created; files of the same names are overwritten)."""
    if name not in REPLICAS:
        raise ValueError(f"unknown replica {name!r}; allowed: {sorted(REPLICAS)}")
    return Path(REPLICAS[name](Path(folder)))
