"""The fast scoring path of completion log-probs: each group's prompt once, the LM head fused.

Same result as logprobs.completion_logprobs' plain path (tests compare values and gradients),
computed with less work:

1. Prompt once per group. The G completions of a group share their prompt, so the decoder runs
   on each distinct prompt once (consecutive identical rows of [prompt_ids, prompt_mask]), keeps
   its key/value cache (with autograd), expands the cache G times (index_select: its backward
   sums the G gradient contributions) and runs the completions on top of it. The hidden state of
   the prompt's last position, which predicts completion token 0, is shared the same way. Only the
   (G - 1) / G redundant prompt passes disappear; attention sees the same keys and values.
   Under gradient checkpointing transformers drops the cache in training mode, so there (and
   when no prompt repeats) the batch runs as [prompt | completion] rows in one pass. So does a
   decoder whose cache cannot be shared this way (`shared_cache_fits`): a recurrent-state layer
   (Mamba, gated delta net, linear attention) is overwritten in place by transformers' cache on
   the completion pass (copy_), which breaks the gradient of the state that pass read, and a
   family's own cache class (MiniMax's) holds state that DynamicCache.reorder_cache does not
   expand. The decision is read from the cache the decoder builds, not from family names.
2. Padding removed before the LM head ("packing"): only the real completion tokens [M, H] go
   through fused_head.py's head (one token chunk of logits at a time, forward and backward).
   The head is the model's own head function (head.py); where that is not exactly a plain
   nn.Linear (a LoRA-wrapped lm_head, a family that soft-caps or scales its logits) it goes
   through the chunked autograd head of logprobs.py instead.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from grouprl.policies.text.fused_head import fused_head_logprobs
from grouprl.policies.text.head import OutputHead, decoder_of, output_head
from grouprl.policies.text.positions import (
    LOW_PRECISION_RTOL,
    PROBE_RTOL,
    DecoderPositions,
    aligned_hidden,
    decoder_positions,
    probe_ids,
)
from grouprl.types import TokenBatch


def prompt_runs(prompt_ids: Tensor, prompt_mask: Tensor) -> Tensor:
    """Index of each row's run of consecutive identical (ids, mask) prompt rows: [N] long."""
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (prompt_mask[1:] == prompt_mask[:-1]).all(
        1
    )  # [N-1]
    new = torch.cat([torch.ones(1, dtype=torch.long), (~same).long()])  # [N]
    return new.cumsum(0) - 1  # [N]


def _plain_hidden(
    decoder: Any, ids: Tensor, mask: Tensor, P: int, positions: DecoderPositions
) -> Tensor:
    """[prompt | completion] rows in one pass -> the states that predict completion tokens."""
    position_ids = positions.position_ids(mask)  # [N, P+T]
    hidden = decoder(
        input_ids=ids[:, :-1],
        attention_mask=mask[:, :-1].long(),
        position_ids=position_ids[:, :-1],
        use_cache=False,
    ).last_hidden_state  # [N, P+T-1, H]
    return hidden[:, P - 1 :]  # [N, T, H]


def shared_cache_fits(cache: Any) -> bool:
    """Whether a decoder's cache can be expanded to a group's rows and run on with autograd:
    transformers' generic DynamicCache (reorder_cache covers all of its state) made of key/value
    layers only (a recurrent-state layer is overwritten in place by the next pass)."""
    layers = getattr(cache, "layers", None) or []
    return type(cache) is DynamicCache and not any(
        isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers
    )


