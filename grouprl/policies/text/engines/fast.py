"""The lean text engine: our own decode loop over the trainer's transformers model.

Same contract and the same sampling distribution as `HFEngine` (hf.py): ancestral sampling from
softmax(processed logits), processing = temperature -> top-k -> top-p with transformers' own
warper classes (so the order and tie rules are theirs), the log-prob of each sampled token under
that processed distribution, completions ending at the first EOS (kept) or at the token that
completes a stop string (kept), `truncated` when max_new_tokens ran out. Greedy takes the argmax
with log-probs under softmax(logits / temperature). What it does differently, for speed:

- The shared prompt is computed once per group: consecutive identical prompts (the G copies of a
  group) are prefilled as one row and the KV cache is then expanded G times.
- One model forward per token with a KV cache and nothing else: no generate() machinery, no
  per-step stopping-criteria objects; rows that finished are dropped from the batch (and from the
  cache), so a group whose answers are short stops costing compute.
- Sampling by a two-level inverse CDF (`sample_tokens`): 2 uniforms per row instead of
  torch.multinomial, which on CPU costs ~10x a full log-softmax at a 32k vocabulary. The chosen
  token has probability p_j / sum(p) with sums accumulated in float64, i.e. exactly the reported
  distribution up to float32 round-off of p itself. The token sequence differs from HFEngine's for
  the same seed (a different use of the random stream); the distribution is the same (tested).
  Greedy decoding gives the same tokens as HFEngine.

- The KV cache of Llama-family models (llama, mistral, qwen2, qwen3) is pre-allocated and written
  in place, and the decode step is a plain loop over the model's modules (kv_decode.py); other
  models run their own forward with transformers' DynamicCache, which copies the whole cache at
  every step. Dropping finished rows copies the kept rows once, on the steps where rows finish.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from grouprl.policies.text.engines.base import (
    GenerationOutput,
    InProcessEngine,
    SamplingParams,
    check_generate_args,
)
from grouprl.policies.text.engines.kv_decode import make_decoder
from grouprl.policies.text.positions import decoder_positions

BLOCK = 128  # vocabulary block of the two-level sampler


def _below(total: Tensor) -> Tensor:
    """The largest float64 strictly below `total` (so u * total never rounds up onto it)."""
    return torch.nextafter(total, torch.zeros_like(total))


def sample_tokens(logp: Tensor, u: Tensor) -> Tensor:
    """One token per row from log-probs logp [B, V] (-inf = excluded) and uniforms u [B, 2]
    (float64 in [0, 1)) -> ids [B].

    Two-level inverse CDF: u[:, 0] picks a block of BLOCK tokens with probability proportional to
    its mass, u[:, 1] a token inside it; all sums in float64. A token with p = 0 is never chosen.
    """
    B, V = logp.shape
    p = logp.float().exp()  # [B, V]
    n_blocks = -(-V // BLOCK)
    if n_blocks * BLOCK != V:
        p = F.pad(p, (0, n_blocks * BLOCK - V))  # [B, nb*K]
    blocks = p.view(B, n_blocks, BLOCK)  # [B, nb, K]
    cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [B, nb]
    total = cdf[:, -1:]  # [B, 1]
    if not (torch.isfinite(total).all() and (total > 0).all()):
        raise RuntimeError("FastEngine: non-finite or all-zero sampling probabilities")
    u = u.to(device=p.device, dtype=torch.float64)  # [B, 2]
    u1 = u[:, :1] * total  # [B, 1]
    b = torch.searchsorted(cdf, torch.minimum(u1, _below(total)), right=True)  # [B, 1]
    inner = blocks.gather(1, b[:, :, None].expand(B, 1, BLOCK))[:, 0]  # [B, K]
    icdf = inner.to(torch.float64).cumsum(-1)  # [B, K]
    itotal = icdf[:, -1:]  # [B, 1]
    u2 = u[:, 1:] * itotal  # [B, 1]
    k = torch.searchsorted(icdf, torch.minimum(u2, _below(itotal)), right=True)  # [B, 1]
    return (b * BLOCK + k)[:, 0]  # [B]


def _uniforms(active: Tensor, gens: list[torch.Generator] | None) -> Tensor:
    """[n, 2] float64 uniforms for the active rows: the global RNG, or each row's generator."""
    if gens is None:
        return torch.rand(len(active), 2, dtype=torch.float64)
    return torch.stack([torch.rand(2, dtype=torch.float64, generator=gens[i]) for i in active])


