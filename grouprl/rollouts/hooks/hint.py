"""The `hint` rollout hook: an all-fail group is sampled again with a hint.

Sources:
- NuRL, "Nudging the Boundaries of LLM Reasoning" (arXiv 2509.25666): when all G rollouts of a
  problem fail, G - 1 of them are regenerated with a hint injected into the prompt, and the policy
  is trained on the hinted prompts as sampled. Here: `keep_sampled` (default 1) rows stay as
  sampled, the other G - keep_sampled are regenerated; `text: column` uses a prepared hint column.
- GHPO (arXiv 2507.10628): the hint is a part of the ground-truth solution whose share the
  difficulty decides. Here: `text: solution_prefix`, the first ceil(f * n) words (or characters)
  of the solution, f annealed linearly from start_fraction to end_fraction over anneal_steps
  (a schedule, where GHPO raises the share in stages as the problem keeps failing).
- `where: response`: the hint is the forced start of the completion (prefix-guided sampling, as
  in the prefix-RFT family): the policy continues the reference solution; the forced tokens are
  scored as context but masked out of the loss (CausalLMPolicy.sample), so every trained token
  is an action of the policy in the context it was sampled in and no correction is needed.

Importance correction for the changed context: with `where: prompt, context: hinted` (NuRL,
GHPO) the rows are trained on the hinted prompt they were sampled from: on-policy, no correction.
`context: original` trains them on the original prompt instead: the sampling log-probs (under the
hinted prompt) stay in `engine_logp` as the behaviour policy and every token is reweighted by
pi_old(y_t | x) / pi_behaviour(y_t | x, hint) with `algorithm.engine_correction` (config/checks.py
refuses it without one): truncated importance sampling as for an inference engine, which neither
paper defines (our deviation, for users who want no hint in the trained context).
Deviations: the hinted rows are scored with the run's reward functions like any other (the hint's
tokens count for the reward, e.g. an answer given away in a response prefix scores); a hint that
is empty at the current fraction (f = 0, or an empty column) leaves the group as it is.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

import torch

from grouprl.rollouts.filters import cat_rollouts, combined_reward, failed_groups, splice_rows
from grouprl.types import ROW_HINTED, Rollout


class HintHook:
    """See the module docstring; cfg: a HintHookConfig (grouprl/config/hooks.py)."""

    type = "hint"

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self._counts = {"groups": 0.0, "rows": 0.0, "passed_rows": 0.0, "rescued_groups": 0.0}
        self._fraction = float("nan")

    def fraction(self, step: int) -> float:
        """The share of the solution given at `step` (linear anneal, then constant)."""
        c = self.cfg
        t = min(step / c.anneal_steps, 1.0)
        return c.start_fraction + (c.end_fraction - c.start_fraction) * t

    def hint_for(self, example: dict, step: int) -> str:
        """The hint text for one example at `step` ("" for none)."""
        c = self.cfg
        if c.column not in example:
            raise ValueError(
                f"rollout.hooks hint reads column {c.column!r}, which the task's examples do not "
                f"have (they have {sorted(example)}); set rollout.hooks[].column"
            )
        text = str(example[c.column])
        if c.text == "column":
            return text
        return solution_prefix(text, self.fraction(step), c.unit)

    def apply(self, rollout: Rollout, ctx: Any) -> Rollout:
        c = self.cfg
        self._fraction = self.fraction(ctx.step) if c.text == "solution_prefix" else 1.0
        reward = combined_reward(rollout.rewards, ctx.weights)  # [N]
        failed, examples, hints, keep = [], [], [], torch.ones(len(rollout), dtype=torch.bool)
        for g in failed_groups(reward, rollout.group_ids, c.success_threshold):
            rows = (rollout.group_ids == g).nonzero().squeeze(1)  # [G] this group's rows
            if len(rows) <= c.keep_sampled:
                continue  # nothing left to re-sample
            example = rollout.examples[int(rows[0])]
            hint = self.hint_for(example, ctx.step)
            if not hint.strip():
                continue
            failed.append((g, rows))
            keep[rows[c.keep_sampled :]] = False
            examples.append(self._hinted_example(example, hint))
            hints.append(hint)
        if not failed:
            return rollout
        sizes = {len(rows) - c.keep_sampled for _, rows in failed}
        parts = []
        for size in sorted(sizes):  # groups of equal size are sampled in one call
            which = [i for i, (_, rows) in enumerate(failed) if len(rows) - c.keep_sampled == size]
            prefixes = [hints[i] for i in which] if c.where == "response" else None
            part = ctx.resample([examples[i] for i in which], prefixes, size)
            parts.append(self._as_group_rows(part, rollout, [failed[i] for i in which]))
        extra = cat_rollouts(parts)
        self._count(extra, ctx.weights, len(failed))
        return splice_rows(rollout, keep, extra)

    def _hinted_example(self, example: dict, hint: str) -> dict:
        """The example to sample from: a prompt hint is appended to its prompt; a response hint
        leaves it as it is (the hint is forced as the completion's start)."""
        if self.cfg.where == "response":
            return example
        return {**example, "prompt": with_prompt_hint(example["prompt"], hint, self.cfg.template)}

    def _as_group_rows(self, part: Rollout, rollout: Rollout, failed: list) -> Rollout:
        """The re-sampled rows under their failed groups' ids, marked hinted; context original:
        with the groups' original prompts (the hinted sampling log-probs stay in engine_logp)."""
        _, index = torch.unique_consecutive(part.group_ids, return_inverse=True)  # [n] group k
        ids = torch.tensor([g for g, _ in failed], dtype=torch.long)  # [k]
        firsts = torch.tensor([int(rows[0]) for _, rows in failed], dtype=torch.long)  # [k]
        part.group_ids = ids[index]  # [n]
        part.row_source = torch.full((len(part),), ROW_HINTED, dtype=torch.long)  # [n]
        if self.cfg.where == "prompt" and self.cfg.context == "original":
            src = firsts[index]  # [n] a row of the same group in the batch: its original prompt
            batch = rollout.actions
            part.actions = replace(part.actions, prompt_ids=batch.prompt_ids[src],
                                   prompt_mask=batch.prompt_mask[src])  # fmt: skip  # [n, P]
            part.examples = [rollout.examples[int(i)] for i in src]
            part.info["prompt"] = [rollout.info["prompt"][int(i)] for i in src]
        return part

    def _count(self, extra: Rollout, weights: dict[str, float], groups: int) -> None:
        passed = combined_reward(extra.rewards, weights) >= self.cfg.success_threshold  # [n]
        self._counts["groups"] += groups
        self._counts["rows"] += len(extra)
        self._counts["passed_rows"] += float(passed.sum())
        rescued = torch.unique(extra.group_ids[passed])
        self._counts["rescued_groups"] += float(rescued.numel())

    def metrics(self) -> dict[str, float]:
        out = dict(self._counts)
        out["fraction"] = self._fraction
        self._counts = dict.fromkeys(self._counts, 0.0)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}  # the schedule is a function of the step

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def solution_prefix(text: str, fraction: float, unit: str) -> str:
    """The first ceil(fraction * n) units of `text` (words keep their following whitespace, so
    the prefix reads as the solution does); "" for fraction 0.

    >>> solution_prefix("so x = 4 and y = 2", 0.25, "words")
    'so x '
    >>> solution_prefix("82", 0.5, "characters")
    '8'
    """
    if fraction <= 0 or not text:
        return ""
    units = list(text) if unit == "characters" else re.findall(r"\S+\s*", text)
    n = min(len(units), math.ceil(fraction * len(units) - 1e-9))  # 1e-9: 0.5 * 4 is 2, not 3
    return "".join(units[:n])


def with_prompt_hint(prompt: Any, hint: str, template: str) -> Any:
    """`prompt` with template.format(hint=...) appended: to the text of a plain prompt, or to the
    last user message of a conversation (a copy; the example's own prompt is left as it is)."""
    added = template.format(hint=hint.strip())
    if isinstance(prompt, str):
        return prompt + added
    messages = [dict(m) for m in prompt]
    last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last is None:
        raise ValueError("rollout.hooks hint: a conversational prompt without a user message")
    content = messages[last]["content"]
    if isinstance(content, str):
        messages[last]["content"] = content + added
    else:  # a list of typed parts (images ...): the hint is one more text part
        messages[last]["content"] = [*content, {"type": "text", "text": added}]
    return messages
