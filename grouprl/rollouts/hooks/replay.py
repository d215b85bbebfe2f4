"""The `replay` rollout hook: past successes of a prompt fill its all-fail groups.

Sources:
- RePO, "Replay-Enhanced Policy Optimization" (arXiv 2506.09340): a replay buffer of earlier
  outputs per prompt, retrieved by replay strategies (recency, reward) and trained beside the
  on-policy samples.
- AR3PO (arXiv 2509.25808), response reuse: when the new rollouts of a prompt are all wrong, a
  previously generated correct response of it is put into the group, which gives the group a
  non-zero advantage.

What it does, per sampling round: (1) in every all-fail group whose prompt has stored successes,
the last min(per_group, stored, G - 1) rows are replaced by the newest successes (G - 1 at most,
so the group keeps a failing sample and a contrast); (2) the round's sampled rows that pass
(combined reward >= success_threshold) are stored with their token ids, their sampling log-probs
(`engine_logp`: the behaviour policy), their rewards and the step. A replayed row keeps its
stored log-probs as `engine_logp`; the trainer scores it with the current weights as pi_old
(rollout.old_logp recompute, or the update's own forward) and `algorithm.engine_correction`
reweights each token by pi_old / pi_behaviour (truncated or masked importance sampling;
config/checks.py requires one).

Buffer: `per_prompt` successes per prompt (a full slot evicts the `oldest`, or the
`lowest_reward` one, to take a new one; an identical completion is stored once, refreshed),
`capacity` prompts (the least recently seen prompt leaves first), successes older than `max_age`
steps are no longer used and are dropped. The buffer is checkpointed as plain JSON values (token
ids, float log-probs, rewards, steps) and restored exactly.

Deviations: RePO adds G_off replayed samples to every group with a separate advantage
normalisation; here replayed rows replace rows of all-fail groups only and share the group's
advantage (AR3PO's reuse), so a group is never larger than sampled. Rewards are not recomputed
for replayed rows (the stored values are used: verifiable rewards do not change).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from grouprl.rollouts.filters import combined_reward, failed_groups, splice_rows
from grouprl.types import ROW_REPLAYED, ROW_SAMPLED, Rollout, TokenBatch


class ReplayHook:
    """See the module docstring; cfg: a ReplayHookConfig (grouprl/config/hooks.py)."""

    type = "replay"

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.buffer: OrderedDict[str, list[dict]] = OrderedDict()  # prompt key -> successes
        self._counts = {"groups": 0.0, "rows": 0.0, "stored": 0.0}

    def key(self, example: dict) -> str:
        column = self.cfg.key_column
        if column is None:
            prompt = example["prompt"]
            return prompt if isinstance(prompt, str) else repr(prompt)
        if column not in example:
            raise ValueError(
                f"rollout.hooks replay: key_column {column!r} is not a column of the task's "
                f"examples (they have {sorted(example)})"
            )
        return str(example[column])

    # ---- the buffer ------------------------------------------------------------------------

    def live(self, key: str, step: int) -> list[dict]:
        """The usable successes of a prompt, newest first (expired ones are dropped)."""
        entries = self.buffer.get(key, [])
        if self.cfg.max_age is not None:
            entries = [e for e in entries if step - e["step"] <= self.cfg.max_age]
            if entries:
                self.buffer[key] = entries
            else:
                self.buffer.pop(key, None)
        return sorted(entries, key=lambda e: -e["step"])

    def store(self, key: str, entry: dict) -> None:
        entries = [e for e in self.buffer.pop(key, []) if e["ids"] != entry["ids"]]
        entries.append(entry)
        if len(entries) > self.cfg.per_prompt:
            if self.cfg.eviction == "oldest":
                worst = min(range(len(entries)), key=lambda i: entries[i]["step"])
            else:  # lowest_reward; ties: the oldest of them
                worst = min(range(len(entries)),
                            key=lambda i: (entries[i]["reward"], entries[i]["step"]))  # fmt: skip
            entries.pop(worst)
        self.buffer[key] = entries  # most recently seen prompt last
        while len(self.buffer) > self.cfg.capacity:
            self.buffer.popitem(last=False)

    # ---- one sampling round ----------------------------------------------------------------

    def apply(self, rollout: Rollout, ctx: Any) -> Rollout:
        c = self.cfg
        reward = combined_reward(rollout.rewards, ctx.weights)  # [N]
        keep = torch.ones(len(rollout), dtype=torch.bool)  # [N]
        replayed: list[tuple[int, int, dict]] = []  # (group id, row of its prompt, entry)
        for g in failed_groups(reward, rollout.group_ids, c.success_threshold):
            rows = (rollout.group_ids == g).nonzero().squeeze(1)  # [G]
            entries = self.live(self.key(rollout.examples[int(rows[0])]), ctx.step)
            n = min(c.per_group, len(entries), len(rows) - 1)
            if n <= 0:
                continue
            keep[rows[len(rows) - n :]] = False
            replayed += [(g, int(rows[0]), e) for e in entries[:n]]
            self._counts["groups"] += 1
        self._store_successes(rollout, reward, ctx.step)
        if not replayed:
            return rollout
        self._counts["rows"] += len(replayed)
        return splice_rows(rollout, keep, self._rows(rollout, replayed))

    def _store_successes(self, rollout: Rollout, reward: torch.Tensor, step: int) -> None:
        """Keep the round's passing sampled rows (replayed / hinted rows are not the policy's
        own samples in the prompt's context)."""
        sampled = rollout.row_source == ROW_SAMPLED  # [N]
        passed = (reward >= self.cfg.success_threshold) & sampled  # [N]
        mask, behaviour = rollout.mask, rollout.engine_logp  # [N, T]
        if behaviour is None:
            raise ValueError("rollout.hooks replay needs the sampling log-probs (engine_logp)")
        ids = rollout.actions.completion_ids  # [N, T]
        for i in passed.nonzero().squeeze(1).tolist():
            length = int(rollout.actions.completion_mask[i].sum())
            self.store(self.key(rollout.examples[i]), {
                "ids": ids[i, :length].tolist(),
                "logp": behaviour[i, :length].tolist(),
                "mask": mask[i, :length].tolist(),
                "rewards": {k: _finite_or_none(float(v[i])) for k, v in rollout.rewards.items()},
                "reward": float(reward[i]),
                "text": rollout.info["completion"][i],
                "truncated": bool(rollout.actions.truncated[i]),
                "step": step,
            })  # fmt: skip
            self._counts["stored"] += 1

    def _rows(self, rollout: Rollout, replayed: list[tuple[int, int, dict]]) -> Rollout:
        """The replayed rows as a Rollout: each with its group's prompt (a row of the group in
        the batch) and the stored completion, log-probs and rewards."""
        src = torch.tensor([r for _, r, _ in replayed], dtype=torch.long)  # [n]
        entries = [e for _, _, e in replayed]
        batch = rollout.actions
        ids = _right_pad([torch.tensor(e["ids"], dtype=torch.long) for e in entries], 0)  # [n, T]
        attend = _right_pad([torch.ones(len(e["ids"]), dtype=torch.bool) for e in entries], 0)
        mask = _right_pad([torch.tensor(e["mask"], dtype=torch.bool) for e in entries], 0)
        logp = _right_pad([torch.tensor(e["logp"], dtype=torch.float32) for e in entries], 0.0)
        n = len(entries)
        rewards = {k: torch.tensor([_nan_for_none(e["rewards"].get(k)) for e in entries],
                                   dtype=v.dtype) for k, v in rollout.rewards.items()}  # fmt: skip
        info = {k: [None] * n for k in rollout.info}
        info["prompt"] = [rollout.info["prompt"][int(i)] for i in src]
        info["completion"] = [e["text"] for e in entries]
        info["completion_ids"] = [list(e["ids"]) for e in entries]
        return Rollout(
            group_ids=torch.tensor([g for g, _, _ in replayed], dtype=torch.long),  # [n]
            rewards=rewards,
            actions=TokenBatch(
                prompt_ids=batch.prompt_ids[src],  # [n, P]
                prompt_mask=batch.prompt_mask[src],
                completion_ids=ids,
                completion_mask=attend,
                truncated=torch.tensor([e["truncated"] for e in entries]),  # [n]
                vision=None if batch.vision is None else [batch.vision[int(i)] for i in src],
            ),
            old_logp=logp.clone(),  # [n, T]; the trainer's recompute replaces it
            mask=mask,  # [n, T]
            engine_logp=logp,  # [n, T] the behaviour policy's log-probs
            examples=[rollout.examples[int(i)] for i in src],
            row_source=torch.full((n,), ROW_REPLAYED, dtype=torch.long),  # [n]
            info=info,
        )

    # ---- metrics and state -----------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        out = dict(self._counts)
        out["buffer_prompts"] = float(len(self.buffer))
        out["buffer_successes"] = float(sum(len(v) for v in self.buffer.values()))
        self._counts = dict.fromkeys(self._counts, 0.0)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The buffer in least-recently-seen order: [[key, [entry, ...]], ...] (JSON values)."""
        return {"buffer": [[k, [dict(e) for e in v]] for k, v in self.buffer.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = OrderedDict((k, [dict(e) for e in v]) for k, v in state["buffer"])


def _right_pad(rows: list[torch.Tensor], value: float) -> torch.Tensor:
    return pad_sequence(rows, batch_first=True, padding_value=value)


def _finite_or_none(x: float) -> float | None:
    return None if math.isnan(x) else x  # JSON has no NaN


def _nan_for_none(x: float | None) -> float:
    return math.nan if x is None else x
