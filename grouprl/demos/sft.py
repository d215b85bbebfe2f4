"""A short supervised warm-up: teach a fresh model the task's answer format before RL.

Loss is next-token cross-entropy on the answer tokens only (prompt tokens are context), on
`prompt + answer + EOS` for examples with a string "answer" column.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch


def _batch(tokenizer: Any, examples: list[dict]) -> tuple[torch.Tensor, ...]:
    """input_ids, attention_mask, labels: Long[B, L] right padded; labels -100 off the answer."""
    rows, labels = [], []
    for ex in examples:
        p = tokenizer(ex["prompt"], add_special_tokens=False).input_ids
        a = tokenizer(str(ex["answer"]), add_special_tokens=False).input_ids + [
            tokenizer.eos_token_id
        ]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])  # [B, L]
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])  # [B, L]
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])  # [B, L]
    return ids, mask, lab


@torch.no_grad()
def greedy_exact_match(model: Any, tokenizer: Any, examples: list[dict]) -> float:
    """Fraction of examples whose answer + EOS greedy decoding reproduces exactly.

    Computed teacher-forced in one forward: greedy decoding emits the answer iff the argmax at
    every answer position is the answer's next token.
    """
    was_training = model.training
    model.eval()
    ids, mask, lab = _batch(tokenizer, examples)  # [B, L] each
    pred = model(input_ids=ids, attention_mask=mask).logits[:, :-1].argmax(-1)  # [B, L-1]
    target = lab[:, 1:]  # [B, L-1]
    ok = (pred == target) | (target == -100)  # [B, L-1]
    model.train(was_training)
    return float(ok.all(-1).float().mean())


def supervised_warmup(
    model: Any,
    tokenizer: Any,
    examples: list[dict],
    *,
    max_steps: int,
    target_accuracy: float | None = None,
    check_every: int = 50,
    batch_size: int = 64,
    lr: float = 3e-3,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    on_check: Callable[[int, float, float], None] | None = None,
) -> tuple[list[float], float | None]:
    """AdamW on answer-token cross-entropy, batches drawn with a seeded RNG.

    With `target_accuracy`, every `check_every` steps the greedy exact-match on 200 training
    examples is measured and training stops once it reaches the target (a deliberately partial
    warm-up that leaves room for RL). Returns (loss per step, last measured accuracy). The model
    is left in eval mode.
    """
    if not examples or "answer" not in examples[0]:
        raise ValueError("supervised warm-up needs examples with 'prompt' and 'answer' columns")
    rng = random.Random(seed)
    probe = random.Random(seed + 1).sample(examples, min(200, len(examples)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses: list[float] = []
    accuracy = None
    model.train()
    for step in range(1, max_steps + 1):
        ids, mask, lab = _batch(tokenizer, rng.sample(examples, min(batch_size, len(examples))))
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        losses.append(float(loss.detach()))
        if target_accuracy is not None and step % check_every == 0:
            accuracy = greedy_exact_match(model, tokenizer, probe)
            if on_check is not None:
                on_check(step, losses[-1], accuracy)
            if accuracy >= target_accuracy:
                break
    model.eval()
    return losses, accuracy
