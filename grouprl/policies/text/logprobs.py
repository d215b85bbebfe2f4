"""Memory-safe per-token log-probs and entropies of a causal LM's completion tokens.

The naive way materialises float32 logits [N, T, V] for the whole batch (V ~ 150k for Qwen), and
autograd keeps a second [N, T, V] for the log-softmax backward: the main OOM source reported
against RL trainers. Here the LM head is applied to a few rows of hidden states at a time, the
log-softmax / gather / entropy are done per chunk in float32, and each chunk runs under activation
checkpointing when gradients are on, so the backward pass keeps only the hidden states
[N, T, H] and recomputes one chunk's logits at a time. Peak extra memory is ~ chunk * T * V floats.

Entropy H = logsumexp(z) - sum_v softmax(z)_v z_v of the temperature-scaled logits z; by default
it is computed without gradient (metrics, high-entropy token selection); `entropy_grad=True` keeps
its gradient for an entropy bonus.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from grouprl.policies.text.head import decoder_of, output_head
from grouprl.policies.text.positions import aligned_hidden, decoder_positions, left_aligned
from grouprl.types import TokenBatch

# Default chunk budget: rows per chunk such that one chunk's logits hold ~2^26 floats (256 MiB fp32).
DEFAULT_CHUNK_ELEMENTS = 1 << 26


def token_logp_entropy(
    logits: Tensor, ids: Tensor, *, with_entropy: bool = True, entropy_grad: bool = False
) -> tuple[Tensor, Tensor | None]:
    """logits [..., V] (already divided by temperature), ids [...] -> logp [...], entropy [...] | None.

    Computed in float32 whatever the logits dtype.
    """
    logits = logits.float()  # [..., V]
    lse = torch.logsumexp(logits, dim=-1)  # [...]
    logp = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse  # [...]
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs = torch.softmax(logits, dim=-1)  # [..., V]
        entropy = lse - (probs * logits).sum(-1)  # [...]
    return logp, entropy


def _rows(n_rows: int, per_row: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 row, got {chunk_size}")
        return chunk_size
    return max(1, min(n_rows, DEFAULT_CHUNK_ELEMENTS // max(per_row, 1)))


def chunked_head_logprobs(
    hidden: Tensor,
    head: Callable[[Tensor], Tensor],
    ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """hidden [N, T, H] (the states that predict ids), head: H -> V logits, ids [N, T].

    Returns logp [N, T] (differentiable w.r.t. hidden and head) and entropy [N, T] or None.
    chunk_size = rows per chunk (None: sized from `vocab_size` to ~DEFAULT_CHUNK_ELEMENTS floats).
    """
    if hidden.shape[:2] != ids.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and ids {tuple(ids.shape)} disagree on [N, T]"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    N, T = ids.shape
    rows = _rows(N, T * (vocab_size or 1 << 17), chunk_size)

    def chunk_fn(h: Tensor, i: Tensor) -> tuple[Tensor, Tensor]:
        logits = head(h).float()  # [c, T, V]
        if temperature != 1.0:  # skip the extra [c, T, V] copy in the common case
            logits = logits / temperature
        lp, ent = token_logp_entropy(
            logits, i, with_entropy=with_entropy, entropy_grad=entropy_grad
        )  # [c, T] each
        return lp, ent if ent is not None else torch.zeros_like(lp)

    use_ckpt = torch.is_grad_enabled() and (hidden.requires_grad or _has_grad_params(head))
    logps, ents = [], []
    for start in range(0, N, rows):
        h, i = hidden[start : start + rows], ids[start : start + rows]  # [c, T, H], [c, T]
        if use_ckpt:
            lp, ent = checkpoint(chunk_fn, h, i, use_reentrant=False)
        else:
            lp, ent = chunk_fn(h, i)
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps)  # [N, T]
    entropy = torch.cat(ents) if with_entropy else None  # [N, T]
    return logp, entropy


def _has_grad_params(head: Callable) -> bool:
    params = getattr(head, "parameters", None)
    return params is not None and any(p.requires_grad for p in params())


def selective_log_softmax(
    logits: Tensor,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Same as `chunked_head_logprobs` for logits you already have: logits [N, T, V], ids [N, T].

    Chunks rows so that the float32 upcast and softmax exist for one chunk at a time.
    """
    return chunked_head_logprobs(
        logits,
        lambda x: x,
        ids,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        vocab_size=logits.shape[-1],
    )