def _warpers(params: SamplingParams, greedy: bool) -> list[Any]:
    """temperature -> top-k -> top-p, as HFEngine passes them to generate (greedy: temperature)."""
    out: list[Any] = []
    if params.temperature != 1.0:
        out.append(TemperatureLogitsWarper(params.temperature))
    if not greedy and params.top_k > 0:
        out.append(TopKLogitsWarper(top_k=params.top_k))
    if not greedy and params.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=params.top_p))
    return out


def _runs(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Consecutive identical prompts -> (distinct prompts, run lengths)."""
    uniq: list[list[int]] = []
    counts: list[int] = []
    for p in prompts:
        if uniq and p == uniq[-1]:
            counts[-1] += 1
        else:
            uniq.append(p)
            counts.append(1)
    return uniq, counts


class FastEngine(InProcessEngine):
    """A lean decode loop over a (possibly peft-wrapped) causal LM that the trainer also updates.

    batch_size: prompts per decode batch (None = all at once).
    kv_cache: "auto" (pre-allocated buffers for Llama-family models, else DynamicCache),
    "static" or "dynamic" (kv_decode.py).
    """

    def __init__(
        self, model: Any, tokenizer: Any, batch_size: int | None = None, kv_cache: str = "auto"
    ) -> None:
        super().__init__(model, tokenizer, batch_size)
        make_decoder(self._hf_model, 1, kv_cache)  # fails early on a bad value or model
        self.kv_cache = kv_cache

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        params: SamplingParams,
        *,
        greedy: bool = False,
        seeds: list[int] | None = None,
    ) -> GenerationOutput:
        """One completion per prompt (consecutive identical prompts share one prefill).
        seeds: one per prompt, each row then draws its uniforms from its own generator
        (engines/seeded.py); None: torch's global RNG."""
        check_generate_args("FastEngine", prompt_token_ids, seeds)
        if not prompt_token_ids:
            return GenerationOutput([], [], [])
        return self._generate_in_chunks(prompt_token_ids, params, greedy, seeds)

    def _generate_chunk(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        greedy: bool,
        seeds: list[int] | None,
    ) -> GenerationOutput:
        lengths = sorted({len(p) for p in prompts})
        if len(lengths) > 1 and not decoder_positions(self._hf_model).left_padding:
            return self._by_length(prompts, lengths, params, greedy, seeds)
        device = next(self._hf_model.parameters()).device
        uniq, counts = _runs(prompts)
        B, P, T = len(uniq), max(len(p) for p in uniq), params.max_new_tokens
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)  # [B, P] left padded
        mask = torch.zeros((B, P), dtype=torch.long)  # [B, P]
        for i, p in enumerate(uniq):
            ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, P - len(p) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        decoder = make_decoder(self._hf_model, P + T, self.kv_cache)
        logits = decoder.prefill(ids, mask)  # [B, V]: once per group
        rows = torch.repeat_interleave(
            torch.arange(B, device=device), torch.tensor(counts, device=device)
        )  # [N]
        decoder.select(rows)  # the shared prompt's K/V, G copies
        logits = logits[rows]  # [N, V]
        return decode(decoder, logits, params, greedy, seeds, self.eos_ids, self.pad_id,
                      self.tokenizer)  # fmt: skip

    def _by_length(
        self,
        prompts: list[list[int]],
        lengths: list[int],
        params: SamplingParams,
        greedy: bool,
        seeds: list[int] | None,
    ) -> GenerationOutput:
        """A model that cannot take left padding (positions.py: BART-style learned positions,
        a recurrence through the pads): the prompts of each length decode together, unpadded,
        and the completions go back in the prompts' order."""
        out = GenerationOutput([[]] * len(prompts), [[]] * len(prompts), [False] * len(prompts))
        for n in lengths:
            idx = [i for i, p in enumerate(prompts) if len(p) == n]
            part = self._generate_chunk(
                [prompts[i] for i in idx], params, greedy,
                None if seeds is None else [seeds[i] for i in idx],
            )  # fmt: skip
            for j, i in enumerate(idx):
                out.completion_ids[i] = part.completion_ids[j]
                out.logprobs[i] = part.logprobs[j]
                out.truncated[i] = part.truncated[j]
        return out


