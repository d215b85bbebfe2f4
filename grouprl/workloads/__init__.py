"""Workloads: the seam between the training loop and a modality (base.py).

Importing this package registers the built-in workloads (text, agent, gateway, images, vlm); a workload of
one's own registers with `grouprl.workloads.base.register` from any module.
"""

from typing import Any

import torch

from grouprl.workloads import agent, gateway, images, text, vision  # noqa: F401  (they register themselves)
from grouprl.workloads.base import (
    WORKLOADS,
    Capabilities,
    Collected,
    Parts,
    Workload,
    refuse_unsupported,
    register,
)


def workload_of(cfg: Any) -> type:
    """The registered class of the config's workload (`workload.type`; older configs without a
    `workload:` section had it inferred at validation, grouprl/config/migration.py)."""
    name = cfg.workload.type
    if name not in WORKLOADS:
        raise ValueError(f"workload.type {name!r} is not registered; known: {sorted(WORKLOADS)}")
    return WORKLOADS[name]


def build_policy(cfg: Any, device: torch.device) -> Any:
    """The policy of the config's workload (`model:` section)."""
    return workload_of(cfg).build_policy(cfg, device)


def build_workload(
    cfg: Any,
    *,
    policy: Any,
    reward_fns: dict | None = None,
    weights: dict[str, float] | None = None,
    dist: Any = None,
) -> Any:
    """The config's workload over built parts (one process unless `dist` says otherwise)."""
    from grouprl.runtime.distributed import SINGLE

    parts = Parts(cfg, policy, reward_fns or {}, weights or {}, SINGLE if dist is None else dist)
    return workload_of(cfg)(parts)


def build_rewards(cfg: Any, task: Any) -> tuple[dict, dict[str, float]]:
    """The reward functions and weights of the config's workload."""
    return workload_of(cfg).build_rewards(cfg, task)


__all__ = [
    "WORKLOADS",
    "Capabilities",
    "Collected",
    "Parts",
    "Workload",
    "build_policy",
    "build_rewards",
    "build_workload",
    "refuse_unsupported",
    "register",
    "workload_of",
]