def completion_logprobs(
    model: Any,
    batch: TokenBatch,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    path: str = "fast",
) -> tuple[Tensor, Tensor | None]:
    """logp [N, T] and entropy [N, T] | None of a TokenBatch's completion tokens; masked slots 0.

    path: "fast" (fast_logprobs.py: each group's prompt once, fused LM head over the real
    completion tokens), "plain" (one [prompt | completion] pass, chunked autograd head) or
    "forward" (the model's full forward per chunk of rows); the same numbers up to float
    round-off. The fast and plain paths run the model's own head function (head.py).
    """
    if path not in LOGPROB_PATHS:
        raise ValueError(f"unknown log-prob path {path!r}; choose from {list(LOGPROB_PATHS)}")
    return LOGPROB_PATHS[path](
        model, batch, temperature=temperature, chunk_size=chunk_size,
        with_entropy=with_entropy, entropy_grad=entropy_grad,
    )  # fmt: skip


def plain_completion_logprobs(
    model: Any,
    batch: TokenBatch,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The plain path of completion_logprobs; masked slots 0.

    `model` is a transformers causal LM (peft adapters injected in place are fine): its decoder
    runs on [left-padded prompt | right-padded completion] and its head function (head.py: the
    LM head and whatever its forward applies after it) goes through `chunked_head_logprobs`, so
    full-vocabulary logits never exist for the whole batch.
    """
    hidden, device = completion_hidden(model, batch)  # [N, T, H]
    logp, entropy = chunked_head_logprobs(
        hidden,
        output_head(model),  # the model's own head path (head.py): soft-capping, scaling ...
        batch.completion_ids.to(device),  # [N, T]
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        vocab_size=model.config.get_text_config().vocab_size,
    )  # [N, T] each
    cmask = batch.completion_mask.to(device)  # [N, T]
    logp = logp.masked_fill(~cmask, 0.0)  # [N, T]
    entropy = entropy.masked_fill(~cmask, 0.0) if entropy is not None else None  # [N, T]
    return logp, entropy


def completion_hidden(model: Any, batch: TokenBatch) -> tuple[Tensor, torch.device]:
    """The decoder states [N, T, H] that predict the completion tokens 0..T-1 (differentiable when
    grad is on), and the model's device: one pass over [left-padded prompt | right-padded
    completion] with position ids from the attention mask (positions.py: the model's offset, or
    left-aligned rows where left padding cannot be represented)."""
    device = next(model.parameters()).device
    P, T = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    if P < 1 or T < 1:
        raise ValueError(f"log-probs need >= 1 prompt and completion column, got P={P}, T={T}")
    positions = decoder_positions(model)  # the model's position convention (positions.py)
    if not positions.left_padding:
        return aligned_hidden(decoder_of(model), batch, device), device
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1).to(device)  # [N, P+T]
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1).to(device)  # [N, P+T]
    # Position of each token among the real tokens of its row (plus the model's offset), so left
    # padding never shifts it (RoPE models are shift-invariant anyway; absolute-position models
    # are not).
    position_ids = positions.position_ids(mask)  # [N, P+T]
    # The last completion token predicts nothing we score, so it is not fed.
    hidden = decoder_of(model)(
        input_ids=ids[:, :-1],
        attention_mask=mask[:, :-1].long(),
        position_ids=position_ids[:, :-1],
        use_cache=False,
    ).last_hidden_state  # [N, P+T-1, H]
    return hidden[:, P - 1 :], device  # [N, T, H]


def chunked_pair_head(
    hidden: Tensor,
    head: Callable[[Tensor], Tensor],
    other_hidden: Tensor,
    other_head: Callable[[Tensor], Tensor],
    fn: Callable[[Tensor, Tensor], Tensor],
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """fn(head(h) / temperature, other_head(o) / temperature) -> [c] over rows of hidden [M, H]
    and other_hidden [M, H] (one row per position), a chunk of positions at a time, so that only
    [chunk, V] logits of each model exist at once; under activation checkpointing when gradients
    are on (the backward recomputes one chunk's logits). Returns [M], differentiable w.r.t.
    hidden and head (other_hidden / other_head: a frozen second model, e.g. a teacher)."""
    if hidden.shape[0] != other_hidden.shape[0]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and other_hidden {tuple(other_hidden.shape)} differ in "
            "their number of positions"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    M = hidden.shape[0]
    rows = _rows(M, vocab_size or 1 << 17, chunk_size)

    def chunk_fn(h: Tensor, o: Tensor) -> Tensor:
        logits = head(h).float() / temperature  # [c, V]
        with torch.no_grad():
            other = other_head(o).float() / temperature  # [c, V]
        return fn(logits, other)  # [c]

    use_ckpt = torch.is_grad_enabled() and (hidden.requires_grad or _has_grad_params(head))
    out = []
    for start in range(0, M, rows):
        h, o = hidden[start : start + rows], other_hidden[start : start + rows]  # [c, H] each
        out.append(checkpoint(chunk_fn, h, o, use_reentrant=False) if use_ckpt else chunk_fn(h, o))
    if not out:
        return hidden.new_zeros(0, dtype=torch.float32)  # [0]
    return torch.cat(out)  # [M]


def forward_completion_logprobs(
    model: Any,
    batch: TokenBatch,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The "forward" path: the model's own full forward on [prompt | completion] rows, a chunk of
    rows at a time (logits [chunk, T, V], the last T positions only), under activation
    checkpointing when gradients are on. Exact by construction, whatever the family does after
    its decoder; the fallback of the load-time probe (scoring_probe.py) when the fast / plain
    paths cannot reproduce the forward. Masked slots 0."""
    device = next(model.parameters()).device
    P, T = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    if P < 1 or T < 1:
        raise ValueError(f"log-probs need >= 1 prompt and completion column, got P={P}, T={T}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # Rows left-aligned (real tokens from column 0, padding on the right) and no position ids:
    # the model's own default positions are then the real ones whatever its convention
    # (positions.py), and a causal model's outputs never see the trailing pads.
    ids, mask, first = left_aligned(batch, device)  # [N, P+T] x2, [N]
    targets = batch.completion_ids.to(device)  # [N, T]
    N = ids.shape[0]
    rows = _rows(N, T * model.config.get_text_config().vocab_size, chunk_size)
    # logits kept: from the earliest predicting column on (the shortest prompt's last token)
    keep = P + T - 1 - int(first.min())

    def chunk_fn(i: Tensor, m: Tensor, f: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        logits = model(
            input_ids=i[:, :-1], attention_mask=m[:, :-1].long(), use_cache=False,
            logits_to_keep=keep,
        ).logits[:, -keep:]  # fmt: skip  # [c, keep, V]
        cols = f[:, None] - (P + T - 1 - keep) + torch.arange(T, device=device)  # [c, T]
        logits = logits.gather(1, cols[..., None].expand(-1, -1, logits.shape[-1])).float()
        # [c, T, V]
        if temperature != 1.0:
            logits = logits / temperature
        lp, ent = token_logp_entropy(
            logits, y, with_entropy=with_entropy, entropy_grad=entropy_grad
        )  # [c, T] each
        return lp, ent if ent is not None else torch.zeros_like(lp)

    use_ckpt = torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
    logps, ents = [], []
    for s in range(0, N, rows):
        part = (ids[s : s + rows], mask[s : s + rows], first[s : s + rows],
                targets[s : s + rows])  # fmt: skip
        lp, ent = checkpoint(chunk_fn, *part, use_reentrant=False) if use_ckpt else chunk_fn(*part)
        logps.append(lp)
        ents.append(ent)
    cmask = batch.completion_mask.to(device)  # [N, T]
    logp = torch.cat(logps).masked_fill(~cmask, 0.0)  # [N, T]
    entropy = torch.cat(ents).masked_fill(~cmask, 0.0) if with_entropy else None  # [N, T]
    return logp, entropy


def _fast(model: Any, batch: TokenBatch, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    from grouprl.policies.text.fast_logprobs import fast_completion_logprobs

    return fast_completion_logprobs(model, batch, **kwargs)


# completion_logprobs(path=...): how the completion tokens are scored ("forward": the load-time
# probe's exact fallback, scoring_probe.py)
LOGPROB_PATHS = {
    "fast": _fast,
    "plain": plain_completion_logprobs,
    "forward": forward_completion_logprobs,
}
