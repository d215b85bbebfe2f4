"""How FastEngine runs the model at decode time: where the key/value cache lives, one step's forward.

Both decoders own the per-row state of a decode batch (KV cache, attention mask, next position)
and offer the same three calls: `prefill(ids, mask)` on left-padded prompts, `select(rows)` to
repeat rows (a group's G copies of its prompt) or drop them (finished completions), and
`step(tokens)` for one new token per row. Each returns the logits of the next token, [n, V].

- `StaticKVDecoder` (Llama-family decoders: llama, mistral, qwen2, qwen3): one pre-allocated
  [n, kv_heads, capacity, head_dim] key and value buffer per layer, written in place at the
  step's column, and the logits come from the model's own head function (head.py: the LM head
  and whatever the forward applies after it). transformers' DynamicCache concatenates the whole cache at every step, so its
  copying grows with the square of the length (256 new tokens on the benchmark's 4M model: 3.0 s
  static vs 3.7 s dynamic when no row stops early). The forward calls the model's own modules (norms, projections,
  MLP, rotary embedding, and the modelling file's own `apply_rotary_pos_emb`), so LoRA layers
  that peft injected into them run, and only the loop around them is ours: no per-step mask
  construction or cache bookkeeping objects. Tests compare its logits with the model's forward.
- `DynamicKVDecoder`: any causal LM through its own forward and DynamicCache (the fallback),
  with the model's own position offset (positions.py).
- `FullForwardDecoder`: no cache, the full forward at every step, for decoders whose cached
  continuation is not their forward (a probe, fast_logprobs.shares_prompt_cache).

The cache columns are shared by all rows (prompts are left padded to one length P, token t of
every row goes to column P + t); each row's rotary position counts only its real tokens.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache

from grouprl.policies.text.fast_logprobs import shares_prompt_cache
from grouprl.policies.text.head import decoder_of, output_head
from grouprl.policies.text.positions import decoder_positions

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


class KVDecoder(ABC):
    """Decode state of one batch of rows; see the module docstring."""

    position: Tensor  # [n] rotary position of each row's next token

    @abstractmethod
    def prefill(self, ids: Tensor, mask: Tensor) -> Tensor:
        """ids, mask [B, P] (left padded) -> logits of each row's first new token [B, V]."""

    @abstractmethod
    def select(self, rows: Tensor) -> None:
        """Keep (and repeat) the given rows [n'] of the batch, in that order."""

    @abstractmethod
    def step(self, tokens: Tensor) -> Tensor:
        """tokens [n] (one per row) -> logits of the next token [n, V]."""

    def _start(self, mask: Tensor) -> Tensor:
        """Rotary positions of the prompt columns [B, P] (pads clamped to 0); sets `position`."""
        mask = mask.long()
        self.position = mask.sum(1)  # [B]
        return (mask.cumsum(1) - 1).clamp(min=0)  # [B, P]


