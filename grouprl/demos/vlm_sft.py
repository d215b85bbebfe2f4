"""Supervised fine-tuning of a vision-language model on (prompt with images, answer) examples.

What the VLM demo's warm-up and the shapes judge of the judged-images demo train with: next-token
cross-entropy on the answer tokens plus the end-of-turn token (prompt and image tokens are
context), prompts encoded once by the VLM policy's processor (chat template, image processor,
image tokens), AdamW, stopped early once a target share of probe examples is answered exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from grouprl.policies.vision.forward import prompt_positions, run
from grouprl.policies.vision.processing import VisionProcessor, cat_vision

Row = tuple[Any, list[int]]  # (the encoded prompt, answer ids + end of turn)


def encode(processor: VisionProcessor, examples: list[dict]) -> list[Row]:
    """(encoded prompt, answer ids + end of turn) per example, made once."""
    tok, out = processor.tokenizer, []
    for ex in examples:
        answer = tok(str(ex["answer"]), add_special_tokens=False).input_ids + [tok.eos_token_id]
        out.append((processor.encode(ex["prompt"]), answer))
    return out


def collate(rows: list[Row], pad: int) -> dict[str, Any]:
    """Right-padded [prompt | answer] rows, labels on the answer only, and under "vision" the
    vision inputs of every row's images concatenated in row order (the model's own batching)."""
    ids = [p.token_ids + a for p, a in rows]
    width = max(map(len, ids))
    batch = {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in ids]),  # [B, L]
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids]),
        "labels": torch.tensor(
            [
                [-100] * len(p.token_ids) + a + [-100] * (width - len(p.token_ids) - len(a))
                for p, a in rows
            ]
        ),  # fmt: skip  # [B, L]
    }
    batch["vision"] = cat_vision([p.vision for p, _ in rows])  # all rows' images, in order
    return batch


def logits_of(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Next-token logits [B, L, V] of a collated batch, with the positions the policy uses
    (policies/vision/forward.py: mrope from the model's own rope index, pads skipped)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions, _ = prompt_positions(model, ids, mask, batch["vision"])
    hidden = run(model, ids, mask, positions, None, batch["vision"])  # [B, L, H]
    return model.get_output_embeddings()(hidden)  # [B, L, V]


def answer_loss(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens (labels -100 elsewhere)."""
    logits = logits_of(model, batch)[:, :-1]  # [B, L-1, V]
    labels = batch["labels"][:, 1:]  # [B, L-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100
    )


@torch.no_grad()
def exact_match(model: Any, rows: list[Row], pad: int, batch_size: int = 100) -> float:
    """Share of rows whose answer + end of turn greedy decoding reproduces: teacher-forced, the
    argmax at every answer position is the answer's next token."""
    was_training = model.training
    model.eval()
    hits = 0.0
    for start in range(0, len(rows), batch_size):
        batch = collate(rows[start : start + batch_size], pad)
        labels = batch["labels"]
        pred = logits_of(model, batch)[:, :-1].argmax(-1)  # [B, L-1]
        target = labels[:, 1:]  # [B, L-1]
        hits += float(((pred == target) | (target == -100)).all(-1).float().sum())
    model.train(was_training)
    return hits / len(rows)


def fine_tune(
    model: Any,
    rows: list[Row],
    pad: int,
    *,
    max_steps: int,
    target_accuracy: float | None = None,
    check_every: int = 50,
    batch_size: int = 32,
    lr: float = 2e-3,
    seed: int = 0,
    on_check: Callable[[int, float, float], None] | None = None,
) -> tuple[int, float | None]:
    """AdamW on answer cross-entropy over seeded random batches; with target_accuracy, stop once
    exact_match on 200 probe rows reaches it. Returns (steps run, last probe accuracy); the model
    is left in eval mode."""
    rng = random.Random(seed)
    probe = random.Random(seed + 1).sample(rows, min(200, len(rows)))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    accuracy, step = None, 0
    for step in range(1, max_steps + 1):
        loss = answer_loss(model, collate(rng.sample(rows, min(batch_size, len(rows))), pad))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if target_accuracy is not None and step % check_every == 0:
            accuracy = exact_match(model, probe, pad)
            if on_check is not None:
                on_check(step, loss.item(), accuracy)
            if accuracy >= target_accuracy:
                break
    model.eval()
    return step, accuracy
