"""Several processes through accelerate: `accelerate launch [--config_file configs/accelerate/X.yaml]
-m grouprl train CONFIG ...` (the DDP / FSDP2 / DeepSpeed wrapping: backends.py). A plain
`grouprl train` is one process and uses `SINGLE`, whose methods are the single-process code paths.

Where groups live: placed per process, then the scored batch is gathered. Every process holds the
same prompt sampler (same seed, same state), so all draw the same prompts; process r generates and
scores a contiguous block of whole groups (generation, the costly part, is split), then the scored
rollouts are all-gathered (token ids, log-probs, rewards: small next to generating them). We gather
the whole scored batch rather than only the rewards because then every decision that looks at the
batch (group and batch-whitened advantages, DAPO dynamic sampling, the DUMP curriculum, StarPO-S,
reward metrics) runs the single-process code on identical data on every process, the samplers stay
in lockstep (so the main process's checkpoint is everyone's), and no other step needs a collective.

Forward passes are split, never duplicated:
- prepare()'s no-grad scoring (old / reference log-probs) goes through `ScoreView`: each process
  scores an equal share of rows, the results are all-gathered.
- update(): every process makes the same global minibatch split (the global RNG is identical on all
  processes: see below), then takes a contiguous share of each minibatch's units (samples, or whole
  groups for group losses). The loss normalisers are the counts of the global minibatch, so each
  process's loss is its share of the one-process loss; DDP (and FSDP2 / DeepSpeed) average
  gradients over processes, so `backward` multiplies the loss by the process count: the gradient
  is then the one-process gradient, and 2 processes x half a batch == 1 process x the whole batch.
- All processes run the same number of forward/backward passes per update (DDP / FSDP collectives
  must pair up): a process short of units runs a zero-weight padding micro-batch (a real row, loss
  x 0, left out of the metrics); gradients synchronise on the last micro-batch only; a non-finite
  loss never ends the micro-batch loop early, and all processes agree before skipping an update.

RNG: generation runs inside a saved-and-restored RNG state (seeded per process and round when
rollout.seeding is "global"; per-sample generators when "per_sample"), so the global RNG, which
drives the minibatch split, moves identically on every process. With per_sample seeding a group's
samples do not depend on the process count at all. Metrics: rollout metrics come from the gathered
batch; loss metrics are summed / averaged over all processes' micro-batches; counters are summed.
Only the main process writes the run directory (config, logs, samples, plots, checkpoints).

Checkpoints and resume on another process count: the weights and optimizer state are saved whole
(replicated under DDP), and the data position (sampler state) and RNG states are the main
process's, which equal every process's; every process loads the same files (the run directory must
be on a filesystem all processes see), so a run resumes on any process count. With per_sample
seeding it continues with the same samples; with global seeding process r's generation stream is
seeded from (seed, round, r), so the samples after a resume on another count differ (same law).

Held-out evaluation is split too (`map_examples`): each process evaluates a contiguous share of
whole eval batches and the per-example results are gathered on every process, so the metrics are
the one-process metrics (the main process logs them). Sampled evaluation (pass@k) draws from
per-sample seeds with rollout.seeding per_sample; with global seeding each process's share is
drawn from torch's RNG seeded from (seed, first example, rank) inside a restored RNG state.

Workloads: text, agents (an episode's env seed is its example's, its turns' seeds come from its
group id with per_sample seeding: episodes do not depend on the process count) and images (each
group drawn from torch's RNG seeded from its id with per_sample seeding; the flow policy's own DDP
view, policies/flow/wrapped.py; DDP only). Agents and images with global seeding sample from the
per-process forked RNG, so their samples depend on the process count (same law).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any

import torch
from torch import Tensor

from grouprl.rollouts.batching import chunks, fill_micro_batches, split_batch
from grouprl.rollouts.filters import cat_rollouts
from grouprl.rollouts.seeds import sample_seed
from grouprl.runtime.checkpoint import (
    CheckpointManager,
    capture_rng,
    restore_rng,
)
from grouprl.runtime.distributed.io import NullLogger, SharedCheckpoints
from grouprl.runtime.distributed.model import DistributedPolicy, ScoreView
from grouprl.types import Rollout, select_rows

_EMPTY = torch.empty(0, dtype=torch.long)  # a padding micro-batch (see module docstring)


class Dist:
    """This process's place in the job; one process when `backend` is None (`SINGLE`)."""

    def __init__(self, seed: int = 0, accelerator: Any = None, backend: Any = None) -> None:
        self.seed, self.accelerator, self.backend = seed, accelerator, backend
        state = accelerator.state if accelerator is not None else None
        self.rank = state.process_index if state else 0
        self.world = state.num_processes if state else 1
        self.is_main = self.rank == 0
        self._padding = False  # the current micro-batch is padding: zero weight
        self._owned: list[Tensor] = []  # rows this process trained on in the last update

    # ---- collectives ----------------------------------------------------------------------------

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """The main process's `obj`, on every process."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def all_true(self, flag: bool) -> bool:
        return all(self.all_gather_object(bool(flag)))

    def sum_counts(self, counts: dict[str, float]) -> dict[str, float]:
        """Counters (reward errors, timeouts) summed over processes."""
        return _sum_dicts(self.all_gather_object(counts))

    # ---- placement: generate whole groups per process, gather the scored batch ------------------

    def device_for(self, name: str) -> torch.device:
        from grouprl.runtime.build import device_for

        return self.accelerator.device if self.world > 1 and name != "cpu" else device_for(name)

    def gather_groups(
        self, examples: list[dict], first_group_id: int, make
    ) -> tuple[Rollout, dict]:
        """make(examples of this process, their first group id) -> (Rollout, counts), on each
        process's contiguous share of `examples`; returns the whole batch and the summed counts.
        Fewer examples than processes (a hint re-sampling one failed group): the processes
        without a share sample nothing and still join the gather (rollout.prompts_per_step is
        refused below the process count at setup, so a step's own batch always fills them)."""
        if self.world == 1:
            return make(examples, first_group_id)
        if not examples:
            raise ValueError("gather_groups: no examples to sample")
        share = chunks(list(range(len(examples))), self.world)[self.rank]
        part = None  # an idle process's contribution
        if share:
            rng = capture_rng()  # the global RNG must move identically on every process
            try:
                torch.manual_seed(
                    sample_seed(self.seed, first_group_id, self.rank)
                )  # global seeding
                part = make([examples[i] for i in share], first_group_id + share[0])
            finally:
                restore_rng(rng)
        parts = [p for p in self.all_gather_object(part) if p is not None]
        return cat_rollouts([p[0] for p in parts]), _sum_dicts([p[1] for p in parts])

    # ---- scoring and the update -----------------------------------------------------------------

    def scorer(self, policy: Any) -> Any:
        """What prepare() scores with: the policy, or a view that splits rows over processes."""
        return policy if self.world == 1 else ScoreView(policy, self)

    def score_rows(self, fn, batch: Any) -> Any:
        """fn(rows of `batch`) on this process's equal share of rows, all-gathered to the whole
        batch: fn returns a tensor [n_r, ...], or a tuple / dict / dataclass (PolicyOutput) of
        them (None kept); the result has the same structure with N rows. A process without rows
        scores row 0 and drops it (FSDP / DDP need every process to run the forward)."""
        n = len(batch) if hasattr(type(batch), "__len__") else next(_tensors(batch)).shape[0]
        share = chunks(list(range(n)), self.world)[self.rank]
        idx = torch.tensor(share or [0])
        rows = batch.select(idx) if hasattr(batch, "select") else select_rows(batch, idx, n)
        out = fn(rows)
        keep = len(share)
        parts = self.all_gather_object(_rows_to_cpu(out, keep))
        return _cat_rows(parts, _device_of(out))

    def map_examples(self, examples: list[Any], fn, *, unit: int = 1) -> list[Any]:
        """Sharded evaluation: fn(this process's examples, index of the first) -> one result per
        example, on a contiguous share of whole `unit`s of examples (an eval batch: the batches
        are the one-process batches, so batch-dependent results match); the results of every
        process, in example order, on every process. Several processes: fn runs inside a
        saved-and-restored global RNG seeded from (seed, first example, rank), so the global RNG
        (the minibatch split) moves identically on every process; one process: fn runs as it is."""
        if self.world == 1:
            return list(fn(examples, 0))
        units = [
            list(range(i, min(i + unit, len(examples)))) for i in range(0, len(examples), unit)
        ]
        share = [i for u in chunks(units, self.world)[self.rank] for i in u]
        part: list[Any] = []
        if share:
            rng = capture_rng()
            try:
                torch.manual_seed(sample_seed(self.seed, -1 - share[0], self.rank))
                part = list(fn([examples[i] for i in share], share[0]))
            finally:
                restore_rng(rng)
            if len(part) != len(share):
                raise ValueError(f"map_examples: {len(part)} results for {len(share)} examples")
        return [x for p in self.all_gather_object(part) for x in p]

    def split_batch(self, rollout: Rollout, minibatches: int, micro_size: int | None, *,
                    whole_groups: bool) -> Iterator[tuple[Tensor, list[Tensor]]]:  # fmt: skip
        """(global minibatch indices, this process's micro-batches) per optimizer update; every
        process gets the same number of micro-batches (empty ones are padding, see `select`)."""
        if self.world == 1:
            yield from split_batch(rollout, minibatches, micro_size, whole_groups=whole_groups)
            return
        self._owned = []
        # micro_size 1: batching's own shuffle, one unit (a sample or a whole group) per entry
        for mb, units in split_batch(rollout, minibatches, 1, whole_groups=whole_groups):
            micro = [fill_micro_batches(share, micro_size) for share in chunks(units, self.world)]
            mine = micro[self.rank]
            self._owned += mine
            yield mb, mine + [_EMPTY] * (max(map(len, micro)) - len(mine))

    def select(self, rollout: Rollout, idx: Tensor) -> Rollout:
        """rollout.select(idx); an empty idx (padding) selects row 0, trained with weight 0."""
        self._padding = len(idx) == 0
        return rollout.select(idx if len(idx) else torch.zeros(1, dtype=torch.long))

    def set_sync(self, is_last: bool) -> None:
        """Gradients are all-reduced on the backward of the last micro-batch of an update only."""
        if self.backend is not None:
            self.backend.set_sync(is_last)

    def backward(self, loss: Tensor) -> None:
        if self.backend is None:
            loss.backward()
        else:  # processes average gradients: x world gives the sum, i.e. the one-process gradient
            self.backend.backward(loss * (0.0 if self._padding else float(self.world)))

    def all_finite(self, parts: list[dict], micro_batches: list[Tensor]) -> bool:
        """Every real micro-batch's loss was finite, on every process."""
        real = sum(len(i) > 0 for i in micro_batches)
        ok = len(parts) == real and all(math.isfinite(p.get("loss", 0.0)) for p in parts)
        return self.all_true(ok)

    def clip_grad_norm(self, params: list, max_norm: float | None) -> float:
        if self.backend is not None and hasattr(self.backend, "clip_grad_norm"):
            return self.backend.clip_grad_norm(params, max_norm)
        params = [p for p in params if p.grad is not None]
        if not params:
            return 0.0
        bound = max_norm if max_norm is not None else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, bound))

    def sum_metrics(self, means: dict, shares: dict, n_micro: int) -> tuple[dict, dict, int]:
        """update()'s per-micro-batch sums over every process (loss shares add up to the loss)."""
        if self.world == 1:
            return means, shares, n_micro
        parts = self.all_gather_object((means, shares, n_micro))
        return (_sum_dicts([p[0] for p in parts]), _sum_dicts([p[1] for p in parts]),
                sum(p[2] for p in parts))  # fmt: skip

    def share_old_logp(self, rollout: Rollout) -> None:
        """update() writes the trainer's old_logp of the rows it trained (one-pass updates): give
        every process all rows (the engine-mismatch metrics read the whole batch)."""
        if self.world == 1 or not self._owned:
            return
        idx = torch.cat(self._owned)  # [n_r]
        for rows, values in self.all_gather_object((idx, rollout.old_logp[idx].cpu())):
            rollout.old_logp[rows] = values.to(rollout.old_logp.device)

    # ---- the model ------------------------------------------------------------------------------

    def prepare(self, policy: Any, optimizer: Any) -> tuple[Any, Any]:
        """Wrap the policy's model for this backend (DDP, FSDP2, DeepSpeed through accelerate).
        The policy's `scoring_module(path)` is what is wrapped; a policy with its own
        `with_scoring_module(module)` (flows) returns its view of itself around the wrapped module,
        text policies get DistributedPolicy."""
        if self.backend is None:
            return policy, optimizer
        module = policy.scoring_module(
            getattr(self.backend, "scoring_path", None)
        )  # sharded: plain
        module, optimizer = self.backend.wrap(policy, module, optimizer)
        own_view = getattr(policy, "with_scoring_module", None)  # e.g. flow policies' view
        if own_view is not None:
            return own_view(module), optimizer
        return DistributedPolicy(policy, module, self.backend), optimizer

    # ---- main-process-only I/O ------------------------------------------------------------------

    def checkpoints(self, run_dir, keep_last: int | None) -> Any:
        if self.world == 1:
            return CheckpointManager(run_dir, keep_last=keep_last)
        return SharedCheckpoints(self, run_dir, keep_last)

    def logger_class(self, real: type) -> type:
        return real if self.is_main else NullLogger


