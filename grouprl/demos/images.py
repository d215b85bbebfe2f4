"""The CPU image demo: a tiny flow-matching model draws coloured shapes; Flow-GRPO makes it draw the
prompt's colour over more of the image, visibly, in a few minutes.

1. Pretrain a small class-conditional velocity model on synthetic 16x16 coloured shapes with plain
   flow matching (grouprl/demos/pretrain.py), cached under run.output_dir in a folder keyed by a hash
   of every pretraining setting; nothing is downloaded.
2. Fine-tune it (all weights) with the flow_grpo preset through configs/diffusion/shapes_flow_grpo.yaml
   against the weight-free color_area reward (envs/rewards/shapes.py), from that checkpoint.
3. Print the held-out reward before and after; the run directory holds the reward curves
   (curves.png), the image grids of every evaluation (images/, the same prompts and seeds each time)
   and before_after.png (the first and the last grid side by side).

    python -m grouprl.demos.images [dotted.key=value ...]   e.g. train.steps=40 diffusion.noise_level=0.9
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from grouprl.config.loading import load_config
from grouprl.demos.pretrain import PretrainSettings, cached_pretrain
from grouprl.train import train

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "diffusion" / "shapes_flow_grpo.yaml"


def side_by_side(left: Path, right: Path, out: Path, titles: tuple[str, str]) -> Path:
    """Two PNGs next to each other under their titles (the before / after grids)."""
    from PIL import Image, ImageDraw

    a, b = Image.open(left).convert("RGB"), Image.open(right).convert("RGB")
    gap, head = 16, 18
    canvas = Image.new("RGB", (a.width + gap + b.width, head + max(a.height, b.height)), "white")
    canvas.paste(a, (0, head))
    canvas.paste(b, (a.width + gap, head))
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 3), titles[0], fill="black")
    draw.text((a.width + gap + 4, 3), titles[1], fill="black")
    canvas.save(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grouprl.demos.images", description=__doc__)
    parser.add_argument("--pretrain-steps", type=int, default=PretrainSettings.steps)
    parser.add_argument("--config", default=str(CONFIG), help="the RL config (YAML)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    args = parser.parse_args(argv)
    console = Console()
    t_start = time.time()
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(cfg.run.num_threads or min(2, torch.get_num_threads()))  # pretraining too
    settings = PretrainSettings(steps=args.pretrain_steps, seed=cfg.run.seed)
    weights = cached_pretrain(settings, cfg.run.output_dir, log=console.print)
    t_pre = time.time() - t_start
    cfg = load_config(
        args.config, [*args.overrides, f"model.weights={weights}", "run.overwrite=true"]
    )
    t0 = time.time()
    result = train(cfg)
    t_rl = time.time() - t0
    before, after, run_dir = result["before"], result["after"], Path(result["run_dir"])
    grids = sorted((run_dir / "images").glob("step-*.png"))
    pair = side_by_side(grids[0], grids[-1], run_dir / "before_after.png",
                        ("before Flow-GRPO", f"after {cfg.train.steps} steps"))  # fmt: skip
    table = Table(title="held-out images (the same prompts and seeds before and after)")
    table.add_column("metric")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for key in after:
        table.add_row(key, f"{before[key]:.4f}", f"{after[key]:.4f}")
    console.print(table)
    console.print(
        f"pretraining (or cache) {t_pre:.0f} s, Flow-GRPO {cfg.train.steps} steps {t_rl:.0f} s"
    )
    console.print(f"curves: {run_dir / 'curves.png'}")
    console.print(f"before / after grids: {pair}")
    print(f"held-out reward before: {before['reward']:.4f}")
    print(f"held-out reward after: {after['reward']:.4f}")
    print(f"total minutes: {(time.time() - t_start) / 60:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
