"""The VLM demo: a tiny Qwen2-VL learns to answer questions about rendered shapes with GRPO, on CPU.

1. Build a Qwen2-VL-2B-Instruct replica grown a little (grouprl/replicas/vision.py: the real
   classes, image processor, tokenizer and chat template; random weights): nothing downloaded.
2. Supervised warm-up on the visual_shapes task's training questions (count, colour, position,
   which is larger), stopped early on purpose once a share of the training questions is answered
   exactly, so the model knows the answer format and some of the answers (saved, cached).
3. GRPO with configs/vlm/shapes_demo.yaml from that checkpoint (the `vlm` workload), then the
   held-out accuracy before and after, the curves (curves.png) and samples.md: the held-out
   images with the questions, the model's answers and the right ones.

    python -m grouprl.demos.vlm [dotted.key=value ...]   e.g. train.steps=20 algorithm.preset=dr_grpo
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from transformers.utils import logging as hf_logging

from grouprl.config.loading import load_config
from grouprl.demos.vlm_sft import encode, fine_tune
from grouprl.envs.tasks import build_task
from grouprl.envs.tasks.visual_shapes import DATA_VERSION
from grouprl.policies.vision.processing import VisionProcessor
from grouprl.replicas.vision import build_qwen2_vl
from grouprl.train import train

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "vlm" / "shapes_demo.yaml"
# the replica's 2 x 64 decoder and vision tower, grown to 2 x 128 (heads of 32 as in the replica)
TEXT_SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2)  # fmt: skip
VISION_SIZES = dict(depth=2, embed_dim=128, num_heads=4)
# A random vision tower drawn at the config's initializer_range (0.02) maps every image to nearly
# the same features (measured: their spread across images is ~2% of their norm), and the tiny
# decoder then learns nothing about the images in the warm-up's budget; drawn 5x wider, the
# warm-up learns count / colour / larger questions (a stand-in for a pretrained tower).
VISION_INIT_SCALE = 5.0


def build_model(folder: Path, seed: int) -> tuple[Any, VisionProcessor]:
    """The grown Qwen2-VL replica written to `folder`, loaded in float32 (its vision tower's weight
    matrices scaled by VISION_INIT_SCALE), and its processor."""
    from transformers import AutoModelForImageTextToText

    build_qwen2_vl(folder, text_sizes=TEXT_SIZES, vision_sizes=VISION_SIZES)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for p in model.model.visual.parameters():
            if p.dim() > 1:  # weight matrices and the patch convolution, not norms or biases
                p.mul_(VISION_INIT_SCALE)
    return model, VisionProcessor.from_pretrained(folder)


def warm_up(
    cfg: Any, task: Any, out_dir: Path, steps: int, target: float, console: Console
) -> Path:
    """Build the grown replica, train it on the task's answers until `target` of 200 training
    questions are answered exactly (at most `steps` batches of 32), save it (float32)."""
    if (out_dir / "config.json").exists():
        console.print(f"reusing the warm-up checkpoint in {out_dir}")
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model, processor = build_model(tmp, cfg.run.seed)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"supervised warm-up of a {n_params / 1e6:.2f}M-parameter Qwen2-VL until "
        f"{100 * target:.0f}% of training questions are right (at most {steps} batches)"
    )
    t0 = time.time()
    ran, acc = fine_tune(
        model, encode(processor, task.train), processor.tokenizer.pad_token_id,
        max_steps=steps, target_accuracy=target, seed=cfg.run.seed,
        on_check=lambda s, loss, a: console.print(
            f"  warm-up step {s}: loss {loss:.3f}, greedy accuracy on train questions {100 * a:.0f}%"
        ),
    )  # fmt: skip
    console.print(f"warm-up stopped after {ran} batches ({time.time() - t0:.0f} s), train "
                  f"accuracy {100 * (acc or 0):.0f}%")  # fmt: skip
    model.save_pretrained(tmp)  # float32 weights over the replica's bf16 ones
    tmp.rename(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grouprl.demos.vlm", description=__doc__)
    parser.add_argument("--warmup-max-steps", type=int, default=1500)
    parser.add_argument("--warmup-target", type=float, default=0.6)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    hf_logging.disable_progress_bar()
    console = Console()
    t_start = time.time()
    cfg = load_config(CONFIG, args.overrides)
    recipe = [cfg.task.model_dump(), TEXT_SIZES, VISION_SIZES, VISION_INIT_SCALE, DATA_VERSION,
              cfg.run.seed, args.warmup_max_steps, args.warmup_target]  # fmt: skip
    key = hashlib.sha1(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]
    warm_dir = Path(cfg.run.output_dir) / f"{cfg.run.name}-warmup-{key}"
    warm_dir.parent.mkdir(parents=True, exist_ok=True)
    task = build_task(cfg.task.name, **cfg.task.options)
    model_dir = warm_up(cfg, task, warm_dir, args.warmup_max_steps, args.warmup_target, console)
    cfg = load_config(
        CONFIG, [*args.overrides, f"model.name_or_path={model_dir}", "run.overwrite=true"]
    )
    t0 = time.time()
    result = train(cfg)
    before, after, run_dir = result["before"], result["after"], Path(result["run_dir"])
    table = Table(title=f"held-out questions ({len(task.eval[: cfg.eval.max_examples])})")
    table.add_column("metric")
    table.add_column("before GRPO", justify="right")
    table.add_column("after GRPO", justify="right")
    for name in after:
        fmt = (lambda v: f"{v:.2f}") if name == "response_length" else (lambda v: f"{100 * v:.1f}%")
        table.add_row(name, fmt(before[name]), fmt(after[name]))
    console.print(table)
    console.print(f"GRPO: {cfg.train.steps} steps in {time.time() - t0:.0f} s")
    console.print(f"curves: {run_dir / 'curves.png'}")
    console.print(f"samples (images, questions, answers): {run_dir / 'samples.md'}")
    print(f"held-out accuracy before: {100 * before['accuracy']:.1f}%")
    print(f"held-out accuracy after: {100 * after['accuracy']:.1f}%")
    print(f"total minutes: {(time.time() - t_start) / 60:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
