"""Wall-clock speedup of one-step-off-policy training (train.async_mode one_step_off) over the
synchronous loop, on the same workload.

Workload: the random-weight Qwen2 of benchmarks/_common.MODELS (default "small": hidden 256,
4 layers, byte vocabulary, ~4.0M parameters), the arithmetic task's prompts, 8 prompts x 8 samples
per step, 32-token completions at temperature 1 from the default engine (`--engine fast`; `hf`:
transformers generate), rollout.seeding per_sample, a dense reward (the fraction of digit
characters), AdamW lr 1e-5, mu = 1, float32, `--threads` torch threads (default 1: on a 2-core
machine generation runs on one core in the worker thread while the update runs on the other).
Both modes run grouprl's own `train()` with the same config except train.async_mode.
`--old-logp engine` takes the engine's sampling log-probs as pi_old (no scoring pass: in
one_step_off the worker otherwise scores every batch once more with the snapshot).

Each mode runs in its own fresh process, the modes alternate (sync, async, sync, async ...) so
that drift of the machine's load hits both alike. Per run: `--warmup` steps, then `--steps`
timed steps; a step's time is the gap between consecutive train lines of metrics.jsonl (sampling,
scoring, advantages, the update, logging). Reported per mode: the median step time over all timed
steps of all runs; for one_step_off also the worker's time per batch (async/rollout_s, generation
+ rewards + the old_logp scoring) and the trainer's wait for it (async/wait_s). The ideal speedup
of a perfect overlap is (generate + update) / max(generate, update). Two controls, measured before
and after the runs: two processes, and two threads of one process, doing the same single-threaded
matmuls at once vs one after the other: how much parallel compute the machine gave each (2.0: two
free cores). `--async-worker` (train.async_worker): the worker is a forked process (default) or a
thread of the trainer's process, which the threads control then bounds.

    .venv/bin/python benchmarks/async_speedup.py
    .venv/bin/python benchmarks/async_speedup.py --steps 4 --reps 1 --engine fast --threads 2

Prints a table and `speedup one_step_off/sync: X`; writes async_speedup.json into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SCRIPT = Path(__file__).resolve()
MODES = {"sync": "off", "one_step_off": "one_step_off"}


def digit_reward(completions: list[str], **_: Any) -> list[float]:
    """The workload's reward: _common.digit_reward with the reward-function signature."""
    return C.digit_reward(completions)


def _matmuls(_: Any = None) -> None:
    import torch

    torch.set_num_threads(1)
    x = torch.randn(768, 768)
    for _ in range(80):
        x @ x


