"""The on-policy distillation demo: the arithmetic demo's GRPO-trained model teaches its own
warm-up starting point, with the `opd` preset (reverse KL on the student's samples, no reward).

1. The warm-up checkpoint of grouprl/demos/arithmetic.py (same recipe, same cache folder).
2. The teacher: the final checkpoint's model folder of the GRPO demo run (configs/text/
   arithmetic_demo.yaml, run.name arithmetic-demo) when that run finished from this warm-up;
   otherwise that GRPO run is trained here first (its steps: --teacher-steps, default the
   config's train.steps).
3. The student: the warm-up again, trained --steps steps with algorithm.preset=opd and
   algorithm.distill.teacher=<the teacher folder>; then held-out accuracy of student before /
   after and of the teacher.

    python -m grouprl.demos.distill [--steps N] [--teacher-steps N] [--estimator k1|k3|full]
                                    [dotted.key=value ...]   (overrides: both runs)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import yaml
from rich.console import Console
from rich.table import Table
from transformers.utils import logging as hf_logging

from grouprl.api import run_evaluation
from grouprl.config.loading import load_config
from grouprl.demos.arithmetic import CONFIG, cached_warm_up
from grouprl.envs.tasks import build_task
from grouprl.runtime.checkpoint import CheckpointManager
from grouprl.train import train


def finished_teacher(run_dir: Path, warm_dir: Path, steps: int) -> Path | None:
    """The model folder of run_dir's final checkpoint when that run trained `steps` steps from
    the warm-up folder `warm_dir`; None otherwise (no run, another start, unfinished)."""
    config = run_dir / "config.resolved.yaml"
    if not (run_dir / "checkpoints").is_dir() or not config.exists():
        return None
    resolved = yaml.safe_load(config.read_text())
    start = Path(str(resolved.get("model", {}).get("name_or_path", ""))).resolve()
    latest = CheckpointManager(run_dir).latest()
    if latest is None or start != warm_dir.resolve() or int(latest.name.split("-")[-1]) != steps:
        return None
    return latest / "model" if (latest / "model" / "config.json").exists() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grouprl.demos.distill", description=__doc__)
    parser.add_argument("--warmup-max-steps", type=int, default=3000)
    parser.add_argument("--warmup-target", type=float, default=0.3)
    parser.add_argument("--teacher-steps", type=int, default=None, help="GRPO steps (teacher)")
    parser.add_argument("--steps", type=int, default=200, help="distillation steps (student)")
    parser.add_argument(
        "--estimator", choices=["k1", "k3", "full"], default="k1",
        help="algorithm.distill.estimator of the student's run (the opd preset's: k1)",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides (both runs)")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    hf_logging.disable_progress_bar()
    console = Console()
    t_start = time.time()
    cfg = load_config(CONFIG, args.overrides)
    task = build_task(cfg.task.name, **cfg.task.options)
    warm_dir = cached_warm_up(cfg, task, args.warmup_max_steps, args.warmup_target, console)

    teacher_steps = args.teacher_steps or cfg.train.steps
    grpo = [*args.overrides, f"model.name_or_path={warm_dir}", f"train.steps={teacher_steps}"]
    grpo_cfg = load_config(CONFIG, grpo)
    teacher = finished_teacher(Path(grpo_cfg.run_dir), warm_dir, teacher_steps)
    t0 = time.time()
    if teacher is not None:
        console.print(f"reusing the GRPO run's final checkpoint as the teacher: {teacher}")
    else:
        console.print(f"training the teacher: GRPO for {teacher_steps} steps from the warm-up")
        train(load_config(CONFIG, [*grpo, "run.overwrite=true"]))
        teacher = finished_teacher(Path(grpo_cfg.run_dir), warm_dir, teacher_steps)
        if teacher is None:
            raise RuntimeError(f"the GRPO run in {grpo_cfg.run_dir} left no final checkpoint")
    teacher_s = time.time() - t0
    teacher_eval, _ = run_evaluation(load_config(CONFIG, [*grpo, f"model.name_or_path={teacher}"]))

    student = [
        *args.overrides, f"model.name_or_path={warm_dir}", f"train.steps={args.steps}",
        f"run.name=arithmetic-distill-{args.estimator}", "run.overwrite=true", "algorithm.preset=opd",
        f"algorithm.distill.teacher={teacher}", f"algorithm.distill.estimator={args.estimator}",
        f"eval.every={max(args.steps // 4, 1)}",
        f"checkpoint.every={max(args.steps // 4, 1)}",
    ]  # fmt: skip
    t0 = time.time()
    result = train(load_config(CONFIG, student))
    student_s = time.time() - t0
    before, after = result["before"], result["after"]

    n = len(task.eval[: cfg.eval.max_examples])
    table = Table(title=f"held-out split ({n} problems)")
    for col in ("metric", "student before", "student after OPD", "teacher (GRPO)"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for key in after:
        fmt = (lambda v: f"{v:.2f}") if key == "response_length" else (lambda v: f"{100 * v:.1f}%")
        table.add_row(key, fmt(before[key]), fmt(after[key]), fmt(teacher_eval.get(key, 0.0)))
    console.print(table)
    console.print(
        f"teacher: {teacher_s:.0f} s; distillation: {args.steps} steps in {student_s:.0f} s"
    )
    console.print(f"curves: {Path(result['run_dir']) / 'curves.png'}")
    print(f"held-out accuracy student before: {100 * before['accuracy']:.1f}%")
    print(f"held-out accuracy student after: {100 * after['accuracy']:.1f}%")
    print(f"held-out accuracy teacher: {100 * teacher_eval['accuracy']:.1f}%")
    print(f"wall time: {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
