"""Keeping the rollout engine in step with the trainer: weight pushes and mismatch metrics.

`push_weights(policy)` hands the engine the trainer's current weights (a no-op for the in-process
hf and fast engines, which sample with the trainer's own model); `release_engine(policy)` lets a
vLLM engine sleep (GPU, rollout.vllm.sleep) while the trainer updates. `step_mismatch` measures,
once per step over the whole batch, how far the engine's log-probs are from the trainer's for the
same tokens.

The engine samples with its own numerics (vLLM kernels, KV cache, maybe another dtype) while the
loss scores with the trainer, so the same tokens get slightly different log-probs (the
"training-inference mismatch" of Yao et al. 2025, which objectives/correction.py corrects).
With d = trainer_logp - engine_logp on the real tokens of each sample i (clamped to [-20, 20] like
the correction weights):

  engine/logp_abs_diff_mean   mean |d| over tokens
  engine/logp_abs_diff_max    max |d|
  engine/seq_kl_k1            mean over samples of sum_t -d       (k1 estimate of the sequence KL)
  engine/seq_kl_k3            mean over samples of sum_t e^d - 1 - d  (k3, >= 0)

Both KL estimates are of KL(pi_engine || pi_trainer) for a whole completion, from the engine's own
samples; by the chain rule the per-token terms add up over the sequence. With top-k / top-p the
engine reports log-probs of the truncated distribution and the trainer does not truncate, so the
mismatch then also holds log(kept mass), not only numerical noise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grouprl.types import Rollout

CLAMP = 20.0


def push_weights(policy: Any, processes: Any = None) -> None:
    """Give the policy's text engine the weights just trained (policies without one: nothing).
    processes: the trainer's Dist under several processes; a remote engine (vllm_server) pushes
    from the main process only and the others learn the new version (engines/server/client.py)."""
    engine = getattr(policy, "engine", None)
    if engine is None:
        return
    if getattr(engine, "remote", False):
        engine.push(policy, processes)
    else:
        engine.load_weights(policy.model)


def release_engine(policy: Any) -> None:
    """A step's rollouts are done: let an engine that can sleep free its memory for training."""
    sleep = getattr(getattr(policy, "engine", None), "sleep", None)
    if sleep is not None:
        sleep()


def step_mismatch(cfg: Any, rollout: Rollout) -> dict[str, float]:
    """engine_mismatch over the batch, after update(): rollout.old_logp then holds the trainer's
    scores under the sampling weights (recompute mode, and every single-pass step, where update()
    writes them). Empty without engine log-probs, or with old_logp 'engine' over several updates
    (no trainer score of the sampling weights is made then)."""
    a = cfg.algorithm
    single_pass = a.epochs == 1 and a.minibatches == 1
    if rollout.engine_logp is None or (cfg.rollout.old_logp == "engine" and not single_pass):
        return {}
    return engine_mismatch(rollout.old_logp, rollout.engine_logp, rollout.mask)


@torch.no_grad()
def engine_mismatch(trainer_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """The four metrics above; trainer_logp, engine_logp [N, T] float, mask [N, T] bool.
    Empty when no token is real."""
    if not trainer_logp.shape == engine_logp.shape == mask.shape:
        raise ValueError(
            f"engine_mismatch: trainer_logp {tuple(trainer_logp.shape)}, engine_logp "
            f"{tuple(engine_logp.shape)} and mask {tuple(mask.shape)} must all be [N, T]"
        )
    mask = mask.bool()  # [N, T]
    if not mask.any():
        return {}
    d = (trainer_logp.float() - engine_logp.float()).clamp(-CLAMP, CLAMP)  # [N, T]
    d = torch.where(mask, d, torch.zeros_like(d))  # [N, T] padding -> 0
    rows = mask.any(-1)  # [N] samples with at least one real token
    k3 = torch.where(mask, d.exp() - 1.0 - d, torch.zeros_like(d))  # [N, T]
    return {
        "engine/logp_abs_diff_mean": float(d.abs().sum() / mask.sum()),
        "engine/logp_abs_diff_max": float(d.abs().max()),
        "engine/seq_kl_k1": float((-d).sum(-1)[rows].mean()),
        "engine/seq_kl_k3": float(k3.sum(-1)[rows].mean()),
    }
