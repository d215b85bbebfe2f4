"""A fused LM head for per-token log-probs: logits exist one token chunk at a time, forward and back.

For the selected tokens only (the real completion tokens, padding removed: "packing"), with
z = (h W^T + b) / temperature:
    logp = z[y] - logsumexp(z),   entropy = logsumexp(z) - sum_v softmax(z)_v z_v.
The forward keeps only hidden [M, H], the ids and logsumexp [M]; the backward recomputes each
chunk's logits and writes the gradient in closed form,
    d logp / dz = onehot(y) - p,        d entropy / dz = p * (logsumexp(z) - entropy - z),
so one chunk's [c, V] logits and probabilities are the only vocabulary-sized tensors alive. It is
the same math as log_softmax + gather under autograd (tests compare values and gradients), with
about a third of the elementwise passes over [c, V] and no second copy kept for the backward.
Deviation from a plain autograd graph: the entropy carries a gradient only with entropy_grad=True
(as in logprobs.py: metrics and token selection do not need one).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# Rows per chunk such that one chunk's float32 logits hold about this many elements (32 MiB).
CHUNK_ELEMENTS = 1 << 23


def chunk_rows(vocab_size: int, chunk_size: int | None = None) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 token, got {chunk_size}")
        return chunk_size
    return max(1, CHUNK_ELEMENTS // max(vocab_size, 1))


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    z = torch.nn.functional.linear(h, weight, bias).float()  # [c, V]
    return z / temperature if temperature != 1.0 else z  # [c, V]


class _FusedHeadLogprob(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,  # [M, H]
        weight: Tensor,  # [V, H]
        bias: Tensor | None,  # [V]
        ids: Tensor,  # [M]
        temperature: float,
        rows: int,
        with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[Tensor, Tensor]:
        M = hidden.shape[0]
        logp = hidden.new_empty(M, dtype=torch.float32)  # [M]
        lse = hidden.new_empty(M, dtype=torch.float32)  # [M]
        ent = hidden.new_zeros(M, dtype=torch.float32)  # [M]
        for s in range(0, M, rows):
            z = _logits(hidden[s : s + rows], weight, bias, temperature)  # [c, V]
            lse[s : s + rows] = torch.logsumexp(z, dim=-1)  # [c]
            logp[s : s + rows] = z.gather(-1, ids[s : s + rows, None])[:, 0] - lse[s : s + rows]
            if with_entropy:  # H = -sum p log p, log p = z - lse (z is not needed after)
                logq = z.sub_(lse[s : s + rows, None])  # [c, V] log-softmax, in place
                ent[s : s + rows] = -(logq.exp() * logq).sum(-1)  # [c]
        ctx.save_for_backward(hidden, weight, bias, ids, lse, ent)
        ctx.temperature, ctx.rows, ctx.entropy_grad = temperature, rows, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor, g_ent: Tensor | None) -> tuple:  # type: ignore[override]
        hidden, weight, bias, ids, lse, ent = ctx.saved_tensors
        temperature, rows = ctx.temperature, ctx.rows
        use_ent = ctx.entropy_grad and g_ent is not None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        dh = torch.empty_like(hidden) if need_h else None  # [M, H]
        dw = torch.zeros_like(weight, dtype=torch.float32) if need_w else None  # [V, H]
        db = torch.zeros_like(bias, dtype=torch.float32) if need_b else None  # [V]
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s : s + rows]  # [c, H]
            z = _logits(h, weight, bias, temperature)  # [c, V]
            g = g_logp[s : s + rows, None].float()  # [c, 1]
            p = (z - lse[s : s + rows, None]).exp_()  # [c, V]
            if use_ent:  # g_ent * p * (lse - H - z) - g_logp * p
                ge = g_ent[s : s + rows, None].float()  # [c, 1]
                coef = (lse[s : s + rows] - ent[s : s + rows])[:, None] - z  # [c, V]
                grad = p * (ge * coef - g)  # [c, V]
            else:
                grad = p.mul_(-g)  # [c, V]: - g_logp * p
            grad.scatter_add_(1, ids[s : s + rows, None], g)  # + g_logp * onehot(y)
            if temperature != 1.0:
                grad.div_(temperature)  # dz/dlogits = 1 / temperature
            grad = grad.to(hidden.dtype)  # [c, V]
            if dh is not None:
                dh[s : s + rows] = grad @ weight  # [c, H]
            if dw is not None:
                dw.addmm_(grad.t().float(), h.float())  # [V, H]
            if db is not None:
                db.add_(grad.float().sum(0))  # [V]
        dw = dw.to(weight.dtype) if dw is not None else None
        db = db.to(bias.dtype) if db is not None else None
        return dh, dw, db, None, None, None, None, None


def fused_head_logprobs(
    hidden: Tensor,
    head: torch.nn.Linear,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """hidden [M, H] (one row per scored token), head: a plain nn.Linear H -> V, ids [M].

    Returns logp [M] (differentiable w.r.t. hidden and the head's weight / bias) and entropy [M]
    (differentiable only with entropy_grad) or None. chunk_size = tokens per chunk (None: sized
    so one chunk's logits hold ~CHUNK_ELEMENTS floats).
    """
    if type(head) is not torch.nn.Linear:
        raise TypeError(f"fused_head_logprobs needs a plain nn.Linear head, got {type(head)}")
    if hidden.dim() != 2 or ids.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [M, H] and ids {tuple(ids.shape)} [M]"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rows = chunk_rows(head.out_features, chunk_size)
    grad = torch.is_grad_enabled()
    logp, ent = _FusedHeadLogprob.apply(
        hidden, head.weight, head.bias, ids, float(temperature), rows, with_entropy,
        entropy_grad and grad,
    )  # fmt: skip  # [M] each
    return logp, (ent if with_entropy else None)
