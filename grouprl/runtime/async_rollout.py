"""One-step-off-policy training (train.async_mode = "one_step_off"): generation of step k+1
overlaps the update of step k.

    main thread:    | update k (batch k)          | update k+1 (batch k+1)      | ...
    worker thread:  | sample + score batch k+1    | sample + score batch k+2    | ...
                    |   with weights theta_k      |   with weights theta_k+1    |

The same scheme as verl's one-step-off-policy recipe, with the bounded staleness of asynchronous RL
systems such as AReaL (arXiv 2505.24298) fixed to one step. A background thread owns a snapshot
policy: a copy of the model with its own HF engine and tokenizer copy. At the start of step k the
main thread takes batch k (waiting for the worker if it is not done), copies its current weights
theta_k into the snapshot and hands batch k+1 to the worker; update k then runs while the worker
samples. Batch k+1 is sampled by theta_k and trained at step k+1 from theta_k+1: one step stale.
With train.async_staleness 0 the worker is handed a batch only when it is needed, with the current
weights: the synchronous loop's samples, through the same code (a check of the machinery).

Importance correction: the ratio pi_theta / pi_old needs pi_old = the weights that sampled. The
worker scores every batch it sampled with the snapshot (rollout.old_logp "recompute": log-probs of
theta_k under the trainer's numerics; "engine": the engine's own log-probs are used instead), so the
clipped ratio corrects the one step of staleness, and algorithm.engine_correction still corrects
engine-vs-trainer numerics (old_logp vs engine_logp) on top. So prepare() must not recompute
old_logp with the current weights, and update() must not take its single-pass shortcut (old = the
current weights' detached log-probs): both read rollouts/batching.py (`recompute_old`,
`single_pass`), which check async_mode.

The worker (train.async_worker) is a thread of the trainer's process, or a forked process
(async_worker.py: CPU only; for machines where two threads of one process do not compute in
parallel, e.g. this repository's test machine, see benchmarks/README.md). The worker alone uses
the snapshot, its engine and tokenizer; the trainer copies weights in only while it is idle. The
prompt sampler is drawn from by the worker only; a checkpoint stores its state from before the
in-flight batch was drawn (`saved_sampler`), so a resumed run draws that batch again (sampled with
the resumed weights). Rewards run in the worker (math-verify has no signal-based time limit off
the main thread: use rewards[i].timeout_s). With rollout.seeding per_sample the worker never
touches torch's global RNG and runs reproduce; with global seeding at staleness 1 both threads
draw from the global RNG in an order that varies.

Memory: one extra copy of the model. Refused, with a message: several processes (the worker's
gathers would interleave with the trainer's collectives), rollout.engine vllm (its weights are
pushed and it evaluates from the main thread), the DUMP curriculum and rollout.budget (the
trainer updates its sampler while the worker draws from it); workloads without the async_rollouts capability (agents,
images) are refused by workloads/base.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from grouprl.runtime.checkpoint import capture_rng, restore_rng
from grouprl.types import Rollout

Make = Callable[[int, Any], tuple[Rollout | None, dict]]  # (step index, policy) -> batch, metrics


def check_async(cfg: Any, world: int) -> None:
    """Fail at start for combinations one_step_off does not support (see module docstring)."""
    if cfg.train.async_mode == "off":
        return
    refusals = {
        "several processes (accelerate launch)": world > 1,
        "rollout.engine 'vllm' (use vllm_server)": cfg.rollout.engine == "vllm",
        "rollout.engine 'vllm_server' with one_step_off (use async_mode bounded, max_staleness 1)": (
            cfg.rollout.engine == "vllm_server" and cfg.train.async_mode == "one_step_off"
        ),
        "curriculum.type 'dump'": cfg.curriculum.type != "none",
        "rollout.budget": cfg.rollout.budget.type != "none",
    }
    if cfg.train.async_mode == "bounded":
        refusals["train.async_worker 'process' (bounded runs its producer in a thread)"] = (
            cfg.train.async_worker == "process"
        )
    elif getattr(cfg.train, "async_worker", "thread") == "process":
        cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
        refusals["async_worker 'process' on CUDA (a CUDA context does not survive a fork)"] = cuda
        refusals["async_worker 'process' with rewards[i].timeout_s (their worker pools belong to "
                 "the parent)"] = any(r.timeout_s is not None for r in cfg.rewards)  # fmt: skip
    bad = [name for name, hit in refusals.items() if hit]
    if bad:
        raise ValueError(
            f"train.async_mode={cfg.train.async_mode!r} does not support {', '.join(bad)}; "
            "use train.async_mode=off for this run"
        )


class SyncRollouts:
    """The synchronous loop: each step's batch is sampled with the current weights, when needed."""

    def __init__(self, make: Make) -> None:
        self.make = make

    def next(self, step: int, policy: Any) -> tuple[Rollout | None, dict]:
        return self.make(step, policy)

    def saved_sampler(self, sampler: Any) -> Any:
        return sampler

    def after_prepare(self, rollout: Rollout) -> None:
        pass

    def close(self) -> None:
        pass


