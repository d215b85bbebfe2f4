"""Bounded-staleness asynchronous training (train.async_mode = "bounded"), after AReaL
(arXiv 2505.24298): a producer samples continuously while the trainer updates.

    trainer (main thread):  | publish v=s, take batch s | prepare + update s | publish v=s+1, ...
    producer thread:        | sample batch j (weights: the newest published version), score,
                            |   put it in the queue; next j ... (at most async_prefetch ahead)

Versions: the weights the run starts (or resumes) with are version 0; the trainer publishes version
v = (step - first step) at the start of each step, i.e. after each update (+1 per weight push). The
producer holds a snapshot policy (a copy with its own engine, like one_step_off) and loads the
newest published weights before each batch (with rollout.engine vllm_server nothing is copied: the
trainer's weight push after each update reaches the server, which generates in its own process
while the trainer updates, and every completion carries the server's weight version), and,
with train.partial_chunk_tokens, before each chunk of tokens (partial rollouts, policies/text/engines/partial.py: unfinished completions continue with
the new weights; every token keeps the log-prob and version that sampled it,
Rollout.token_version [N, T], Rollout.engine_logp [N, T]). Without chunks a batch's tokens all carry
the version its generation started with.

Bound: the producer may start batch j only while j < (batches the trainer asked for) +
train.async_prefetch (default max_staleness): a batch is started at most that many versions before
the step that trains it, so no token is more than k = max_staleness versions stale, and with k = 0
the producer samples only on demand with the current weights: the synchronous run's samples,
through the same code. The trainer then checks each token's staleness (rollouts/staleness.py): a
sample beyond k is dropped (another batch is taken when a whole batch goes) or down-weighted
(per-token weights multiplied into rollout.token_scales after prepare). This only acts when
async_prefetch > max_staleness lets the producer run further ahead.

Decoupled PPO (AReaL, section 5): the behaviour policy is the sampling log-probs per token
(engine_logp, mixed versions under partial rollouts); the proximal policy is old_logp, scored by the
trainer at prepare time with its current weights (rollout.old_logp recompute; in a single pass the
update's own detached forward, the same weights); the PPO clip is around the proximal policy and
each token is weighted by pi_prox / pi_behav through algorithm.engine_correction
(objectives/correction.py, truncated or masked as configured): no new loss. With
rollout.old_logp engine the clip is around the behaviour policy instead (coupled PPO).
Deviations from AReaL: the producer is a thread of the trainer's process (its generation runs in
the vLLM server's process with vllm_server, else in the thread); the bound
is counted in batches (steps), not in samples; the importance weight follows
algorithm.engine_correction (truncated or masked as configured; refused when none with k >= 1 and
old_logp recompute, since the correction would be missing).

Refused (runtime.async_rollout.check_async and config checks): those of one_step_off, plus
async_worker process. A checkpoint stores the sampler as it was before the oldest batch not yet
trained (queued or in progress) was drawn, so a resumed run draws those batches again with the
resumed weights. Global seeding with k >= 1: both threads draw from torch's global RNG in an order
that varies; rollout.seeding per_sample is reproducible.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

from grouprl.rollouts.staleness import apply_bound
from grouprl.types import Rollout

POLL_S = 1.0  # how often a wait re-checks that the other side is alive


class ProducerStopped(Exception):
    """Raised inside the producer (between chunks) when the source closes."""


class BoundedAsync:
    """The rollout source of async_mode bounded (see module docstring). `make(index, snapshot)`
    samples and scores one batch; indices count on from the first step (as rollout_step's step)."""

    def __init__(self, cfg: Any, policy: Any, sampler: Any, make: Any) -> None:
        t = cfg.train
        self.make, self.sampler = make, sampler
        self.k, self.stale_policy, self.decay = t.max_staleness, t.stale_policy, t.stale_decay
        self.prefetch = t.max_staleness if t.async_prefetch is None else t.async_prefetch
        self.snapshot = policy.snapshot()  # a copy with its own engine
        # vllm_server: the trainer's push_weights sends each update to the server, which samples
        # in its own process; publishing is then only the version, and refresh loads nothing
        self.remote = bool(getattr(self.snapshot.engine, "remote", False))
        if t.partial_chunk_tokens is not None:
            if not hasattr(self.snapshot, "chunk_generation"):
                raise ValueError(
                    f"train.partial_chunk_tokens: {type(policy).__name__} cannot generate in "
                    "chunks; drop partial_chunk_tokens"
                )
            self.snapshot.chunk_generation(t.partial_chunk_tokens, self._refresh)
        self.cond = threading.Condition()
        self.published: tuple[int, dict] | None = None  # (version, weights) the newest
        self.loaded = -1  # the version in the snapshot
        self.first_step: int | None = None
        self.requests = 0  # batches the trainer asked for
        self.started = 0  # batches the producer started
        self.queue: deque = deque()  # finished: (rollout, metrics, version at start)
        self.in_flight: deque = deque()  # sampler states before each started, untaken batch
        self.error: BaseException | None = None
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.weights: tuple[Rollout, torch.Tensor] | None = None  # downweight: for after_prepare
        self.total = t.steps
        self.adapters_only = getattr(policy, "lora", None) is not None  # state_dict: LoRA only

    # ---- trainer side --------------------------------------------------------------------------

    def next(self, step: int, policy: Any) -> tuple[Rollout | None, dict]:
        first = self.first_step is None
        if first:
            self.first_step = step
        version = step - self.first_step
        self._publish(version, policy)
        if first:
            self.thread = threading.Thread(
                target=self._produce, name="grouprl-rollout", daemon=True
            )
            self.thread.start()
        start, dropped = time.perf_counter(), 0.0
        while True:
            rollout, metrics, _ = self._take()
            if rollout is None:  # dynamic sampling found no informative group
                break
            keep, weights, stats = apply_bound(
                rollout.token_version, rollout.mask, version, self.k, self.stale_policy, self.decay
            )
            dropped += stats.pop("async/dropped_samples")
            if not bool(keep.any()):
                continue  # every sample too old: the next batch
            if not bool(keep.all()):
                rollout = rollout.select(keep.nonzero().squeeze(1))
            if weights is not None:
                self.weights = (rollout, weights[keep])  # [n, T], applied after prepare
            metrics.update(stats)
            break
        metrics["async/dropped_samples"] = dropped
        metrics["async/weight_version"] = float(version)
        metrics["async/wait_s"] = time.perf_counter() - start
        return rollout, metrics

    def after_prepare(self, rollout: Rollout) -> None:
        """Down-weighting: multiply the per-token staleness weights into rollout.token_scales
        (prepare sets token_scales, so this runs after it)."""
        if self.weights is None or self.weights[0] is not rollout:
            return
        weights, self.weights = self.weights[1], None  # [N, T]
        scales = rollout.token_scales
        rollout.token_scales = weights if scales is None else scales * weights  # [N, T]

    def saved_sampler(self, sampler: Any) -> Any:
        """The sampler as a checkpoint must see it: before the oldest untaken batch was drawn."""
        with self.cond:
            if self.in_flight:
                return _FrozenState(self.in_flight[0])
            return _FrozenState(sampler.state_dict())  # the producer is idle: no draw under way

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=600)
            if self.thread.is_alive():
                raise RuntimeError(
                    "async bounded: the rollout producer did not stop within 600 s of the end "
                    "of training (a batch still generating or a reward hanging)"
                )

    def _publish(self, version: int, policy: Any) -> None:
        weights = None if self.remote else {
            k: v.detach().clone() for k, v in policy.state_dict().items()
        }  # fmt: skip
        with self.cond:
            self.published = (version, weights)
            self.cond.notify_all()

    def _take(self) -> tuple[Rollout | None, dict, int]:
        with self.cond:
            self.requests += 1
            self.cond.notify_all()
            while not self.queue:
                if self.error is not None:
                    raise RuntimeError("async bounded: the rollout producer failed") from self.error
                if self.thread is None or not self.thread.is_alive():
                    raise RuntimeError("async bounded: the rollout producer is not running")
                self.cond.wait(POLL_S)
            self.in_flight.popleft()
            return self.queue.popleft()

    # ---- producer side -------------------------------------------------------------------------

    def _produce(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.stopping and not self._may_start():
                        self.cond.wait(POLL_S)
                    if self.stopping:
                        return
                    index = self.started
                    self.started += 1
                    self.in_flight.append(self.sampler.state_dict())  # before this batch's draws
                version = self._refresh()
                rollout, metrics = self.make(self.first_step + index, self.snapshot)
                if rollout is not None and rollout.token_version is None:  # one version throughout
                    rollout.token_version = torch.full_like(rollout.mask, version, dtype=torch.long)
                with self.cond:
                    self.queue.append((rollout, metrics, version))
                    self.cond.notify_all()
        except ProducerStopped:
            return
        except BaseException as exc:  # noqa: BLE001 - raised in the trainer at its next take
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def _may_start(self) -> bool:
        """A batch the trainer asked for, or one of async_prefetch ahead within the run's steps."""
        ahead = self.started < self.requests + self.prefetch
        return self.started < self.requests or (
            ahead and self.first_step + self.started < self.total
        )

    def _refresh(self) -> int:
        """The newest published weights into the snapshot (producer thread); their version."""
        with self.cond:
            if self.stopping:
                raise ProducerStopped
            version, weights = self.published
        if version != self.loaded and not self.remote:
            load_into(self.snapshot, weights, self.adapters_only)
            self.loaded = version
        return version


@torch.no_grad()
def load_into(snapshot: Any, weights: dict, adapters_only: bool) -> None:
    """Published weights (all, or the LoRA adapters) into the snapshot's model and its engine."""
    missing, unexpected = snapshot.model.load_state_dict(weights, strict=False)
    if unexpected or (missing and not adapters_only):
        raise RuntimeError(
            f"async bounded: snapshot weights do not match: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    engine = getattr(snapshot, "engine", None)
    if engine is not None:
        engine.load_weights(snapshot.model)  # in-process engines: a no-op (they run the model)


class _FrozenState:
    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state
