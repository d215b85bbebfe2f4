"""The prompt-length guard: rollout.max_prompt_tokens and rollout.prompt_overflow.

A prompt longer than the limit crashed a vLLM run whenever its row was drawn (vLLM refuses a
prompt over max_model_len) and went past the model's context without a word on the other engines.
The guard runs once, before training, on every train and eval example, for every engine:

  limit = min(rollout.max_prompt_tokens, context - rollout.max_new_tokens)
  context = the model config's max_position_embeddings (n_positions for GPT-2), and
            rollout.vllm.max_model_len when it is set for the vllm engine.

prompt_overflow:
  filter    over-long examples are dropped, with one warning giving the count (the default);
            no example left is an error.
  truncate  prompts keep their LAST `limit` tokens (left truncation, as TRL's
            max_prompt_length): the policy's encode_prompts truncates; the count is warned.
  error     the first over-long example is an error naming its split and row.
Single-turn text tasks only: an agent's prompt grows turn by turn (agent.max_total_tokens bounds
it) and image prompts go to a text encoder with its own limit, so max_prompt_tokens set there is
an error.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

PromptOverflow = Literal["filter", "truncate", "error"]
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def model_context(policy: Any) -> int | None:
    """The model's context length from its config, or None when the config states none."""
    config = getattr(getattr(policy, "model", None), "config", None)
    for field in _CONTEXT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def prompt_limit(cfg: Any, policy: Any) -> tuple[int | None, str]:
    """(limit in tokens or None, how it was derived) for this config and policy."""
    r = cfg.rollout
    context, source = model_context(policy), "the model config's context"
    vllm_len = getattr(getattr(r, "vllm", None), "max_model_len", None)
    if r.engine == "vllm" and vllm_len is not None and (context is None or vllm_len < context):
        context, source = vllm_len, "rollout.vllm.max_model_len"
    candidates = []
    if r.max_prompt_tokens is not None:
        candidates.append((r.max_prompt_tokens, f"rollout.max_prompt_tokens={r.max_prompt_tokens}"))
    if context is not None:
        room = context - r.max_new_tokens
        if room < 1:
            raise ValueError(
                f"rollout.max_new_tokens={r.max_new_tokens} leaves no room for a prompt in "
                f"{source} ({context} tokens)"
            )
        candidates.append((room, f"{source} {context} - max_new_tokens {r.max_new_tokens}"))
    if not candidates:
        return None, "no limit"
    return min(candidates)


def guard_prompts(
    examples: list[dict], encode: Any, limit: int | None, overflow: PromptOverflow, split: str,
    why: str,
) -> tuple[list[dict], int]:  # fmt: skip
    """(examples kept, number over the limit). encode: prompts -> token ids (the policy's)."""
    if overflow not in ("filter", "truncate", "error"):
        raise ValueError(f"rollout.prompt_overflow={overflow!r}; allowed: filter, truncate, error")
    if limit is None or not examples:
        return examples, 0
    lengths = [len(ids) for ids in encode([ex["prompt"] for ex in examples])]
    over = [i for i, n in enumerate(lengths) if n > limit]
    if not over:
        return examples, 0
    first = over[0]
    if overflow == "error":
        raise ValueError(
            f"{split} example {first} (row {first} of the task's {split} split) has a prompt of "
            f"{lengths[first]} tokens, over the limit of {limit} ({why}); {len(over)} of "
            f"{len(examples)} {split} prompts are over it. Set rollout.prompt_overflow to "
            "'filter' or 'truncate', or raise the limit"
        )
    if overflow == "truncate":
        warnings.warn(
            f"{len(over)} of {len(examples)} {split} prompts are longer than {limit} tokens "
            f"({why}); they are truncated from the left (rollout.prompt_overflow='truncate')",
            stacklevel=2,
        )
        return examples, len(over)
    kept = [ex for ex, n in zip(examples, lengths) if n <= limit]
    warnings.warn(
        f"{len(over)} of {len(examples)} {split} prompts are longer than {limit} tokens ({why}) "
        f"and are left out, e.g. row {first} ({lengths[first]} tokens) "
        "(rollout.prompt_overflow='filter')",
        stacklevel=2,
    )
    if not kept and split == "train":
        raise ValueError(
            f"every train prompt is longer than {limit} tokens ({why}): nothing left to train on"
        )
    return kept, len(over)


def apply_prompt_guard(
    cfg: Any, policy: Any, train: list[dict], evaluation: list[dict]
) -> tuple[list[dict], list[dict]]:
    """The guard as train.py runs it for single-turn text (workloads with the prompt_guard
    capability): returns (train, eval) examples; in truncate mode the policy's
    `prompt_token_limit` is set so that its encode_prompts truncates from the left."""
    r = cfg.rollout
    limit, why = prompt_limit(cfg, policy)
    train, _ = guard_prompts(train, policy.encode_prompts, limit, r.prompt_overflow, "train", why)
    evaluation, _ = guard_prompts(
        evaluation, policy.encode_prompts, limit, r.prompt_overflow, "eval", why
    )
    if r.prompt_overflow == "truncate" and limit is not None:
        policy.prompt_token_limit = limit
    return train, evaluation
