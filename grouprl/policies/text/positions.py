"""Which position ids a causal LM's decoder expects, measured once per model (a load-time probe).

grouprl scores left-padded prompts and passes explicit position ids so that padding never shifts
a row's positions. The convention "the first real token is position 0" (`cumsum(mask) - 1`) holds
for the RoPE families (Llama, Qwen ...), not for every family in transformers:

- RoBERTa-style embeddings (roberta, xlm-roberta, camembert, data2vec-text ...) number the first
  real token `padding_idx + 1` (their `create_position_ids_from_input_ids`), so `cumsum - 1` reads
  the wrong rows of the learned position table;
- BART-style decoders (bart, mbart, marian, pegasus, blenderbot, trocr ...) and recurrent models
  (rwkv) do not take position ids at all: their learned positions count columns from 0 (or the
  recurrence runs through the pad tokens), so a left-padded row is not the unpadded row shifted.

Rather than list families, `decoder_positions(model)` asks the model: one short unpadded row
through its decoder without position ids (the model's own default) is the reference; the same row
left padded, with `cumsum(mask) - 1 + k` as position ids, must reproduce it. k = 0 is tried first
(the common case costs two tiny forwards, once per model); else k is read off the unpadded row
(the offset at which explicit ids reproduce the default ids). When no k reproduces the reference
from a padded row, left padding cannot be represented for this model and scoring lays the rows
out left-aligned instead (real tokens from column 0, padding on the right): the model's default
positions are then the real ones, and a causal model's outputs never see the trailing pads.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grouprl.policies.text.head import decoder_of
from grouprl.types import TokenBatch

# relative bound on |padded - unpadded| / max|unpadded| of the decoder's last hidden states
PROBE_RTOL: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.float64: 1e-6}
LOW_PRECISION_RTOL = 3e-2
PROBE_TOKENS, PROBE_PADS, MAX_OFFSET = 5, 2, 4


@dataclass(frozen=True)
class DecoderPositions:
    """offset: the position id of a row's first real token (explicit ids `cumsum(mask) - 1 +
    offset`); None: left padding cannot be represented, rows are scored left-aligned."""

    offset: int | None

    @property
    def left_padding(self) -> bool:
        return self.offset is not None

    def position_ids(self, mask: Tensor) -> Tensor:
        """mask [N, L] (left padded) -> position ids [N, L] (pads clamped to the first one)."""
        return (mask.long().cumsum(1) - 1).clamp(min=0) + self.offset  # [N, L]


_CACHE: weakref.WeakKeyDictionary[Any, DecoderPositions] = weakref.WeakKeyDictionary()


def decoder_positions(model: Any) -> DecoderPositions:
    """The position convention of `model`'s decoder (a transformers causal LM, peft adapters
    injected in place are fine); probed on first use and remembered for the model."""
    decoder = decoder_of(model)
    found = _CACHE.get(decoder)
    if found is None:
        found = _CACHE[decoder] = _probe(decoder, model.config.get_text_config())
    return found


def probe_ids(config: Any, device: Any) -> Tensor:
    """PROBE_TOKENS ids [1, L] from a fixed seed, none of them a special token of the config
    (a pad id among real tokens would change RoBERTa-style default positions)."""
    vocab = config.vocab_size
    special = {
        v
        for k in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
        for v in (lambda x: x if isinstance(x, list) else [x])(getattr(config, k, None))
        if isinstance(v, int)
    }
    pool = torch.tensor([i for i in range(min(vocab, 64)) if i not in special])  # [V']
    gen = torch.Generator().manual_seed(0)
    return pool[torch.randint(len(pool), (1, PROBE_TOKENS), generator=gen)].to(device)  # [1, L]


def _probe(decoder: Any, config: Any) -> DecoderPositions:
    param = next(decoder.parameters())
    rtol = PROBE_RTOL.get(param.dtype, LOW_PRECISION_RTOL)
    ids = probe_ids(config, param.device)  # [1, L]
    ones = torch.ones_like(ids)  # [1, L]
    padded = torch.cat([ids[:, :PROBE_PADS], ids], 1)  # [1, pads+L]: pads are ordinary ids, masked
    mask = torch.cat([torch.zeros_like(ids[:, :PROBE_PADS]), ones], 1)  # [1, pads+L]
    base = (mask.cumsum(1) - 1).clamp(min=0)  # [1, pads+L]

    def run(i: Tensor, m: Tensor, pos: Tensor | None) -> Tensor | None:
        kwargs = {} if pos is None else {"position_ids": pos}
        try:
            out = decoder(input_ids=i, attention_mask=m, use_cache=False, **kwargs)
        except (TypeError, ValueError):  # a decoder without position ids
            return None
        return out.last_hidden_state[:, -PROBE_TOKENS:].float()  # [1, L, H]

    was_training = decoder.training
    decoder.eval()  # no dropout in the probe
    try:
        with torch.no_grad():
            ref = run(ids, ones, None)  # [1, L, H]: the model's own default positions
            scale = float(ref.abs().max()) + 1e-6

            def close(h: Tensor | None) -> bool:
                return h is not None and float((h - ref).abs().max()) <= rtol * scale

            if close(run(padded, mask, base)):
                return DecoderPositions(0)
            arange = torch.arange(PROBE_TOKENS, device=ids.device)[None]  # [1, L]
            for k in range(1, MAX_OFFSET + 1):
                if close(run(ids, ones, arange + k)) and close(run(padded, mask, base + k)):
                    return DecoderPositions(k)
    finally:
        decoder.train(was_training)
    return DecoderPositions(None)


def left_aligned(batch: TokenBatch, device: Any) -> tuple[Tensor, Tensor, Tensor]:
    """[prompt | completion] rows with each row's real tokens moved to column 0 and the padding to
    the right: ids [N, P+T], mask [N, P+T] and `first` [N], the column of the state that predicts
    completion token 0 (the row's last real prompt token); token t is predicted at first + t."""
    P, T = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1).to(device)  # [N, P+T]
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1).to(device)  # [N, P+T]
    pads = P - batch.prompt_mask.sum(1).to(device)  # [N] left pads of each prompt
    cols = torch.arange(P + T, device=device)[None]  # [1, P+T]
    src = (cols + pads[:, None]).clamp(max=P + T - 1)  # [N, P+T] source column of each slot
    inside = cols < (P + T - pads[:, None])  # [N, P+T] slots that hold a moved column
    return ids.gather(1, src), mask.gather(1, src) & inside, P - 1 - pads  # [N, P+T] x2, [N]


def aligned_hidden(decoder: Any, batch: TokenBatch, device: Any) -> Tensor:
    """The decoder states [N, T, H] that predict the completion tokens, from one pass over the
    left-aligned rows with the model's own default positions (no position ids passed)."""
    T = batch.completion_ids.shape[1]
    ids, mask, first = left_aligned(batch, device)  # [N, P+T] x2, [N]
    hidden = decoder(
        input_ids=ids[:, :-1], attention_mask=mask[:, :-1].long(), use_cache=False
    ).last_hidden_state  # [N, P+T-1, H]
    cols = first[:, None] + torch.arange(T, device=device)  # [N, T]
    return hidden.gather(1, cols[..., None].expand(-1, -1, hidden.shape[-1]))  # [N, T, H]