class DynamicKVDecoder(KVDecoder):
    """The model's own forward with transformers' DynamicCache (any causal LM)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        # the position id of a row's first real token (positions.py: RoBERTa-style embeddings
        # start at padding_idx + 1); a model that cannot take left padding gets unpadded
        # prompts from the engine, whose positions then start at 0
        self.offset = decoder_positions(model).offset or 0
        self.mask = torch.zeros(0, 0, dtype=torch.long)  # [n, columns so far] 1 = a real token

    def _forward(self, ids: Tensor, positions: Tensor) -> Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]  # [n, V]

    def prefill(self, ids: Tensor, mask: Tensor) -> Tensor:
        positions = self._start(mask) + self.offset  # [B, P]
        self.position = self.position + self.offset  # [B] next token's position id
        self.mask = mask.long()
        return self._forward(ids, positions)

    def select(self, rows: Tensor) -> None:
        self.cache.reorder_cache(rows)
        self.mask, self.position = self.mask[rows], self.position[rows]

    def step(self, tokens: Tensor) -> Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], 1)  # [n, L+1]
        logits = self._forward(tokens[:, None], self.position[:, None])
        self.position = self.position + 1
        return logits


def static_kv_unsupported(model: Any, capacity: int) -> str | None:
    """Why StaticKVDecoder cannot run this model for `capacity` columns, or None if it can."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in LLAMA_FAMILY:
        return f"model type {kind!r} is not one of {LLAMA_FAMILY}"
    window = getattr(config, "sliding_window", None)  # qwen2 sets it to None when unused
    if window is not None and window < capacity:
        return f"sliding window {window} < {capacity} cached positions"
    decoder = decoder_of(model)
    if not all(hasattr(decoder, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the decoder lacks embed_tokens / layers / norm / rotary_emb"
    return None


class StaticKVDecoder(KVDecoder):
    """Pre-allocated per-layer K/V buffers and a plain loop over a Llama-family model's modules."""

    def __init__(self, model: Any, capacity: int) -> None:
        reason = static_kv_unsupported(model, capacity)
        if reason is not None:
            raise ValueError(f"StaticKVDecoder: {reason}")
        self.capacity = capacity
        self.base = decoder_of(model)
        self.head = output_head(model)  # the model's own head function (head.py)
        config = model.config
        self.layers = list(self.base.layers[: config.num_hidden_layers])
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        attn = self.layers[0].self_attn
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.qk_norm = hasattr(attn, "q_norm")  # qwen3: RMSNorm over each head before rotary
        self.keys: list[Tensor] = []  # per layer [n, kv_heads, capacity, head_dim]
        self.values: list[Tensor] = []
        self.length = 0  # columns filled
        # [n, capacity] True = a real token (pads only in the prompt columns); all_real: no pads
        self.visible = torch.zeros(0, capacity, dtype=torch.bool)
        self.all_real = True

    def prefill(self, ids: Tensor, mask: Tensor) -> Tensor:
        B, P = ids.shape
        if P > self.capacity:
            raise ValueError(f"StaticKVDecoder: prompt of {P} columns > capacity {self.capacity}")
        positions = self._start(mask)  # [B, P]
        real = mask.bool()  # [B, P]
        eye = torch.eye(P, dtype=torch.bool, device=ids.device)
        causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()  # [P, P]
        # A pad column's query also sees itself, so no row is fully masked: some attention
        # backends return NaN for such rows, and a NaN value reaches real rows even at weight 0.
        allowed = (causal[None] & real[:, None, :]) | eye  # [B, P, P]
        self.all_real = bool(real.all())
        self.visible = torch.ones(B, self.capacity, dtype=torch.bool, device=ids.device)
        self.visible[:, :P] = real
        return self._forward(ids, positions, allowed[:, None])

    def select(self, rows: Tensor) -> None:
        """Only the filled columns move: into new buffers when the batch grows (a group's
        copies), else into the first rows of the same buffers (finished rows dropped)."""
        n, L = len(rows), self.length
        for buffers in (self.keys, self.values):
            for i, buf in enumerate(buffers):
                kept = buf[rows, :, :L]  # [n, kv, L, d] (a copy)
                if n > buf.shape[0]:
                    buf = buf.new_empty((n, *buf.shape[1:]))
                buf[:n, :, :L] = kept
                buffers[i] = buf[:n]
        self.visible, self.position = self.visible[rows], self.position[rows]

    def step(self, tokens: Tensor) -> Tensor:
        if self.length >= self.capacity:
            raise ValueError(f"StaticKVDecoder: all {self.capacity} cache columns are used")
        hi = self.length + 1
        allowed = None if self.all_real else self.visible[:, None, None, :hi]  # [n, 1, 1, L+1]
        logits = self._forward(tokens[:, None], self.position[:, None], allowed)
        self.position = self.position + 1
        return logits

    def _forward(self, ids: Tensor, positions: Tensor, allowed: Tensor | None) -> Tensor:
        """ids, positions [n, s] written to columns length .. length+s -> last logits [n, V]."""
        n, s = ids.shape
        x = self.base.embed_tokens(ids)  # [n, s, hidden]
        cos, sin = self.base.rotary_emb(x, positions)  # [n, s, head_dim] each
        if not self.keys:
            self._allocate(n, x)
        lo, hi = self.length, self.length + s
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)  # [n, s, hidden]
            shape = (n, s, -1, attn.head_dim)
            q, k = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape)  # [n, s, heads, d]
            if self.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [n, heads, s, d]
            self.keys[i][:, :, lo:hi] = k
            self.values[i][:, :, lo:hi] = attn.v_proj(h).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q,
                self.keys[i][:, :, :hi],
                self.values[i][:, :, :hi],
                attn_mask=allowed,
                scale=attn.scaling,
                enable_gqa=q.shape[1] != k.shape[1],
            )  # [n, heads, s, d]
            x = x + attn.o_proj(o.transpose(1, 2).reshape(n, s, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.length = hi
        return self.head(self.base.norm(x[:, -1:]))[:, -1]  # [n, V]

    def _allocate(self, n: int, x: Tensor) -> None:
        shape = (n, self.kv_heads, self.capacity, self.layers[0].self_attn.head_dim)
        self.keys = [x.new_empty(shape) for _ in self.layers]
        self.values = [x.new_empty(shape) for _ in self.layers]


class FullForwardDecoder(KVDecoder):
    """No cache: the model's full forward over every row's tokens so far at each step (cost
    quadratic in the length). For decoders whose cached continuation is not their forward
    (fast_logprobs.shares_prompt_cache: a recurrent state kept outside the DynamicCache, as in
    RWKV / Mamba-2 / RecurrentGemma, or a mask widened on cached steps, as in GIT)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.offset = decoder_positions(model).offset  # None: unpadded prompts, no position ids
        self.ids = torch.zeros(0, 0, dtype=torch.long)  # [n, columns so far]
        self.mask = torch.zeros(0, 0, dtype=torch.long)  # [n, columns so far] 1 = a real token

    def _logits(self) -> Tensor:
        kwargs = {}
        if self.offset is not None:
            kwargs["position_ids"] = (self.mask.cumsum(1) - 1).clamp(min=0) + self.offset
        out = self.model(
            input_ids=self.ids, attention_mask=self.mask, use_cache=False, logits_to_keep=1,
            **kwargs,
        )  # fmt: skip
        return out.logits[:, -1]  # [n, V]

    def prefill(self, ids: Tensor, mask: Tensor) -> Tensor:
        self.position = mask.long().sum(1)  # [B] (unused: positions come from the mask)
        self.ids, self.mask = ids, mask.long()
        return self._logits()

    def select(self, rows: Tensor) -> None:
        self.ids, self.mask, self.position = self.ids[rows], self.mask[rows], self.position[rows]

    def step(self, tokens: Tensor) -> Tensor:
        self.ids = torch.cat([self.ids, tokens[:, None]], 1)  # [n, L+1]
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], 1)  # [n, L+1]
        return self._logits()


def make_decoder(model: Any, capacity: int, kv_cache: str = "auto") -> KVDecoder:
    """kv_cache: "static" (Llama family only), "dynamic", or "auto" (static where it can run).
    A decoder whose cached continuation differs from its forward gets the cache-free
    FullForwardDecoder with "auto" / "dynamic" (the static cache refuses non-Llama models)."""
    if kv_cache not in ("auto", "static", "dynamic"):
        raise ValueError(f"kv_cache must be 'auto', 'static' or 'dynamic', got {kv_cache!r}")
    if kv_cache != "static" and not shares_prompt_cache(model):
        return FullForwardDecoder(model)
    if kv_cache == "dynamic" or (
        kv_cache == "auto" and static_kv_unsupported(model, capacity) is not None
    ):
        return DynamicKVDecoder(model)
    return StaticKVDecoder(model, capacity)