def parallel_capacity(kind: str) -> float:
    """Control: throughput of two processes ("processes") or two threads of this process
    ("threads") doing the same single-threaded matmuls at once, relative to one after the other
    (2.0 = both ran on free cores; about 1.0 = no overlap possible). About 2 s."""
    import multiprocessing as mp
    import threading
    import time

    start = time.perf_counter()
    _matmuls()
    _matmuls()
    serial = time.perf_counter() - start
    if kind == "processes":
        workers = [mp.get_context("fork").Process(target=_matmuls) for _ in range(2)]
    else:
        workers = [threading.Thread(target=_matmuls) for _ in range(2)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return serial / (time.perf_counter() - start)


def worker(a: argparse.Namespace) -> dict[str, Any]:
    C.worker_setup(a.threads)
    from grouprl.config.loading import validate
    from grouprl.train import train

    run_root = Path(tempfile.mkdtemp(prefix="async_speedup_"))
    raw = {
        "run": {"name": a.worker, "output_dir": str(run_root), "seed": 0, "device": "cpu",
                "console": False, "num_threads": a.threads},
        "workload": {"type": "text"},
        "model": {"name_or_path": a.model_dir},
        "task": {"name": "arithmetic", "options": {"n_train": 2000, "n_eval": 1}},
        "rewards": [{"name": f"{SCRIPT}:digit_reward"}],
        "rollout": {"prompts_per_step": a.prompts, "group_size": a.group,
                    "max_new_tokens": a.max_new, "engine": a.engine, "seeding": "per_sample",
                    "old_logp": a.old_logp},
        "train": {"steps": a.warmup + a.steps, "lr": 1e-5,
                  "async_mode": MODES[a.worker], "async_worker": a.async_worker},
        "eval": {"max_examples": 1},
    }  # fmt: skip
    train(validate(raw))
    lines = (run_root / a.worker / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if r["split"] == "train"]
    times = [r["time"] for r in rows]
    timed = rows[a.warmup :]
    return {
        "step_s": [t1 - t0 for t0, t1 in zip(times[a.warmup - 1 :], times[a.warmup :])],
        "rollout_s": [r["async/rollout_s"] for r in timed if "async/rollout_s" in r],
        "wait_s": [r["async/wait_s"] for r in timed if "async/wait_s" in r],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small", choices=sorted(C.MODELS))
    p.add_argument("--engine", default="fast", choices=["fast", "hf"])
    p.add_argument("--old-logp", default="recompute", choices=["recompute", "engine"])
    p.add_argument("--async-worker", default="process", choices=["process", "thread"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(C.RESULTS))
    p.add_argument("--worker", choices=sorted(MODES), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.warmup < 1:
        p.error("--warmup must be >= 1 (the first step's time includes the initial evaluation)")
    if a.worker:
        C.write_json(Path(a.result), worker(a))
        return

    info = C.machine_info(a.threads)
    model_dir = C.build_model_dir(Path(tempfile.gettempdir()) / f"grouprl_bench_{a.model}", a.model)
    args = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
            if k in ("engine", "old_logp", "async_worker", "prompts", "group", "max_new", "warmup",
                     "steps", "threads")]  # fmt: skip
    capacity = [{k: parallel_capacity(k) for k in ("processes", "threads")}]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(a.reps):
        for mode in MODES:  # alternate: load drift hits both modes alike
            res = C.run_worker(sys.executable, SCRIPT, [*args, f"--worker={mode}",
                                                        f"--model-dir={model_dir}"])  # fmt: skip
            runs[mode].append(res)
            print(f"rep {rep + 1} {mode}: median step {C.median(res['step_s']):.3f} s", flush=True)

    capacity.append({k: parallel_capacity(k) for k in ("processes", "threads")})
    step = {m: C.median([s for r in runs[m] for s in r["step_s"]]) for m in MODES}
    rollout = C.median([s for r in runs["one_step_off"] for s in r["rollout_s"]])
    wait = C.median([s for r in runs["one_step_off"] for s in r["wait_s"]])
    update = step["sync"] - rollout  # the synchronous step = generation + the rest
    ideal = step["sync"] / max(rollout, update) if update > 0 else float("nan")
    speedup = step["sync"] / step["one_step_off"]
    table = C.format_table(
        ["mode", "median step s", "worker batch s", "trainer wait s"],
        [["sync", step["sync"], "-", "-"], ["one_step_off", step["one_step_off"], rollout, wait]],
    )
    print(f"\n{C.describe_machine(info)}")
    note = C.warn_if_loaded(info)
    if note:
        print(note)
    print(f"model {a.model}, engine {a.engine}, old_logp {a.old_logp}, worker {a.async_worker}, "
          f"{a.prompts} x {a.group} "
          f"samples x {a.max_new} "
          f"tokens, {a.steps} timed steps x {a.reps} runs per mode\n\n{table}\n")  # fmt: skip
    print(f"ideal overlap speedup (gen + update) / max(gen, update): {ideal:.2f}")
    for kind in ("processes", "threads"):
        before, after = (c[kind] for c in capacity)
        print(f"parallel capacity, 2 {kind} vs serial matmuls (before / after): "
              f"{before:.2f} / {after:.2f}")  # fmt: skip
    print(f"speedup one_step_off/sync: {speedup:.2f}")
    C.write_json(
        Path(a.out) / "async_speedup.json",
        {"machine": info, "args": {k: v for k, v in vars(a).items() if k != "out"},
         "runs": runs, "median_step_s": step, "worker_batch_s": rollout, "wait_s": wait,
         "ideal_speedup": ideal, "speedup": speedup, "parallel_capacity": capacity},
    )  # fmt: skip


if __name__ == "__main__":
    main()
