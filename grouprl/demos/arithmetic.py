"""The CPU demo: a tiny Qwen2 learns two-digit addition with GRPO, visibly, in a few minutes.

1. Build a tiny Qwen2 (random weights) and a character-level tokenizer in code: nothing downloaded.
2. Supervised warm-up on a few hundred batches, stopped early on purpose, so the model knows the
   answer format but is right only about a third of the time (saved as a save_pretrained folder).
3. GRPO with configs/text/arithmetic_demo.yaml from that checkpoint, then a before/after table.

    python -m grouprl.demos.arithmetic [dotted.key=value ...]   e.g. algorithm.preset=dr_grpo train.steps=50
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers.utils import logging as hf_logging

from grouprl.config.loading import load_config
from grouprl.demos.sft import supervised_warmup
from grouprl.envs.tasks import build_task
from grouprl.policies.text.tiny import char_tokenizer, tiny_qwen2
from grouprl.train import train

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "text" / "arithmetic_demo.yaml"
MODEL = dict(hidden_size=128, layers=2, heads=4, kv_heads=2, intermediate=256, max_position=64)


def warm_up(cfg, task, out_dir: Path, steps: int, target: float, console: Console) -> Path:
    """Build the tiny model, run the supervised warm-up on the task's train split, save it."""
    if (out_dir / "config.json").exists():
        console.print(f"reusing the warm-up checkpoint in {out_dir}")
        return out_dir
    tokenizer = char_tokenizer()
    model = tiny_qwen2(tokenizer, seed=cfg.run.seed, **MODEL)
    t0 = time.time()
    n_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"supervised warm-up of a {n_params / 1e6:.2f}M-parameter Qwen2 until {100 * target:.0f}% "
        f"of training problems are right (at most {steps} batches)"
    )
    losses, acc = supervised_warmup(
        model, tokenizer, task.train, max_steps=steps, target_accuracy=target,
        seed=cfg.run.seed, on_check=lambda s, loss, a: console.print(
            f"  warm-up step {s}: loss {loss:.3f}, greedy accuracy on train problems {100 * a:.0f}%"
        ),
    )  # fmt: skip
    console.print(
        f"warm-up stopped after {len(losses)} batches ({time.time() - t0:.0f} s): loss "
        f"{losses[-1]:.2f}, train accuracy {100 * (acc or 0):.0f}%"
    )
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir


def cached_warm_up(cfg, task, max_steps: int, target: float, console: Console) -> Path:
    """The warm-up folder of this config, made once: its name carries everything it depends on
    (the task, the model sizes, the seed, the warm-up's budget and target), so every demo that
    warms up the same way (grouprl.demos.distill) reuses it."""
    recipe = [cfg.task.model_dump(), MODEL, cfg.run.seed, max_steps, target]
    key = hashlib.sha1(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]
    warm_dir = Path(cfg.run.output_dir) / f"{cfg.run.name}-warmup-{key}"
    warm_dir.parent.mkdir(parents=True, exist_ok=True)
    return warm_up(cfg, task, warm_dir, max_steps, target, console)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grouprl.demos.arithmetic", description=__doc__)
    parser.add_argument("--warmup-max-steps", type=int, default=3000)
    parser.add_argument("--warmup-target", type=float, default=0.3)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    hf_logging.disable_progress_bar()
    console = Console()
    cfg = load_config(CONFIG, args.overrides)
    task = build_task(cfg.task.name, **cfg.task.options)  # built once: warm-up data and the count
    model_dir = cached_warm_up(cfg, task, args.warmup_max_steps, args.warmup_target, console)
    cfg = load_config(
        CONFIG, [*args.overrides, f"model.name_or_path={model_dir}", "run.overwrite=true"]
    )
    t0 = time.time()
    result = train(cfg)
    before, after = result["before"], result["after"]
    table = Table(title=f"held-out split ({len(task.eval[: cfg.eval.max_examples])} problems)")
    table.add_column("metric")
    table.add_column("before GRPO", justify="right")
    table.add_column("after GRPO", justify="right")
    for key in after:
        fmt = (lambda v: f"{v:.2f}") if key == "response_length" else (lambda v: f"{100 * v:.1f}%")
        table.add_row(key, fmt(before[key]), fmt(after[key]))
    console.print(table)
    console.print(f"GRPO: {cfg.train.steps} steps in {time.time() - t0:.0f} s")
    console.print(f"curves: {Path(result['run_dir']) / 'curves.png'}")
    console.print(f"samples: {Path(result['run_dir']) / 'samples.md'}")
    print(f"held-out accuracy before: {100 * before['accuracy']:.1f}%")
    print(f"held-out accuracy after: {100 * after['accuracy']:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
