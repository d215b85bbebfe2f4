"""Learning efficiency: held-out accuracy after a fixed number of GRPO steps, grouprl vs TRL.

Task and model: the CPU demo's (grouprl/demos/arithmetic.py): two-digit addition ("37+45=" -> "82") with the
tiny byte-level Qwen2 after its supervised warm-up (cached under runs/, built on first use: about
a minute and a half on a quiet machine). From that same checkpoint each side runs `--steps` GRPO
steps with matched settings: `--prompts` prompts x 8 samples per step, at most 6 new tokens,
temperature 1, mu = 1, beta = 0, group-std advantages (eps 1e-4), clip 0.2, per-sequence token
mean then mean over sequences (TRL loss_type="grpo" = grouprl preset grpo), AdamW at lr 1e-3
decayed linearly to 0, gradient clipping at 1.0, float32; the reward is the task's exact-answer
accuracy function on both sides. TRL (pinned, from .venv-bench) trains with GRPOTrainer; grouprl
with its own loop (grouprl.train.train). Both are then evaluated by the same code: greedy decoding
on the first `--eval` held-out problems, accuracy = exact answers (grouprl.workloads.text.evaluate).
Runs alternate grouprl, TRL per seed, each in a fresh process.

    .venv/bin/python benchmarks/learning_vs_trl.py [--seeds 0,1,2 --steps 60 --threads 2]

Prints mean and spread (sample std over seeds) of held-out accuracy per side and the difference;
writes learning_vs_trl.json and learning_vs_trl.png into --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SCRIPT = Path(__file__).resolve()
GROUP, MAX_NEW = 8, 6


def warmup_dir() -> Path:
    """The demo's cached warm-up checkpoint (the same folder `python -m grouprl.demos.arithmetic` uses)."""
    from rich.console import Console

    from grouprl.config.loading import load_config
    from grouprl.demos.arithmetic import CONFIG, MODEL, warm_up
    from grouprl.envs.tasks import build_task

    cfg = load_config(CONFIG, [])
    steps, target = (
        3000,
        0.3,
    )  # demos/arithmetic.py's defaults, so the cache is shared with the demo
    recipe = [cfg.task.model_dump(), MODEL, cfg.run.seed, steps, target]
    key = hashlib.sha1(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]
    out = C.ROOT / cfg.run.output_dir / f"{cfg.run.name}-warmup-{key}"
    out.parent.mkdir(parents=True, exist_ok=True)
    task = build_task(cfg.task.name, **cfg.task.options)
    return warm_up(cfg, task, out, steps, target, Console(stderr=True))


def _task_and_reward():
    from grouprl.config.loading import load_config
    from grouprl.demos.arithmetic import CONFIG
    from grouprl.envs.tasks import build_task

    cfg = load_config(CONFIG, [])
    task = build_task(cfg.task.name, **cfg.task.options)
    return task, task.reward_fns["accuracy"]


def _evaluate(model: Any, tokenizer: Any, n_eval: int) -> float:
    from grouprl.policies.text.causal_lm import CausalLMPolicy
    from grouprl.policies.text.engines.base import SamplingParams
    from grouprl.workloads.text import evaluate

    task, accuracy = _task_and_reward()
    policy = CausalLMPolicy(model, tokenizer)
    metrics, _ = evaluate(
        policy, task.eval[:n_eval], {"accuracy": accuracy}, SamplingParams(max_new_tokens=MAX_NEW),
        batch_size=256,
    )  # fmt: skip
    return float(metrics["accuracy"])


def run_grouprl(a: argparse.Namespace) -> dict[str, Any]:
    from grouprl.config.loading import load_config
    from grouprl.demos.arithmetic import CONFIG
    from grouprl.train import train

    out = tempfile.mkdtemp(prefix="grouprl-learn-")
    overrides = [
        f"model.name_or_path={a.model_dir}", f"run.seed={a.seed}", f"run.output_dir={out}",
        "run.console=false", f"train.steps={a.steps}", f"train.lr={a.lr}",
        "train.lr_schedule=linear", f"rollout.prompts_per_step={a.prompts}",
        f"rollout.group_size={GROUP}", f"rollout.max_new_tokens={MAX_NEW}", "eval.every=0",
        f"eval.max_examples={a.eval}", "eval.pass_k=0", "checkpoint.every=0",
    ]  # fmt: skip
    if a.engine:
        overrides.append(f"rollout.engine={a.engine}")
    cfg = load_config(CONFIG, overrides)
    t0 = time.perf_counter()
    result = train(cfg)
    seconds = time.perf_counter() - t0
    return {"before": result["before"]["accuracy"], "after": result["after"]["accuracy"],
            "train_s": seconds, "engine": cfg.rollout.engine}  # fmt: skip