def _shared_prompt_hidden(
    decoder: Any, batch: TokenBatch, runs: Tensor, device: Any, positions: DecoderPositions
) -> Tensor | None:
    """Each distinct prompt once, its cache expanded to its rows, then the completions; None
    when the decoder's own cache cannot be shared (shared_cache_fits)."""
    if not shared_cache_fits(DynamicCache(config=decoder.config)):  # layer kinds, no tensors
        return None
    first = torch.ones(len(runs), dtype=torch.bool)
    first[1:] = runs[1:] != runs[:-1]  # [N] first row of each run
    p_ids = batch.prompt_ids[first].to(device)  # [B, P]
    p_mask = batch.prompt_mask[first].to(device).long()  # [B, P]
    out = decoder(  # the decoder builds its own cache (a family may refuse another cache class)
        input_ids=p_ids,
        attention_mask=p_mask,
        position_ids=positions.position_ids(p_mask),  # [B, P]
        use_cache=True,
    )
    cache = getattr(out, "past_key_values", None)  # RWKV returns its state under another name
    if not shared_cache_fits(cache):
        return None
    h_prompt = out.last_hidden_state[:, -1]  # [B, H]: predicts completion token 0 (left padded)
    rows = runs.to(device)  # [N]
    h_first = h_prompt.index_select(0, rows)[:, None]  # [N, 1, H]
    T = batch.completion_ids.shape[1]
    if T == 1:
        return h_first
    cache.reorder_cache(rows)  # [N, kv, P, d] per layer, differentiable
    c_ids = batch.completion_ids[:, :-1].to(device)  # [N, T-1]: the last token predicts nothing
    mask = torch.cat([batch.prompt_mask, batch.completion_mask[:, :-1]], 1).to(device)  # [N, P+T-1]
    start = batch.prompt_mask.sum(1).to(device)  # [N] real prompt tokens
    steps = start[:, None] + positions.offset + torch.arange(T - 1, device=device)  # [N, T-1]
    h_rest = decoder(
        input_ids=c_ids,
        attention_mask=mask.long(),
        position_ids=steps,
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state  # [N, T-1, H]
    return torch.cat([h_first, h_rest], 1)  # [N, T, H]


def completion_hidden(model: Any, batch: TokenBatch) -> Tensor:
    """The decoder states that predict each completion token, [N, T, H] (see module docstring)."""
    device = next(model.parameters()).device
    decoder = decoder_of(model)
    positions = decoder_positions(model)  # the model's position convention (positions.py)
    if not positions.left_padding:  # left padding not representable: left-aligned rows
        return aligned_hidden(decoder, batch, device)
    runs = prompt_runs(batch.prompt_ids, batch.prompt_mask)  # [N]
    checkpointing = getattr(model, "is_gradient_checkpointing", False) and model.training
    if (
        int(runs[-1]) + 1 < len(runs)
        and not checkpointing
        and shares_prompt_cache(model)  # probed once per model (runs the path below once)
    ):
        hidden = _shared_prompt_hidden(decoder, batch, runs, device, positions)
        if hidden is not None:
            return hidden
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1).to(device)  # [N, P+T]
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1).to(device)  # [N, P+T]
    return _plain_hidden(decoder, ids, mask, batch.prompt_ids.shape[1], positions)


_SHARES_CACHE: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def shares_prompt_cache(model: Any) -> bool:
    """Whether a prompt's cache, expanded over its rows, continues exactly like one pass over
    [prompt | completion] for this model; probed once per model on a padded two-row group.

    Not every decoder keeps its whole state in the DynamicCache it is handed: recurrent and
    hybrid decoders (mamba2, recurrent_gemma) keep a state of their own that `reorder_cache` does
    not expand, and some widen the mask of a cached continuation (GIT adds its image tokens). For
    those the fast path runs the one-pass layout (still packed, still the fused head)."""
    decoder = decoder_of(model)
    found = _SHARES_CACHE.get(decoder)
    if found is None:
        left_padding = decoder_positions(model).left_padding  # else rows are never cached
        found = _SHARES_CACHE[decoder] = left_padding and _probe_cache(model, decoder)
    return found


def _probe_cache(model: Any, decoder: Any) -> bool:
    positions = decoder_positions(model)
    param = next(decoder.parameters())
    ids = probe_ids(model.config.get_text_config(), param.device)  # [1, L]
    p_ids = torch.cat([ids[:, :1], ids[:, :2]], 1).repeat(2, 1)  # [2, 3]: one pad, two real
    p_mask = torch.tensor([[False, True, True]] * 2, device=param.device)  # [2, 3]
    c_ids = torch.stack([ids[0, 2:], ids[0, 2:].flip(0)])  # [2, L-2]
    batch = TokenBatch(p_ids, p_mask, c_ids, torch.ones_like(c_ids, dtype=torch.bool),
                       torch.zeros(2, dtype=torch.bool))  # fmt: skip
    runs = torch.zeros(2, dtype=torch.long)  # one group of two rows
    was_training = decoder.training
    decoder.eval()
    try:
        with torch.no_grad():
            one_pass = _plain_hidden(
                decoder, torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, batch.completion_mask], 1),
                p_ids.shape[1], positions,
            ).float()  # fmt: skip  # [2, T, H]
            try:
                shared = _shared_prompt_hidden(decoder, batch, runs, param.device, positions)
            except Exception:  # noqa: BLE001 - any failure of the cached continuation: one pass
                return False
            if shared is None:  # a cache that cannot be shared (shared_cache_fits)
                return False
    finally:
        decoder.train(was_training)
    rtol = PROBE_RTOL.get(param.dtype, LOW_PRECISION_RTOL)
    scale = float(one_pass.abs().max()) + 1e-6
    return float((shared.float() - one_pass).abs().max()) <= rtol * scale