class OneStepOff:
    """The background rollout worker (see module docstring). `make(step, snapshot)` samples and
    scores one step's batch; steps are 0-based, as in rollouts.step.rollout_step."""

    def __init__(self, cfg: Any, policy: Any, sampler: Any, make: Make) -> None:
        self.make, self.sampler = make, sampler
        self.staleness, self.total = cfg.train.async_staleness, cfg.train.steps
        self.recompute = cfg.rollout.old_logp == "recompute"
        self.temperature = cfg.rollout.temperature
        self.snapshot = policy.snapshot()  # a copy with its own engine
        self.process = getattr(cfg.train, "async_worker", "thread") == "process"
        if self.process:  # async_worker.py: a forked child reads the weights from shared memory
            from grouprl.runtime.async_worker import ProcessRunner

            self.snapshot.model.share_memory()
            self.pool = ProcessRunner(self._child_work)
        else:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grouprl-rollout")
        self.pending: tuple[int, Any] | None = None
        self.sampler_state = sampler.state_dict()

    def next(self, step: int, policy: Any) -> tuple[Rollout | None, dict]:
        if self.pending is None:  # staleness 0, or the first step (or the first after a resume)
            self._launch(step, policy)
        launched, future = self.pending
        if launched != step:
            raise RuntimeError(f"async rollouts: batch {launched} in flight, step {step} asked")
        start = time.perf_counter()
        result = future.result()  # the worker's exception, if any, is raised here
        self.pending = None
        if self.process:  # the child drew from its copy of the sampler: mirror its position
            result, sampler_state, rng = result
            self.sampler.load_state_dict(sampler_state)
            if self.staleness == 0:  # sequential: as if this process had sampled
                restore_rng(rng)
        rollout, metrics = result
        metrics["async/wait_s"] = time.perf_counter() - start
        if self.staleness == 1 and step + 1 < self.total:
            self._launch(step + 1, policy)  # overlaps this step's update
        return rollout, metrics

    def after_prepare(self, rollout: Rollout) -> None:
        pass

    def saved_sampler(self, sampler: Any) -> Any:
        """The sampler as a checkpoint must see it: before the in-flight batch was drawn."""
        return _FrozenState(self.sampler_state) if self.pending is not None else sampler

    def close(self) -> None:
        if self.pending is not None and not self.pending[1].cancel():
            try:  # let the worker finish its batch, unused
                self.pending[1].result()
            except Exception:  # noqa: BLE001 - the run is over; its error no longer matters
                pass
        self.pool.shutdown(wait=True)

    def _launch(self, step: int, policy: Any) -> None:
        self.sampler_state = self.sampler.state_dict()  # the worker is idle: no race
        copy_weights(policy, self.snapshot)
        if self.process:
            self.pending = (step, self.pool.submit(step, capture_rng()))
        else:
            self.pending = (step, self.pool.submit(self._work, step))

    def _child_work(self, step: int, rng: dict) -> tuple:
        """In the worker process: the batch, then the sampler's position and the RNG state."""
        restore_rng(rng)
        return self._work(step), self.sampler.state_dict(), capture_rng()

    def _work(self, step: int) -> tuple[Rollout | None, dict]:
        start = time.perf_counter()
        rollout, metrics = self.make(step, self.snapshot)
        if rollout is not None and self.recompute:  # pi_old: the weights that sampled
            with torch.no_grad():
                out = self.snapshot.log_probs(
                    rollout.actions, temperature=self.temperature, with_entropy=False
                )
            rollout.old_logp = out.logp  # [N, T]
        metrics["async/rollout_s"] = time.perf_counter() - start
        return rollout, metrics


def rollout_source(cfg: Any, policy: Any, sampler: Any, make: Make, world: int = 1) -> Any:
    """SyncRollouts, OneStepOff under train.async_mode one_step_off, BoundedAsync under bounded."""
    check_async(cfg, world)
    if cfg.train.async_mode == "off":
        return SyncRollouts(make)
    if cfg.train.async_mode == "bounded":
        from grouprl.runtime.bounded_async import BoundedAsync

        return BoundedAsync(cfg, policy, sampler, make)
    return OneStepOff(cfg, policy, sampler, make)


@torch.no_grad()
def copy_weights(policy: Any, snapshot: Any) -> None:
    """The trainer's current weights into the snapshot (all of them, or the LoRA adapters)."""
    missing, unexpected = snapshot.model.load_state_dict(policy.state_dict(), strict=False)
    if unexpected or (policy.lora is None and missing):
        raise RuntimeError(
            f"async rollouts: snapshot weights do not match: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )


class _FrozenState:
    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state
