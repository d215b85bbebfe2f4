"""The records every package shares: Rollout, PolicyOutput, LossOutput.

Shapes use N = samples in the batch, T = action slots per sample (tokens for text; denoising steps
for flow models). A Rollout is the one record that flows from rollouts/ to objectives/ and train.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor


def select_rows(value: Any, idx: Tensor, n: int) -> Any:
    """Rows `idx` (Long[k]) of anything batched along its first axis of length n: a tensor [n, ...],
    a list / tuple of n items (-> list), and, recursively, a dict's values and a dataclass's fields.
    Anything else (a tensor or list of another length, a scalar, None) is returned as it is."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        return value[idx] if value.dim() > 0 and value.shape[0] == n else value
    if isinstance(value, list | tuple) and len(value) == n:
        return [value[i] for i in idx.tolist()]
    if isinstance(value, dict):
        return {k: select_rows(v, idx, n) for k, v in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        return replace(
            value, **{f.name: select_rows(getattr(value, f.name), idx, n) for f in fields(value)}
        )
    return value


@dataclass
class TokenBatch:
    """The text policy's payload: prompts (left padded) and completions (right padded).

    prompt_ids:      Long[N, P]   left padded with the tokenizer's pad id
    prompt_mask:     Bool[N, P]   True on real prompt tokens
    completion_ids:  Long[N, T]   right padded; T = longest completion in the batch
    completion_mask: Bool[N, T]   True on generated tokens (EOS included, padding excluded)
    truncated:       Bool[N]      True where generation hit max_new_tokens without stopping
    vision:          None for text; for a vision-language policy one dict per row of the vision
                     inputs of that row's prompt images (e.g. pixel_values, image_grid_thw), the
                     model's own tensors, concatenated along dim 0 over rows when batched. The G
                     rows of a group hold the SAME dict object, which is how scoring finds the
                     rows whose prompt and images it encodes once (policies/vision/).
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    truncated: Tensor
    vision: list[dict[str, Tensor]] | None = None

    @property
    def lengths(self) -> Tensor:  # Long[N]
        return self.completion_mask.sum(-1)

    @classmethod
    def cat(cls, parts: list[TokenBatch]) -> TokenBatch:
        """Join batches along N: prompts re-padded on the left, completions on the right.

        Pad slots get id 0; their masks are False, so the id never reaches a loss or an attention.
        """
        p = max(b.prompt_ids.shape[1] for b in parts)
        t = max(b.completion_ids.shape[1] for b in parts)
        left = [(p - b.prompt_ids.shape[1], 0) for b in parts]
        right = [(0, t - b.completion_ids.shape[1]) for b in parts]
        pad = torch.nn.functional.pad
        return cls(
            prompt_ids=torch.cat([pad(b.prompt_ids, s) for b, s in zip(parts, left)]),  # [N, P]
            prompt_mask=torch.cat([pad(b.prompt_mask, s) for b, s in zip(parts, left)]),
            completion_ids=torch.cat([pad(b.completion_ids, s) for b, s in zip(parts, right)]),
            completion_mask=torch.cat([pad(b.completion_mask, s) for b, s in zip(parts, right)]),
            truncated=torch.cat([b.truncated for b in parts]),  # [N]
            vision=_cat_vision([b.vision for b in parts]),
        )


def _cat_vision(parts: list[list[dict[str, Tensor]] | None]) -> list[dict[str, Tensor]] | None:
    """The rows' vision dicts of batches joined along N: all text (None) or all vision."""
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("TokenBatch.cat: batches with and without vision inputs")
    return [row for p in parts for row in p]


ROW_SAMPLED, ROW_HINTED, ROW_REPLAYED = 0, 1, 2  # Rollout.row_source values


@dataclass
class Rollout:
    """A batch of N sampled trajectories, grouped by `group_ids`.

    group_ids:    Long[N]           samples with the same id share a prompt / initial state
    rewards:      dict[str, Float[N]] one entry per reward function, unweighted; NaN = no reward
                                    (the function failed on that sample: excluded from statistics)
    actions:      policy payload    TokenBatch for text; latents for flow models
    old_logp:     Float[N, T]       log-prob of each action under the policy that sampled it
    mask:         Bool[N, T]        which action slots count in the loss
    engine_logp:  Float[N, T]|None  log-probs reported by the inference engine (mismatch correction);
                                    under bounded async the behaviour policy's log-prob per token
    token_version: Long[N, T]|None  the weight version that sampled each token (bounded async,
                                    partial rollouts: versions can change within a completion;
                                    -1 on slots no policy sampled); None: not tracked
    ref_logp:     Float[N, T]|None  log-probs under the frozen reference (filled when KL is on)
    teacher_logp: Float[N, T]|None  the distillation teacher's log-probs of the sampled tokens
                                    (filled when algorithm.distill is set with k1 / k3)
    advantages:   Float[N]|Float[N,T]|None  filled by train.py after scoring
    token_scales: Float[N, T]|None  per-token loss scales (lambda-GRPO, EGSW), detached
    seq_weights:  Float[N]|None     per-sequence loss weights (Delta-L), detached
    step_ids / step_rewards / anchor_keys: multi-turn extras (agents)
    examples:     list[dict]|None   the task example each sample was drawn for (the curriculum
                                    reads its source column)
    row_source:   Long[N]|None      where a row came from when rollout.hooks changed the batch:
                                    0 sampled, 1 re-sampled with a hint, 2 replayed from the buffer
                                    (ROW_SAMPLED / ROW_HINTED / ROW_REPLAYED)
    tree_path / tree_segment / generated: tree rollouts (rollouts/fork.py): Long[N, D+1] node ids
                                    along each row's path, Long[N, T] the depth of the segment
                                    holding each slot (-1 padding), Long[N] actions this row
                                    sampled itself (a shared segment counts once)
    info:         dict of per-sample lists for logs only (prompt text, completion text ...): the
                                    training loop never reads it
    """

    group_ids: Tensor
    rewards: dict[str, Tensor]
    actions: Any
    old_logp: Tensor
    mask: Tensor
    engine_logp: Tensor | None = None
    token_version: Tensor | None = None  # [N, T] int64
    ref_logp: Tensor | None = None
    teacher_logp: Tensor | None = None
    advantages: Tensor | None = None
    token_scales: Tensor | None = None
    seq_weights: Tensor | None = None
    step_ids: Tensor | None = None
    step_rewards: Tensor | None = None
    anchor_keys: list | None = None
    examples: list[dict] | None = None
    row_source: Tensor | None = None
    tree_path: Tensor | None = None
    tree_segment: Tensor | None = None
    generated: Tensor | None = None
    info: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.group_ids.shape[0])

    def select(self, idx: Tensor | list[int]) -> Rollout:
        """Rows `idx` of every batched field (used for minibatches and dynamic-sampling filters)."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        n = len(self)
        return Rollout(**{f.name: select_rows(getattr(self, f.name), idx, n) for f in fields(self)})


@dataclass
class PolicyOutput:
    """What `Policy.log_probs` returns for a minibatch of n samples.

    logp:    Float[n, T]   differentiable log-prob of each taken action
    entropy: Float[n, T]|None  entropy of the action distribution at each slot (detached is fine)
    extras:  modality-specific tensors (e.g. the Gaussian mean for flow policies)
    """

    logp: Tensor
    entropy: Tensor | None = None
    extras: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class LossOutput:
    """A scalar loss to back-propagate plus detached float metrics for logging."""

    loss: Tensor
    metrics: dict[str, float] = field(default_factory=dict)