def decode(
    decoder: Any,
    logits: Tensor,
    params: SamplingParams,
    greedy: bool,
    seeds: list[int] | None,
    eos_ids: list[int],
    pad_id: int,
    tokenizer: Any,
    banned: list[int] | None = None,
) -> GenerationOutput:
    """The decode loop after the prefill: logits [N, V] of every row's first new token (the
    decoder's rows already expanded to one per completion), then one decoder step per token until
    every row stopped or max_new_tokens ran out. Shared by this engine and the vision-language one
    (policies/vision/engines/fast.py), whose decoders differ only in how they prefill.
    banned: token ids never sampled (their logits -inf before any warper): a VLM's image
    placeholder tokens, which its processor would read as image slots."""
    device = logits.device
    N, T = logits.shape[0], params.max_new_tokens
    warpers = _warpers(params, greedy)
    gens = None if seeds is None else [torch.Generator().manual_seed(int(s)) for s in seeds]
    eos = torch.tensor(eos_ids, device=device)
    tokens = torch.full((N, T), pad_id, dtype=torch.long)  # [N, T]
    logps = torch.zeros((N, T), dtype=torch.float32)  # [N, T]
    length = torch.full((N,), T, dtype=torch.long)  # [N]
    stopped = torch.zeros(N, dtype=torch.bool)  # [N]
    active = torch.arange(N)  # [n] original rows still generating
    for t in range(T):
        scores = logits.float()  # [n, V]
        if banned:
            scores[:, banned] = float("-inf")
        for warp in warpers:
            scores = warp(None, scores)  # [n, V]
        logp = torch.log_softmax(scores, dim=-1)  # [n, V]
        tok = scores.argmax(-1) if greedy else sample_tokens(logp, _uniforms(active, gens))
        tokens[active, t] = tok.cpu()
        logps[active, t] = logp.gather(-1, tok[:, None])[:, 0].cpu()
        done = torch.isin(tok, eos).cpu()  # [n]
        if params.stop:
            done |= _hit_stop(tokenizer, tokens, active, t, params.stop)
        length[active[done]] = t + 1
        stopped[active[done]] = True
        keep = ~done  # [n]
        if t == T - 1 or not keep.any():
            break
        if not keep.all():  # drop finished rows from the batch and the cache
            idx = keep.nonzero()[:, 0].to(device)  # [n']
            decoder.select(idx)
            active, tok = active[keep], tok[idx]
        logits = decoder.step(tok)  # [n, V]
    return GenerationOutput(
        completion_ids=[tokens[i, : length[i]].tolist() for i in range(N)],
        logprobs=[logps[i, : length[i]].tolist() for i in range(N)],
        truncated=(~stopped).tolist(),
    )


def _hit_stop(tokenizer: Any, tokens: Tensor, active: Tensor, t: int, stops: list[str]) -> Tensor:
    """[n] bool: the text generated so far contains a stop string (first time: at token t)."""
    texts = tokenizer.batch_decode(tokens[active, : t + 1].tolist())
    return torch.tensor([any(s in text for s in stops) for text in texts], dtype=torch.bool)
