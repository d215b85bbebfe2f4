"""The first-step engine / trainer log-prob gap guard: a silently wrong run is stopped at step one.

The engine samples each token and reports its log-prob; after the update the rollout holds the
trainer's log-prob of the same token under the same weights (rollout.old_logp: the recompute, or
a single-pass update's own forward). On the first step of a run, and on the first step after a
resume, with d = trainer - engine on the real sampled tokens (replayed rows left out: their
log-probs are an older policy's by design), the gap is mean |d|. Above the bound of
model.dtype the run stops (rollout.logp_gap_check 'error') or prints it and goes on ('warn'):

  dtype     measured mean (max) |d|, fast and hf engines      bound
  float32   1.3e-7 .. 2.1e-7 (9.5e-7)                         1e-3
  bfloat16  2.4e-5 .. 1.8e-4 (0.002)                          0.05
  float16   9.1e-6 .. 4.1e-5 (2.5e-4)                         0.05

(measured on the text replicas qwen2.5, qwen3, llama3, mistral, gpt2: 8 completions of 24
tokens each; vLLM's kernels were not measured here, the bounds leave them two to three orders of
magnitude over these means). A stale engine (weights off by noise of std 0.2, the test's case)
measures 1.08 nats on average (max 2.5); issue 28 reports engine/logp_abs_diff_max 0.6 .. 0.9 for a Gemma 2 whose
soft-capping the trainer skipped (the defect these guards were made for).

What a gap above those means in practice: a head post-processing one side skips (Gemma 2's
soft-capping: ~1 nat), an end-of-turn / chat-template mismatch between what the engine saw and
what the trainer scores, engine weights that are not the trainer's (a failed or skipped push),
or a dtype one side does not run in. The check cannot run, and says so once, when the engine's
log-probs are of a truncated distribution (rollout.top_k / top_p: the gap then holds the
kept mass) or when no trainer score of the sampling weights exists (rollout.old_logp 'engine'
over several updates).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from grouprl.rollouts.batching import single_pass
from grouprl.types import ROW_REPLAYED, Rollout

# mean |trainer - engine| log-prob gap accepted on the first step, by model.dtype
GAP_BOUNDS: dict[str, float] = {"float32": 1e-3, "bfloat16": 0.05, "float16": 0.05}
LIKELY_CAUSES = (
    "the model's head post-processing skipped on one side (logit soft-capping / scaling), an "
    "end-of-turn or chat-template mismatch between the engine's input and the scored tokens, "
    "stale engine weights (a weight push that failed or did not run), a dtype mismatch, or "
    "dropout left on in training (train.disable_dropout: false samples and scores with "
    "different masks: a known gap, set rollout.logp_gap_check: warn to keep it)"
)


class LogpGapError(RuntimeError):
    """The first step's engine / trainer log-prob gap is over the dtype's bound."""


def first_step_gap(cfg: Any, rollout: Rollout | None, say: Callable[[str], None]) -> bool:
    """Check the first step's gap; returns True while the check is still due (no rollout yet).
    say: prints a line (the run logger). Raises LogpGapError above the bound in 'error' mode."""
    if rollout is None:
        return True  # a skipped step (dynamic sampling found nothing): the next one is checked
    if rollout.engine_logp is None:
        return False  # no engine log-probs (image workloads): nothing to compare
    r = cfg.rollout
    if r.top_k > 0 or r.top_p < 1.0:
        say(
            f"first-step log-prob gap check not run: rollout.top_k={r.top_k} / top_p={r.top_p} "
            "make the engine report log-probs of the truncated distribution"
        )
        return False
    if r.old_logp == "engine" and not single_pass(cfg):
        say(
            "first-step log-prob gap check not run: rollout.old_logp 'engine' over several "
            "updates never scores the sampling weights with the trainer"
        )
        return False
    mask = rollout.mask.bool()  # [N, T]
    if rollout.row_source is not None:
        mask = mask & (rollout.row_source != ROW_REPLAYED)[:, None]  # [N, T] sampled rows only
    if not mask.any():
        return True
    d = (rollout.old_logp.float() - rollout.engine_logp.float()).abs()[mask]  # [M]
    gap, worst = float(d.mean()), float(d.max())
    dtype = getattr(cfg.model, "dtype", "float32")
    bound = GAP_BOUNDS.get(dtype, GAP_BOUNDS["float32"])
    if not gap > bound and torch.isfinite(d).all():
        say(
            f"first-step log-prob gap: mean |trainer - engine| {gap:.2g} (max {worst:.2g}) <= "
            f"{bound:g} for {dtype}"
        )
        return False
    msg = (
        f"the engine's and the trainer's log-probs of the first step's tokens differ by "
        f"{gap:.3g} nats on average (max {worst:.3g}; bound {bound:g} for model.dtype {dtype}, "
        f"rollout.engine {r.engine!r}). Likely causes: {LIKELY_CAUSES}. "
        "rollout.logp_gap_check 'warn' goes on anyway"
    )
    if r.logp_gap_check == "error":
        raise LogpGapError(msg)
    warnings.warn(msg, stacklevel=2)
    say(f"warning: {msg}")
    return False
