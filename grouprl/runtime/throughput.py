"""Per-stage timings, token rates and model FLOPs utilisation (MFU) of each training step.

The loop wraps its stages in `meter.stage(name)` and hands the step's rollout to
`meter.metrics(...)`, which returns the `perf/` metrics of the step:

  perf/generate_s, perf/prepare_s, perf/update_s, perf/weight_sync_s  seconds in each stage
      (generate: waiting for the step's scored rollout, i.e. sampling plus rewards; with async
      rollouts only the wait the trainer saw; weight_sync: pushing the new weights to the engine)
  perf/step_s                     wall time from the start of the step to its metrics
  perf/generated_tokens_per_s     actions sampled this step (rollout/sampled_actions: tokens for
                                  text, denoising steps for flows; every dynamic-sampling round)
                                  / perf/step_s
  perf/trained_tokens_per_s       loss-mask actions x algorithm.epochs / perf/step_s
  perf/mfu                        the step's model FLOPs / (perf/step_s x peak FLOP/s x processes)

FLOP count (the convention of Kaplan et al. arXiv 2001.08361 and PaLM's MFU, arXiv 2204.02311,
WITHOUT PaLM's attention term 12 * n_layer * d_model * context): a forward pass costs 2 * N FLOPs
per token and a training forward + backward 6 * N, N the parameters that multiply activations
(embedding lookups excluded; the LM head counted). Per step:

  2 N (prefilled + generated tokens)                 sampling
+ 2 N sequence tokens x scoring passes               prepare (old / reference log-probs)
+ 6 N sequence tokens x epochs                       the update

with `sequence tokens` the real (unpadded) prompt + completion tokens of the trained rows. The
numbers come from the workload through the `MeasuresWork` protocol (`step_work(rollout)`), so this
module never asks which modality runs. A workload without it, or one whose policy has no simple
count (flow policies: a denoiser's FLOPs per step depend on its architecture and resolution),
logs no perf/mfu, and the run prints the reason once. Known simplifications: LoRA updates are
counted as full 6 N (the frozen weights' gradients are not computed, so the true count is ~4 N);
multi-turn agents' prefill is counted once per row, not per turn; a prompt is counted as prefilled
once per row, also where an engine prefills a group's shared prompt once.

Peak FLOP/s: `run.peak_flops` (a number), or "auto": the device's dense bf16/fp16 tensor-core peak
from PEAK_FLOPS (float32 uses the same table's tf32 entry), none on CPU (MFU not logged, noted
once).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

STAGES = ("generate", "prepare", "update", "weight_sync")

# dense (no 2:4 sparsity) tensor-core peak FLOP/s from the vendors' data sheets (SXM parts):
# device-name substring -> {"bf16": ..., "tf32": ...}; float16 uses the bf16 entry; the first
# substring found in the name wins (L40S before L40 before L4)
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "tf32": 494.5e12},
    "H100": {"bf16": 989e12, "tf32": 494.5e12},
    "A100": {"bf16": 312e12, "tf32": 156e12},
    "L40S": {"bf16": 362e12, "tf32": 183e12},
    "L40": {"bf16": 181e12, "tf32": 90.5e12},
    "A10G": {"bf16": 70e12, "tf32": 35e12},
    "L4": {"bf16": 121e12, "tf32": 60e12},
}


@dataclass(frozen=True)
class StepWork:
    """A step's work as its workload counts it (sums over the rollout's rows).

    params:        N, parameters that multiply activations (2 N FLOPs per token forward); None:
                   no simple count for this policy (MFU is not logged), `why` says why
    prefilled:     prompt / context tokens the engine read before sampling
    sequence:      real prompt + completion tokens of the trained rows (one forward's tokens)
    scoring_passes: no-grad forwards over the batch in prepare (old log-probs, reference, ...)
    why:           with params None: the reason, printed once
    """

    params: int | None
    prefilled: int = 0
    sequence: int = 0
    scoring_passes: int = 0
    why: str = ""


@runtime_checkable
class MeasuresWork(Protocol):
    """A workload that counts its step's work for the FLOP estimate."""

    def step_work(self, rollout: Any) -> StepWork: ...


def wall_clock(key: str) -> bool:
    """A metrics.jsonl key whose value is a wall-clock reading (differs between identical runs):
    the logger's "time" and every perf/ metric."""
    return key == "time" or key.startswith("perf/")


def step_flops(work: StepWork, generated: float, epochs: int) -> float | None:
    """Model FLOPs of one step (module docstring); None when the policy has no count."""
    if work.params is None:
        return None
    n = float(work.params)
    sampling = 2 * n * (work.prefilled + generated)
    scoring = 2 * n * work.sequence * work.scoring_passes
    training = 6 * n * work.sequence * epochs
    return sampling + scoring + training


def peak_flops_for(
    setting: float | str | None, device: Any, dtype: str
) -> tuple[float | None, str]:
    """(peak FLOP/s per process, note): run.peak_flops resolved for this device and dtype; None
    with the reason when MFU cannot be computed."""
    if setting is None:
        return None, "run.peak_flops is null: perf/mfu is not logged"
    if not isinstance(setting, str):
        return float(setting), ""
    if getattr(device, "type", str(device)) != "cuda":
        return None, (
            f"run.peak_flops=auto knows no peak for device {device}: perf/mfu is not logged "
            "(set run.peak_flops to this device's FLOP/s to log it)"
        )
    import torch

    name = torch.cuda.get_device_name(device)
    peak = peak_of_gpu(name, dtype)
    if peak is not None:
        return peak, ""
    return None, (
        f"run.peak_flops=auto has no entry for GPU {name!r} (known: {', '.join(PEAK_FLOPS)}): "
        "perf/mfu is not logged; set run.peak_flops to its dense FLOP/s"
    )


def peak_of_gpu(name: str, dtype: str) -> float | None:
    """PEAK_FLOPS of a GPU by its name (torch.cuda.get_device_name): bf16 / fp16 compute, or tf32
    for float32; None when the table has no entry."""
    kind = "tf32" if dtype == "float32" else "bf16"
    for key, peaks in PEAK_FLOPS.items():
        if key in name:
            return peaks[kind]
    return None


def matmul_params(model: Any) -> int:
    """Parameters of a torch module that multiply activations: all of them minus the input
    embedding table when it is not tied to the output head (a lookup, no FLOPs)."""
    params = {id(p): p.numel() for p in model.parameters()}
    total = sum(params.values())
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if emb is None or not hasattr(emb, "weight"):
        return total
    tied = head is not None and getattr(head, "weight", None) is emb.weight
    return total if tied else total - emb.weight.numel()


class StepMeter:
    """Stage timers of one run; `metrics()` closes a step. notes: printed once each (logger.print)."""

    def __init__(
        self, peak: tuple[float | None, str], epochs: int, world: int = 1, device: Any = None
    ) -> None:
        self.peak, self.epochs, self.world = peak[0], epochs, max(world, 1)
        self.cuda = getattr(device, "type", None) == "cuda"  # stage ends wait for the GPU
        self.notes: list[str] = [peak[1]] if peak[1] else []
        self._noted: set[str] = set(self.notes)
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @classmethod
    def for_run(cls, cfg: Any, device: Any, world: int) -> StepMeter:
        """The meter of a run: run.peak_flops for this device and model.dtype, algorithm.epochs."""
        dtype = getattr(cfg.model, "dtype", "float32")
        peak = peak_flops_for(cfg.run.peak_flops, device, dtype)
        return cls(peak, cfg.algorithm.epochs, world, device)

    def start_step(self) -> None:
        self.seconds = {}
        self._start = time.perf_counter()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; stages: {STAGES}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:  # kernels still queued belong to this stage
                import torch

                torch.cuda.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def _note(self, msg: str) -> None:
        if msg and msg not in self._noted:
            self._noted.add(msg)
            self.notes.append(msg)

    def pop_notes(self) -> list[str]:
        out, self.notes = self.notes, []
        return out

    def metrics(self, workload: Any, rollout: Any, metrics: dict[str, float]) -> dict[str, float]:
        """The perf/ metrics of the step that started at start_step(); rollout None: a skipped
        step (times only). metrics: the step's metrics so far (rollout/sampled_actions)."""
        step_s = time.perf_counter() - self._start
        out = {f"perf/{k}_s": self.seconds.get(k, 0.0) for k in STAGES}
        out["perf/step_s"] = step_s
        generated = float(metrics.get("rollout/sampled_actions", 0.0))
        out["perf/generated_tokens_per_s"] = generated / step_s
        if rollout is None:
            return out
        trained = float(rollout.mask.sum()) * self.epochs
        out["perf/trained_tokens_per_s"] = trained / step_s
        if not isinstance(workload, MeasuresWork):
            self._note(
                f"workload {getattr(workload, 'name', type(workload).__name__)!r} does not count "
                "its FLOPs (no step_work): perf/mfu is not logged"
            )
            return out
        work = workload.step_work(rollout)
        flops = step_flops(work, generated, self.epochs)
        if flops is None:
            self._note(f"perf/mfu is not logged: {work.why}")
        elif self.peak is not None:
            out["perf/mfu"] = flops / (step_s * self.peak * self.world)
        return out
