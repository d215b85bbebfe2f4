"""Compare group-relative methods on the CPU arithmetic task: held-out accuracy after the same steps.

For each seed: one supervised warm-up (as in the demo), then every method trains from that same
checkpoint with the demo config and the same number of steps; only `algorithm.preset` changes.
Prints one table (mean and spread over seeds) and writes one PNG.

    .venv/bin/python benchmarks/methods_comparison.py [--steps 150] [--seeds 0 1 2] [--methods ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console
from transformers.utils import logging as hf_logging

from grouprl.config.loading import load_config
from grouprl.demos.arithmetic import CONFIG, warm_up
from grouprl.envs.tasks import build_task
from grouprl.train import train

METHODS = ["grpo", "dr_grpo", "dapo", "gspo", "lambda_grpo", "pmd_mean", "tpo"]


def run(args: argparse.Namespace) -> dict[str, list[dict]]:
    console = Console()
    out = Path(args.output_dir)
    results: dict[str, list[dict]] = {m: [] for m in args.methods}
    for seed in args.seeds:
        base = load_config(CONFIG, [f"run.seed={seed}", f"run.output_dir={out}"])
        task = build_task(base.task.name, **base.task.options)
        model_dir = warm_up(
            base, task, out / f"warmup-seed{seed}", args.warmup_max_steps, 0.3, console
        )
        for method in args.methods:
            cfg = load_config(CONFIG, [
                f"algorithm.preset={method}", f"model.name_or_path={model_dir}",
                f"run.seed={seed}", f"run.output_dir={out}", f"run.name={method}-seed{seed}",
                "run.overwrite=true", "run.console=false", f"train.steps={args.steps}",
                f"eval.every={args.eval_every}", "eval.pass_k=0", "checkpoint.every=0",
                f"task.options.n_eval={args.n_eval}",
            ])  # fmt: skip
            t0 = time.time()
            res = train(cfg)
            row = {"seed": seed, "before": res["before"]["accuracy"],
                   "after": res["after"]["accuracy"], "seconds": time.time() - t0,
                   "run_dir": res["run_dir"]}  # fmt: skip
            results[method].append(row)
            console.print(
                f"seed {seed} {method:12s} held-out accuracy {100 * row['before']:.1f}% -> "
                f"{100 * row['after']:.1f}% ({row['seconds']:.0f} s)"
            )
    return results


def report(results: dict[str, list[dict]], out: Path, steps: int) -> None:
    lines = [f"held-out accuracy after {steps} steps (mean ± sample std over seeds; before = "
             "the warm-up checkpoint)", "", "| method | before | after | gain | seconds/run |",
             "|---|---|---|---|---|"]  # fmt: skip
    for method, rows in results.items():
        after = [100 * r["after"] for r in rows]
        gain = [100 * (r["after"] - r["before"]) for r in rows]

        def ms(xs: list[float]) -> str:
            return (
                f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs):.1f}"
                if len(xs) > 1
                else (f"{xs[0]:.1f}")
            )

        before = statistics.mean(100 * r["before"] for r in rows)
        secs = statistics.mean(r["seconds"] for r in rows)
        lines.append(f"| {method} | {before:.1f} | {ms(after)} | {ms(gain)} | {secs:.0f} |")
    text = "\n".join(lines)
    print(text)
    (out / "methods_comparison.md").write_text(text + "\n")
    (out / "methods_comparison.json").write_text(json.dumps(results, indent=1))
    fig = Figure(figsize=(max(6, 1.1 * len(results)), 4))
    ax = fig.add_subplot()
    for i, rows in enumerate(results.values()):
        after = [100 * r["after"] for r in rows]
        ax.bar(i, statistics.mean(after), color="tab:blue", alpha=0.6)
        ax.scatter([i] * len(after), after, color="black", s=12, zorder=3)
    ax.axhline(statistics.mean(100 * r["before"] for rows in results.values() for r in rows),
               color="gray", ls="--", label="before (warm-up)")  # fmt: skip
    ax.set_xticks(range(len(results)), list(results), rotation=30)
    ax.set_ylabel(f"held-out accuracy after {steps} steps (%)")
    ax.legend()
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(out / "methods_comparison.png"))
    print(f"wrote {out / 'methods_comparison.md'} and {out / 'methods_comparison.png'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--n-eval", type=int, default=300)
    p.add_argument("--warmup-max-steps", type=int, default=3000)
    p.add_argument("--output-dir", default="runs/methods-comparison")
    args = p.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    hf_logging.disable_progress_bar()
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    report(run(args), Path(args.output_dir), args.steps)


if __name__ == "__main__":
    main()