def run_trl(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    task, accuracy = _task_and_reward()
    tokenizer = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    data = Dataset.from_list(
        [{"prompt": ex["prompt"], "answer": ex["answer"]} for ex in task.train]
    )

    def exact_answer(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [float(x) if x is not None else 0.0 for x in accuracy(completions, answer=answer)]

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-learn-"),
        per_device_train_batch_size=a.prompts * GROUP, gradient_accumulation_steps=1,
        num_generations=GROUP, max_completion_length=MAX_NEW, temperature=1.0, top_p=1.0,
        top_k=0, num_iterations=1, beta=0.0, epsilon=0.2, loss_type="grpo",
        scale_rewards="group", learning_rate=a.lr, lr_scheduler_type="linear", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, max_steps=a.steps, seed=a.seed, use_cpu=True,
        bf16=False, fp16=False, gradient_checkpointing=False, logging_steps=10,
        report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=[exact_answer], args=args, train_dataset=data,
        processing_class=tokenizer,
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    after = _evaluate(trainer.model, tokenizer, a.eval)
    return {"after": after, "train_s": seconds, "trl": trl.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=60, help="GRPO steps per run")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (x 8 samples)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval", type=int, default=200, help="held-out problems evaluated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engine", default="", help="grouprl rollout.engine (default: config default)")
    p.add_argument("--out", type=Path, default=C.RESULTS)
    p.add_argument("--python", default="", help="interpreter with TRL (default: .venv-bench)")
    p.add_argument("--worker", choices=["grouprl", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        C.worker_setup(a.threads)
        C.write_json(a.result, run_grouprl(a) if a.worker == "grouprl" else run_trl(a))
        return 0

    seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    python = a.python or C.bench_python()
    C.worker_setup(a.threads)  # the warm-up (if not cached yet) runs in this process
    info = C.machine_info(a.threads)
    print(f"machine: {C.describe_machine(info)}")
    model_dir = warmup_dir()
    runs: dict[str, list[dict]] = {"grouprl": [], "trl": []}
    for seed in seeds:
        for side in ("grouprl", "trl"):
            args = ["--worker", side, "--model-dir", str(model_dir), "--seed", str(seed),
                    "--steps", str(a.steps), "--prompts", str(a.prompts), "--lr", str(a.lr),
                    "--eval", str(a.eval), "--threads", str(a.threads)]  # fmt: skip
            if a.engine:
                args += ["--engine", a.engine]
            t0 = time.perf_counter()
            r = C.run_worker(python, SCRIPT, args)
            runs[side].append({"seed": seed, **r})
            print(f"  seed {seed} {side}: held-out accuracy {100 * r['after']:.1f}% "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    report(runs, info, a, model_dir)
    return 0


def report(runs: dict[str, list[dict]], info: dict, a: argparse.Namespace, model_dir: Path) -> None:
    before = runs["grouprl"][0]["before"]
    summary = {}
    for side, rs in runs.items():
        acc = [r["after"] for r in rs]
        summary[side] = {"mean": sum(acc) / len(acc), "std": C.spread(acc), "runs": acc,
                         "train_s_median": C.median([r["train_s"] for r in rs])}  # fmt: skip
    diff = summary["grouprl"]["mean"] - summary["trl"]["mean"]
    rows = [[side, f"{100 * s['mean']:.1f}%", f"{100 * s['std']:.1f}",
             ", ".join(f"{100 * x:.1f}" for x in s["runs"]), f"{s['train_s_median']:.0f}"]
            for side, s in summary.items()]  # fmt: skip
    print()
    print(f"held-out accuracy before GRPO: {100 * before:.1f}% (the shared warm-up checkpoint); "
          f"after {a.steps} steps of {a.prompts}x{GROUP} samples:")  # fmt: skip
    print(C.format_table(["side", "accuracy mean", "std (pp)", "per seed", "train s (median)"],
                         rows))  # fmt: skip
    print(f"grouprl - TRL: {100 * diff:+.1f} percentage points")
    warn = C.warn_if_loaded(info)
    if warn:
        print(warn)
    results = {"machine": info, "settings": vars(a) | {"out": str(a.out)}, "model_dir": str(model_dir),
               "before": before, "runs": runs, "summary": summary, "difference": diff,
               "trl_version": runs["trl"][0].get("trl"),
               "grouprl_engine": runs["grouprl"][0].get("engine")}  # fmt: skip
    C.write_json(a.out / "learning_vs_trl.json", results)
    panels = [("held-out accuracy", {side: [s["mean"]] for side, s in summary.items()},
               [f"after {a.steps} steps"])]  # fmt: skip
    errors = [{side: [s["std"]] for side, s in summary.items()}]
    C.bar_png(a.out / "learning_vs_trl.png", panels,
              f"arithmetic, {len(runs['trl'])} seeds (before: {100 * before:.1f}%)", errors)  # fmt: skip
    print(f"wrote {a.out / 'learning_vs_trl.json'} and {a.out / 'learning_vs_trl.png'}")
    print(f"learning_difference grouprl-TRL: {100 * diff:+.1f} pp")


if __name__ == "__main__":
    sys.exit(main())
