"""Bounded-staleness asynchronous training (train.async_mode bounded) vs the synchronous loop on
the arithmetic demo: seconds per step and the held-out learning curve, side by side.

Workload: the CPU demo (grouprl/demos/arithmetic.py, configs/text/arithmetic_demo.yaml): the tiny
Qwen2 after its supervised warm-up (made once by the demo's own builder, cached under --cache),
GRPO on two-digit addition with the accuracy reward, 6-token completions, lr 1e-3 linear decay.
Reduced to fit a shared 2-core machine: --steps steps (default 80, the demo runs 400),
--prompts prompts x 8 samples per step (default 32, as the demo), greedy held-out accuracy on
--eval-examples problems every --eval-every steps. rollout.seeding per_sample; each of --seeds
(run.seed) in every mode, accuracies averaged over the seeds. Modes: sync (async_mode off); bounded k=1 and k=2 (max_staleness k, the
producer up to k batches ahead, stale_policy drop, partial rollouts in --chunk-token chunks (0:
whole completions),
algorithm.engine_correction token_truncate: the pi_prox / pi_behav weight of decoupled PPO).

Each mode runs in its own fresh process, one after the other (the modes do not alternate: on a
loaded machine read the table with the load average printed below it). A step's time is the gap
between consecutive train lines of metrics.jsonl; the first step (it includes the initial
evaluation) and the steps that evaluate are left out of the median.

    .venv/bin/python benchmarks/async_bounded.py
    .venv/bin/python benchmarks/async_bounded.py --steps 12 --eval-every 4 --seeds 0 --threads 2
    .venv/bin/python benchmarks/async_bounded.py --engine vllm_server   # a vllm-serve process samples

Prints a table per mode; writes <--name>.json (default async_bounded.json) into --out (default
benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SCRIPT = Path(__file__).resolve()
MODES = {
    "sync": [],
    "bounded_k1": ["train.async_mode=bounded", "train.max_staleness=1"],
    "bounded_k2": ["train.async_mode=bounded", "train.max_staleness=2"],
}


def overrides(a: argparse.Namespace, mode: str, run_root: Path) -> list[str]:
    common = [
        f"run.output_dir={run_root}", f"run.name={mode}", f"run.seed={a.seed}", "run.console=false",
        f"run.num_threads={a.threads}", f"train.steps={a.steps}",
        f"rollout.prompts_per_step={a.prompts}", "rollout.seeding=per_sample",
        f"eval.every={a.eval_every}", f"eval.max_examples={a.eval_examples}", "eval.pass_k=1",
        "checkpoint.every=0", f"task.options.n_eval={a.eval_examples}",
    ]  # fmt: skip
    if a.engine == "vllm_server":  # generation in the server's process, beside the trainer's
        common += ["rollout.engine=vllm_server", f"rollout.server.url={a.url}"]
    if mode != "sync":
        common.append("algorithm.engine_correction=token_truncate")
        if a.chunk:  # 0: whole completions, no partial rollouts
            common.append(f"train.partial_chunk_tokens={a.chunk}")
    return common + MODES[mode]


def warm_model(a: argparse.Namespace) -> Path:
    """The demo's warm-up checkpoint (its own builder; cached in --cache)."""
    from rich.console import Console

    from grouprl.config.loading import load_config
    from grouprl.demos.arithmetic import CONFIG, cached_warm_up
    from grouprl.envs.tasks import build_task

    cfg = load_config(CONFIG, [f"run.output_dir={a.cache}"])
    task = build_task(cfg.task.name, **cfg.task.options)
    return cached_warm_up(cfg, task, 3000, 0.3, Console())


