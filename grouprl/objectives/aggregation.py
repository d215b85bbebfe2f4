"""Loss aggregation: how a per-token loss matrix [n, T] becomes one scalar.

Modes (names as in the `algorithm.aggregation` config field):
- token_mean               sum(m*l) / num_tokens                          (DAPO arXiv 2503.14476)
- seq_mean_token_mean      sum_i [sum_t m*l / |o_i|] / num_seqs           (GRPO arXiv 2402.03300)
- seq_mean_token_sum       sum_i sum_t m*l / num_seqs
- seq_mean_token_sum_norm  sum(m*l) / (num_seqs * max_len)                (Dr. GRPO arXiv 2503.20783)
- delta_l                  sum_i w_i sum_t m*l / (num_seqs * max_len)     (Delta-L arXiv 2509.07558)

Sequence weights. `seq_weights` Float[n] (detached) multiply each row's loss before any mode reduces
it; delta_l requires them (w = delta_l_weights over the WHOLE step batch, each micro-batch gets its
slice, so the split stays exact). For the PPO-clip surrogates, weighting the loss by w_i >= 0 equals
the official Delta-L code's scaling of the advantage by w_i (the clip only looks at sign(A)).

Delta-L (METHODS section 5; official code zerolllin/Delta-L-Normalization). w_i = L_i^-alpha /
mean_k L_k^-alpha over the step batch (alpha 0.75 math, 1.0 countdown); rows of length 0 get w = 0
and are left out of the mean. Deviation, as for Dr. GRPO below: the official loss divides by the
micro-batch size and its padded width; we divide by the global num_seqs and the configured max_len.

Gradient accumulation. `num_tokens` and `num_seqs` are the GLOBAL counts of the whole optimizer step
(every micro-batch, every process). Each micro-batch then contributes exactly its share, and the sum
of the micro-batch losses equals the loss of one big batch, whatever the split. When they are None the
local counts are used (tokens = mask.sum(); seqs = rows with at least one valid token), which is only
right for a single micro-batch. Under data parallelism, gradients are *averaged* over P processes, so
the caller multiplies the loss by P (as verl does with dp_size) to keep the global normalisation.

Dr. GRPO normaliser (deviation note). The paper replaces the per-sequence length by a constant, so long
and short answers get the same per-token weight. We follow TRL's `dr_grpo` and divide by
num_seqs * max_len, where max_len is the *configured* maximum completion length (a constant across
steps). verl's `seq-mean-token-sum-norm` divides by a loss_scale_factor that defaults to the padded
response length only, which makes the loss scale grow with the batch size; dividing by the number of
sequences as well keeps the loss magnitude independent of the batch size, like the other modes.

Rows with no valid token contribute 0, never NaN; an all-masked batch gives a 0 that still carries the
autograd graph of `loss_mat`, so backward() runs (and yields zero gradients) on every process.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grouprl.objectives.registry import Registry

AGGREGATIONS = Registry("aggregation mode")
# The counts aggregate() takes, a subset of the step's counts (count_tokens also gives num_groups).
AGG_COUNTS = ("num_tokens", "num_seqs", "max_len")


def _masked(loss_mat: Tensor, mask: Tensor) -> Tensor:
    """Zero the invalid slots with `where` (not a multiply) so NaN/inf in padding cannot leak."""
    return loss_mat.masked_fill(~mask, 0.0)  # [n, T]


def masked_mean(x: Tensor, mask: Tensor, count: float | int | Tensor | None = None) -> Tensor:
    """Sum of x over the True slots of mask (same shape as x), divided by `count` when given, else
    by the number of True slots (at least 1, so an empty mask gives 0, never NaN) -> 0-dim tensor.

    `count` is a global count (the pairs or tokens of the whole optimizer step): each micro-batch
    then returns its share of the step's mean, and the shares sum to it. It is used as given (not
    clamped). Padding may hold NaN / inf: it is zeroed with `masked_fill` before the sum. Metrics
    take float() of the result; a loss term keeps the tensor (and its graph)."""
    total = x.masked_fill(~mask, 0.0).sum()  # scalar
    denom = mask.sum().clamp(min=1) if count is None else torch.as_tensor(count)  # scalar
    return total / denom


def safe_count(count: float | int | Tensor) -> float | Tensor:
    """A count clamped to >= 1: a count of 0 only happens when every mask is empty, and the
    numerator is then 0 too, so the result is 0 instead of NaN."""
    if isinstance(count, Tensor):
        return count.clamp(min=1)
    return max(count, 1)


@AGGREGATIONS.register("token_mean")
def token_mean(loss_mat: Tensor, mask: Tensor, num_tokens, num_seqs, max_len) -> Tensor:
    return _masked(loss_mat, mask).sum() / safe_count(num_tokens)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, num_tokens, num_seqs, max_len) -> Tensor:
    lengths = mask.sum(-1).clamp(min=1)  # [n]; empty rows have a zero numerator anyway
    per_seq = _masked(loss_mat, mask).sum(-1) / lengths  # [n]
    return per_seq.sum() / safe_count(num_seqs)


@AGGREGATIONS.register("seq_mean_token_sum")
def seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, num_tokens, num_seqs, max_len) -> Tensor:
    return _masked(loss_mat, mask).sum() / safe_count(num_seqs)


def _check_max_len(mode: str, paper: str, max_len) -> None:
    if max_len is None or max_len <= 0:
        raise ValueError(
            f"aggregation {mode!r} ({paper}) needs max_len = the configured maximum completion length (a "
            f"positive constant), got {max_len!r}"
        )


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    loss_mat: Tensor, mask: Tensor, num_tokens, num_seqs, max_len
) -> Tensor:
    _check_max_len("seq_mean_token_sum_norm", "Dr. GRPO", max_len)
    return _masked(loss_mat, mask).sum() / (safe_count(num_seqs) * max_len)


@AGGREGATIONS.register("delta_l")
def delta_l(loss_mat: Tensor, mask: Tensor, num_tokens, num_seqs, max_len) -> Tensor:
    # the weights w_i were applied to the rows by aggregate(); the normaliser is Dr. GRPO's
    _check_max_len("delta_l", "Delta-L", max_len)
    return _masked(loss_mat, mask).sum() / (safe_count(num_seqs) * max_len)


_NEEDS_SEQ_WEIGHTS = ("delta_l",)


def delta_l_weights(lengths: Tensor, alpha: float) -> Tensor:
    """Delta-L weights w_i = L_i^-alpha / mean_k L_k^-alpha over rows with L_k > 0, 0 for L_i = 0.
    lengths Float[N] (the whole step batch) -> Float[N], detached."""
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be Float[N], got shape {tuple(lengths.shape)}")
    if not alpha >= 0:
        raise ValueError(f"delta_l_alpha must be >= 0, got {alpha!r}")
    lengths = lengths.detach().to(torch.promote_types(lengths.dtype, torch.float32))  # [N]
    if (lengths < 0).any():
        raise ValueError("lengths must be >= 0")
    pos = lengths > 0  # [N]
    raw = torch.where(pos, lengths.clamp(min=1e-30) ** -alpha, torch.zeros_like(lengths))  # [N]
    mean = raw.sum() / pos.sum().clamp(min=1)  # scalar
    return torch.where(pos, raw / mean.clamp(min=1e-30), torch.zeros_like(raw))  # [N]


def local_counts(mask: Tensor) -> tuple[int, int]:
    """(valid tokens, non-empty rows) of one mask [n, T]."""
    return int(mask.sum()), int(mask.any(-1).sum())


def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: int | float | Tensor | None = None,
    num_seqs: int | float | Tensor | None = None,
    max_len: int | None = None,
    seq_weights: Tensor | None = None,
) -> Tensor:
    """Reduce loss_mat [n, T] over the valid slots of mask [n, T] (bool) to a scalar, see module doc.
    seq_weights: optional Float[n] per-row weights (required by delta_l)."""
    fn = AGGREGATIONS[mode]
    if loss_mat.dim() != 2 or loss_mat.shape != mask.shape:
        raise ValueError(
            f"aggregate expects loss_mat and mask of the same shape [n, T], got "
            f"{tuple(loss_mat.shape)} and {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
    if seq_weights is None and mode in _NEEDS_SEQ_WEIGHTS:
        raise ValueError(
            f"aggregation {mode!r} needs seq_weights (Float[n], e.g. delta_l_weights of the whole "
            "step batch's lengths, sliced to this micro-batch), got None"
        )
    if seq_weights is not None:
        if seq_weights.shape != loss_mat.shape[:1]:
            raise ValueError(
                f"seq_weights must be [n] = {tuple(loss_mat.shape[:1])}, got "
                f"{tuple(seq_weights.shape)}"
            )
        w = seq_weights.detach().masked_fill(~mask.any(-1), 0.0)  # [n] empty rows stay 0
        loss_mat = _masked(loss_mat, mask) * w[:, None]  # [n, T]
    if num_tokens is None or num_seqs is None:
        tokens, seqs = local_counts(mask)
        num_tokens = tokens if num_tokens is None else num_tokens
        num_seqs = seqs if num_seqs is None else num_seqs
    return fn(loss_mat, mask, num_tokens, num_seqs, max_len)
