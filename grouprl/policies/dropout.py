"""train.disable_dropout: every dropout of the trained model set to p = 0.

Why: the trainer scores tokens in train mode while the engine samples (and the reference scores)
without dropout, so with dropout > 0 (GPT-2 ships 0.1 on residuals, embeddings and attention)
the trainer's log-probs are noisy copies of the sampler's: on a tiny GPT-2 the mean gap was
0.33 nats per token instead of ~1e-6, the PPO ratio is not 1 at the first step, and the
engine-mismatch correction weights measure dropout noise, not engine drift. TRL has the same
switch (GRPOConfig.disable_dropout); verl zeroes dropout in its model configs.

Set to p = 0 (not eval mode) so that `model.train()` cannot turn them back on:
- every torch dropout module (nn.Dropout, Dropout1d/2d/3d, AlphaDropout, FeatureAlphaDropout);
- float dropout rates kept as module attributes and used functionally (attention_dropout of
  Qwen2 / Llama / Mistral attention, dropout of nn.MultiheadAttention, GPT-2's sdpa path reads
  attn_dropout.p, covered by the first rule).
LoRA dropout (peft's lora_dropout modules) is a dropout like the others and is switched off too:
the sampler never applies it, so it would bias every ratio the same way. A user who asked for
model.lora.dropout > 0 gets a warning naming both options (train.disable_dropout=false keeps it).
"""

from __future__ import annotations

from typing import Any

from torch import nn

_RATE_ATTRIBUTES = ("attention_dropout", "dropout", "dropout_p", "attn_dropout_p")


def disable_dropout(module: nn.Module) -> list[str]:
    """Set every dropout probability under `module` to 0; returns the names changed (p > 0)."""
    changed: list[str] = []
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.dropout._DropoutNd):
            if sub.p > 0:
                changed.append(name or type(sub).__name__)
            sub.p = 0.0
            continue
        for attr in _RATE_ATTRIBUTES:
            # the instance dict only: diffusers' __getattr__ forwards config names with a warning
            value = vars(sub).get(attr)
            if isinstance(value, float) and not isinstance(value, bool) and value > 0:
                setattr(sub, attr, 0.0)
                changed.append(f"{name}.{attr}" if name else attr)
    return changed


def disable_policy_dropout(policy: Any) -> list[str]:
    """disable_dropout on every nn.Module the policy holds (the model, a reference copy, the
    transformer / UNet of image policies), or on the policy itself when it is a module."""
    if isinstance(policy, nn.Module):
        return disable_dropout(policy)
    changed: list[str] = []
    for attr, value in vars(policy).items():
        if isinstance(value, nn.Module):
            changed += [f"{attr}.{n}" for n in disable_dropout(value)]
    return changed