def worker(a: argparse.Namespace) -> dict[str, Any]:
    C.worker_setup(a.threads)
    from grouprl.config.loading import load_config
    from grouprl.demos.arithmetic import CONFIG
    from grouprl.train import train

    run_root = Path(tempfile.mkdtemp(prefix="async_bounded_"))
    cfg = load_config(CONFIG, [f"model.name_or_path={a.model_dir}", *overrides(a, a.worker,
                                                                                 run_root)])  # fmt: skip
    result = train(cfg)
    lines = (run_root / a.worker / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    train_rows = [r for r in rows if r["split"] == "train"]
    evals = {r["step"]: r["eval/accuracy"] for r in rows if r["split"] == "eval"}
    evals[a.steps] = result["after"]["accuracy"]
    pairs = zip(train_rows, train_rows[1:])  # a gap after an evaluating step includes it
    step_s = [r["time"] - q["time"] for q, r in pairs if q["step"] % a.eval_every != 0]
    stale = [r.get("async/staleness_mean", 0.0) for r in train_rows]
    return {
        "step_s": step_s, "accuracy": evals, "staleness_mean": stale,
        "dropped": sum(r.get("async/dropped_samples", 0.0) for r in train_rows),
        "wait_s": [r["async/wait_s"] for r in train_rows if "async/wait_s" in r],
        "reward_mean": [r["reward/mean"] for r in train_rows],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-examples", type=int, default=300)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--engine",
        choices=["fast", "vllm_server"],
        default="fast",
        help="fast: the demo's engine, the producer a thread of the trainer; "
        "vllm_server: a `grouprl vllm-serve` process generates (started here)",
    )
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "grouprl_bench_async"))
    p.add_argument("--out", default=str(C.RESULTS))
    p.add_argument("--name", default="async_bounded", help="the JSON file's name in --out")
    p.add_argument("--worker", choices=sorted(MODES), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        C.write_json(Path(a.result), worker(a))
        return
    info = C.machine_info(a.threads)
    model_dir = warm_model(a)
    args = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
            if k in ("steps", "prompts", "eval_every", "eval_examples", "chunk", "threads",
                     "engine")]  # fmt: skip
    server = None
    if a.engine == "vllm_server":
        from server_scaling import start_server

        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "VLLM_CPU_KVCACHE_SPACE": "1"}
        server, url, start_s = start_server(model_dir, env, Path(a.cache) / "server.log")
        args.append(f"--url={url}")
        print(f"vllm-serve ready at {url} after {start_s:.0f} s", flush=True)
    try:
        per_seed = run_modes(a, args, model_dir)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    runs = {m: pool(rs) for m, rs in per_seed.items()}
    report(a, info, runs, per_seed)


def run_modes(a: argparse.Namespace, args: list[str], model_dir: Path) -> dict[str, list[dict]]:
    """Every mode for every seed, each in its own process, one after the other."""
    per_seed: dict[str, list[dict]] = {m: [] for m in MODES}
    for seed in a.seeds:
        for mode in MODES:
            res = C.run_worker(sys.executable, SCRIPT, [*args, f"--worker={mode}", f"--seed={seed}",
                                                        f"--model-dir={model_dir}"])  # fmt: skip
            per_seed[mode].append(res)
            print(f"seed {seed} {mode}: median step {C.median(res['step_s']):.3f} s, accuracy "
                  f"{res['accuracy']}", flush=True)  # fmt: skip
    return per_seed


def report(a: argparse.Namespace, info: dict, runs: dict, per_seed: dict) -> None:
    eval_steps = sorted({int(s) for r in runs.values() for s in r["accuracy"]})
    header = ["mode", "median step s", "vs sync", "staleness mean", "dropped"] + [
        f"acc@{s}" for s in eval_steps
    ]
    base = C.median(runs["sync"]["step_s"])
    rows = []
    for mode, r in runs.items():
        med = C.median(r["step_s"])
        acc = {int(k): v for k, v in r["accuracy"].items()}
        stale = sum(r["staleness_mean"]) / len(r["staleness_mean"])
        rows.append([mode, med, f"{base / med:.2f}x", stale, int(r["dropped"])]
                    + [f"{100 * acc[s]:.1f}%" if s in acc else "-" for s in eval_steps])  # fmt: skip
    print(f"\n{C.describe_machine(info)}")
    note = C.warn_if_loaded(info, alternated=False)
    if note:
        print(note)
    print(f"arithmetic demo, engine {a.engine}, seeds {a.seeds} (accuracy: their mean), {a.steps} steps x "
          f"{a.prompts} prompts x 8 samples, chunk {a.chunk} "
          f"tokens, {a.threads} thread(s), held-out greedy accuracy on {a.eval_examples} problems"
          f"\n\n{C.format_table(header, rows)}")  # fmt: skip
    C.write_json(Path(a.out) / f"{a.name}.json",
                 {"machine": info, "args": {k: v for k, v in vars(a).items() if k not in ("out", "name")},
                  "runs": per_seed})  # fmt: skip


def pool(results: list[dict]) -> dict:
    """The seeds of one mode together: step times pooled, accuracies and staleness averaged."""
    steps = results[0]["accuracy"].keys()
    return {
        "step_s": [s for r in results for s in r["step_s"]],
        "accuracy": {k: sum(r["accuracy"][k] for r in results) / len(results) for k in steps},
        "staleness_mean": [s for r in results for s in r["staleness_mean"]],
        "dropped": sum(r["dropped"] for r in results),
    }


if __name__ == "__main__":
    main()