SINGLE = Dist()


def setup(cfg: Any) -> Dist:
    """The job this process belongs to: `SINGLE` unless launched with WORLD_SIZE > 1."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Dist(seed=cfg.run.seed)
    from accelerate import Accelerator

    from grouprl.runtime.distributed.backends import backend_for

    cpu = cfg.run.device == "cpu" or not torch.cuda.is_available()
    accelerator = Accelerator(cpu=cpu)
    dist = Dist(cfg.run.seed, accelerator, None)
    dist.backend = backend_for(cfg, dist)
    if cfg.rollout.prompts_per_step < dist.world:
        raise ValueError(
            f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} < {dist.world} processes: "
            "each process samples whole groups, so every process needs at least one"
        )
    return dist


# ---- helpers ------------------------------------------------------------------------------------


def _rows_to_cpu(value: Any, keep: int) -> Any:
    """The first `keep` rows of every tensor in `value` (tensor, tuple, list, dict, dataclass),
    on the CPU, for the gather."""
    if isinstance(value, Tensor):
        return value[:keep].cpu()
    if isinstance(value, tuple | list):
        return type(value)(_rows_to_cpu(v, keep) for v in value)
    if isinstance(value, dict):
        return {k: _rows_to_cpu(v, keep) for k, v in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        return replace(value, **{f.name: _rows_to_cpu(getattr(value, f.name), keep)
                                 for f in fields(value)})  # fmt: skip
    return value


def _cat_rows(parts: list[Any], device: torch.device) -> Any:
    """The processes' row shares (same structure) concatenated along rows, on `device`."""
    first = parts[0]
    if isinstance(first, Tensor):
        return torch.cat(parts).to(device)
    if isinstance(first, tuple | list):
        return type(first)(_cat_rows([p[i] for p in parts], device) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _cat_rows([p[k] for p in parts], device) for k in first}
    if hasattr(first, "__dataclass_fields__"):
        return replace(first, **{f.name: _cat_rows([getattr(p, f.name) for p in parts], device)
                                 for f in fields(first)})  # fmt: skip
    return first


def _device_of(value: Any) -> torch.device:
    """The device of the first tensor in `value` (CPU when it holds none)."""
    for t in _tensors(value):
        return t.device
    return torch.device("cpu")


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif hasattr(value, "__dataclass_fields__"):
        for f in fields(value):
            yield from _tensors(getattr(value, f.name))


def _sum_dicts(parts: list[dict]) -> dict:
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out
