"""Loss aggregation: how a per-token loss matrix [n, T] becomes one scalar.

Modes (names as in the `algorithm.aggregation` config field):
- token_mean               sum(m*l) / num_tokens                          (DAPO arXiv 2503.14476)
- seq_mean_token_mean      sum_i [sum_t m*l / |o_i|] / num_seqs           (GRPO arXiv 2402.03300)
- seq_mean_token_sum       sum_i sum_t m*l / num_seqs
- seq_mean_token_sum_norm  sum(m*l) / (num_seqs * max_len)                (Dr. GRPO arXiv 2503.20783)

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


def _masked(loss_mat: Tensor, mask: Tensor) -> Tensor:
    """Zero the invalid slots with `where` (not a multiply) so NaN/inf in padding cannot leak."""
    return loss_mat.masked_fill(~mask, 0.0)  # [n, T]


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


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    loss_mat: Tensor, mask: Tensor, num_tokens, num_seqs, max_len
) -> Tensor:
    if max_len is None or max_len <= 0:
        raise ValueError(
            "aggregation 'seq_mean_token_sum_norm' (Dr. GRPO) needs max_len = the configured maximum "
            f"completion length (a positive constant), got {max_len!r}"
        )
    return _masked(loss_mat, mask).sum() / (safe_count(num_seqs) * max_len)


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
) -> Tensor:
    """Reduce loss_mat [n, T] over the valid slots of mask [n, T] (bool) to a scalar, see module doc."""
    fn = AGGREGATIONS[mode]
    if loss_mat.dim() != 2 or loss_mat.shape != mask.shape:
        raise ValueError(
            f"aggregate expects loss_mat and mask of the same shape [n, T], got "
            f"{tuple(loss_mat.shape)} and {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
    if num_tokens is None or num_seqs is None:
        tokens, seqs = local_counts(mask)
        num_tokens = tokens if num_tokens is None else num_tokens
        num_seqs = seqs if num_seqs is None else num_seqs
    return fn(loss_mat, mask, num_tokens, num_seqs, max_len)
