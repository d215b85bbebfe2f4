"""What hints, replay, on-policy distillation and rollout budgets buy on the CPU arithmetic task.

For each seed: the demo's supervised warm-up (as in the demo), then each method trains from that
checkpoint with the demo config for the same number of steps, on the first --max-train training
problems (640: each recurs every 20 steps, as in a multi-epoch run; replay and the budgets learn
from a prompt's history); the table reports held-out greedy
accuracy, the policy's sampled tokens (every sampling round, hint re-samples included; replayed rows
are not sampled) and the gain per million sampled tokens. `opd` distils from the `grpo` run of the
same seed (its final weights are the teacher), so `grpo` runs first; the teacher's own training
tokens are not counted in opd's row.

    .venv/bin/python benchmarks/signal_methods.py [--steps 150] [--seeds 0 1 2] [--methods ...]

Results are kept per run in OUT/signal_methods.json; a run already there is not repeated (delete
the file to start over), so methods can be added in later invocations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from transformers.utils import logging as hf_logging

from grouprl.config.loading import load_config
from grouprl.demos.arithmetic import CONFIG, warm_up
from grouprl.envs.tasks import build_task
from grouprl.train import train

# method -> overrides on top of the demo config. hint: the arithmetic task has no worked solution,
# so the hint is the first character(s) of the answer, forced as the completion's start
METHODS: dict[str, list[str]] = {
    "grpo": ["algorithm.preset=grpo"],
    "hint": [
        "algorithm.preset=hint",
        "rollout.hooks=[{type: hint, text: solution_prefix, column: answer, where: response, "
        "unit: characters, keep_sampled: 1, start_fraction: 0.5, end_fraction: 0.0, "
        "anneal_steps: 100}]",
    ],
    "replay": ["algorithm.preset=replay"],
    "greso": ["algorithm.preset=greso"],
    # the greso preset without its selector: dynamic sampling alone, what GRESO saves tokens from
    "greso_off": ["algorithm.preset=greso", "rollout.budget={type: none}"],
    "allocate": ["algorithm.preset=grpo", "rollout.budget={type: allocate}"],
    "opd": ["algorithm.preset=opd"],  # + algorithm.distill.teacher: the grpo run's weights
}


def sampled_tokens(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sum(r.get("rollout/sampled_actions", 0.0) for r in rows if r["split"] == "train")


def run(
    args: argparse.Namespace, console: Console, methods: dict[str, list[str]] = METHODS
) -> dict[str, list[dict]]:
    """Train every method of args.methods (overrides from `methods`) for every seed; results
    are kept in OUT/signal_methods.json as they come."""
    out = Path(args.output_dir)
    store = out / "signal_methods.json"
    results: dict[str, list[dict]] = json.loads(store.read_text()) if store.exists() else {}
    for seed in args.seeds:
        base = load_config(CONFIG, [f"run.seed={seed}", f"run.output_dir={out}"])
        task = build_task(base.task.name, **base.task.options)
        model_dir = warm_up(
            base, task, out / f"warmup-seed{seed}", args.warmup_max_steps, 0.3, console
        )
        for method in args.methods:
            if any(r["seed"] == seed for r in results.get(method, [])):
                continue
            extra = list(methods[method])
            if method == "opd":
                teacher = out / f"grpo-seed{seed}" / "checkpoints"
                folders = sorted(teacher.glob("step-*/model"))
                if not folders:
                    raise SystemExit(f"opd needs the grpo run of seed {seed} first ({teacher})")
                extra.append(f"algorithm.distill.teacher={folders[-1]}")
            cfg = load_config(CONFIG, [
                *extra, f"model.name_or_path={model_dir}",
                f"run.seed={seed}", f"run.output_dir={out}", f"run.name={method}-seed{seed}",
                "run.overwrite=true", "run.console=false", f"train.steps={args.steps}",
                f"eval.every={args.eval_every}", "eval.pass_k=0", f"checkpoint.every={args.steps}",
                f"task.options.n_eval={args.n_eval}", f"task.options.max_train={args.max_train}",
            ])  # fmt: skip
            t0 = time.time()
            res = train(cfg)
            row = {"seed": seed, "before": res["before"]["accuracy"],
                   "after": res["after"]["accuracy"], "seconds": time.time() - t0,
                   "sampled_tokens": sampled_tokens(Path(res["run_dir"])),
                   "run_dir": res["run_dir"]}  # fmt: skip
            results.setdefault(method, []).append(row)
            store.write_text(json.dumps(results, indent=1))
            console.print(
                f"seed {seed} {method:8s} held-out {100 * row['before']:.1f}% -> "
                f"{100 * row['after']:.1f}%, {row['sampled_tokens'] / 1e3:.0f}k sampled tokens "
                f"({row['seconds']:.0f} s)"
            )
    return results


def report(results: dict[str, list[dict]], out: Path, steps: int, baseline: str = "grpo") -> str:
    """The table: mean ± sample std over seeds, and each method's after-accuracy minus the
    baseline's on the same seed (paired: the seeds' warm-ups differ by more than the methods do)."""

    def ms(xs: list[float], digits: int = 1) -> str:
        if not xs:
            return "—"
        if len(xs) == 1:
            return f"{xs[0]:.{digits}f}"
        return f"{statistics.mean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}"

    base = {r["seed"]: r for r in results.get(baseline, [])}
    lines = [f"held-out greedy accuracy (%) after {steps} steps; mean ± sample std over seeds",
             "", f"| method | seeds | before | after | after − {baseline} (same seed) | sampled tokens (k) "
             "| gain per M tokens | seconds/run |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for method, rows in results.items():
        rows = sorted(rows, key=lambda r: r["seed"])
        after = [100 * r["after"] for r in rows]
        paired = [100 * (r["after"] - base[r["seed"]]["after"]) for r in rows if r["seed"] in base]
        gain = [100 * (r["after"] - r["before"]) for r in rows]
        tokens = [r["sampled_tokens"] / 1e3 for r in rows]
        per_m = [g / (t / 1e3) for g, t in zip(gain, tokens)]
        before = statistics.mean(100 * r["before"] for r in rows)
        secs = statistics.mean(r["seconds"] for r in rows)
        lines.append(f"| {method} | {len(rows)} | {before:.1f} | {ms(after)} | "
                     f"{ms(paired) if method != baseline else '—'} | {ms(tokens, 0)} | {ms(per_m)} "
                     f"| {secs:.0f} |")  # fmt: skip
    seeds = sorted({r["seed"] for rows in results.values() for r in rows})
    lines += ["", "| method | " + " | ".join(f"seed {s}" for s in seeds) + " |",
              "|---" * (1 + len(seeds)) + "|"]  # fmt: skip
    for method, rows in results.items():
        by_seed = {r["seed"]: r for r in rows}
        cells = [f"{100 * by_seed[s]['before']:.1f} → {100 * by_seed[s]['after']:.1f}"
                 if s in by_seed else "—" for s in seeds]  # fmt: skip
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    (out / "signal_methods.md").write_text(text + "\n")
    return text


def collect(dirs: list[str], out: Path, name: str) -> dict[str, list[dict]]:
    """The results of several output directories (e.g. one per seed, run side by side), merged
    into out / name."""
    merged: dict[str, list[dict]] = {}
    for d in dirs:
        for method, rows in json.loads((Path(d) / "signal_methods.json").read_text()).items():
            merged.setdefault(method, []).extend(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(merged, indent=1))
    return merged


def main(
    doc: str = __doc__,
    methods: dict[str, list[str]] = METHODS,
    output_dir: str = "runs/signal-methods",
    results_name: str = "signal_methods.json",
    baseline: str = "grpo",
) -> None:
    """The command line of this protocol, for these methods (benchmarks/tree_text.py reuses it)."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--methods", nargs="+", default=list(methods), choices=list(methods))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--n-eval", type=int, default=300)
    p.add_argument(
        "--max-train", type=int, default=640,
        help="RL prompts (the warm-up's first ones): 640 recur every 20 steps, which replay and "
        "the budgets need",
    )  # fmt: skip
    p.add_argument("--warmup-max-steps", type=int, default=3000)
    p.add_argument("--output-dir", default=output_dir)
    p.add_argument(
        "--collect", nargs="+", metavar="DIR",
        help="only report: merge the results of these output directories (e.g. one per seed, run "
        "side by side) into --output-dir",
    )  # fmt: skip
    args = p.parse_args()
    out = Path(args.output_dir)
    if args.collect:
        results = collect(args.collect, out, results_name)
    else:
        torch.set_num_threads(1)
        hf_logging.disable_progress_bar()
        out.mkdir(parents=True, exist_ok=True)
        results = run(args, Console(), methods)
    print(report({m: results[m] for m in methods if m in results}, out, args.steps, baseline))


if __name__ == "__main__":
    main()