def fast_completion_logprobs(
    model: Any,
    batch: TokenBatch,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """logp [N, T] and entropy [N, T] | None of the completion tokens; masked slots are 0.

    chunk_size: rows per LM-head chunk as in the plain path, i.e. chunk_size * T tokens per fused
    chunk (None: fused_head.CHUNK_ELEMENTS sizing).
    """
    P, T = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    if P < 1 or T < 1:
        raise ValueError(f"log-probs need >= 1 prompt and completion column, got P={P}, T={T}")
    hidden = completion_hidden(model, batch)  # [N, T, H]
    return head_logprobs(
        model, hidden, batch, temperature=temperature, chunk_size=chunk_size,
        with_entropy=with_entropy, entropy_grad=entropy_grad,
    )  # fmt: skip


def head_logprobs(
    model: Any,
    hidden: Tensor,
    batch: TokenBatch,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    banned: list[int] | None = None,
    head: OutputHead | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The model's head function on the states that predict the completion tokens, hidden
    [N, T, H] -> logp [N, T] and entropy [N, T] | None, masked slots 0: the real tokens only
    through the fused head when that function is exactly a plain nn.Linear (head.py's probe),
    else the chunked autograd head over the model's own head function (soft-capping, logit
    scaling ...). head: the model's OutputHead (None: after its decoder). Also the
    vision-language path's head (policies/vision/logprobs.py), where `banned` token ids get logit
    -inf (the tokens its engines never sample: the distribution scored is the one sampled)."""
    from grouprl.policies.text.logprobs import chunked_head_logprobs  # logprobs imports this module

    T = batch.completion_ids.shape[1]
    cmask = batch.completion_mask.to(hidden.device)  # [N, T]
    ids = batch.completion_ids.to(hidden.device)  # [N, T]
    head = output_head(model) if head is None else head
    if head.linear is not None and not banned:
        lp, ent = fused_head_logprobs(
            hidden[cmask], head.linear, ids[cmask], temperature=temperature,
            chunk_size=chunk_size * T if chunk_size else None,
            with_entropy=with_entropy, entropy_grad=entropy_grad,
        )  # fmt: skip  # [M] each
        logp = lp.new_zeros(cmask.shape).masked_scatter(cmask, lp)  # [N, T]
        entropy = ent.new_zeros(cmask.shape).masked_scatter(cmask, ent) if with_entropy else None
        return logp, entropy
    logp, entropy = chunked_head_logprobs(
        hidden, _without(head, banned) if banned else head, ids, temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy, entropy_grad=entropy_grad,
        vocab_size=model.config.get_text_config().vocab_size,
    )  # fmt: skip  # [N, T] each
    logp = logp.masked_fill(~cmask, 0.0)  # [N, T]
    entropy = entropy.masked_fill(~cmask, 0.0) if entropy is not None else None  # [N, T]
    return logp, entropy


def _without(head: OutputHead, banned: list[int]) -> Any:
    """head(h) with the banned columns of the logits at -1e30 (through the chunked head path):
    exp() of it is exactly 0, so log-probs equal those of the engine's -inf, and unlike -inf it
    keeps the entropy's sum p * z finite (0 * -inf would be NaN)."""

    def masked(h: Tensor) -> Tensor:
        logits = head(h).float()  # [..., V] float32: -1e30 overflows float16 / bfloat16's range
        return logits.index_fill(-1, torch.tensor(banned, device=logits.device), -1e30)

    masked.parameters = head.parameters  # the chunked path checkpoints a head with weights
    return masked
