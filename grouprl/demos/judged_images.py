"""Cross-modal: Flow-GRPO on the shapes model with a VLM judge beside the area reward.

The image demo's reward, color_area, pays for area in the prompt's colour; after a few dozen
steps its triangles drift towards blobs (reward hacking in miniature). This demo asks whether a
vision-language judge, asked "Does this image show a {prompt}?", curbs that:

1. The shapes flow model is pretrained (or taken from the image demo's cache).
2. A judge is trained: the Qwen2-VL replica (grown as in the VLM demo) fine-tuned to answer yes /
   no to "Does this image show a <colour> <shape>?" about 16x16 shapes images, beside captions
   ("What is in the image?" -> "red circle") of the same images, until 90% of 200 training
   examples are answered exactly (at most 4000 batches); its accuracy on 600 held-out yes / no
   questions is printed. Yes: an image of that class (envs/shapes.py, the pretraining
   distribution); no, in equal parts: the same kind of
   image asked about another colour, another shape, or an irregular blob of the prompt's colour
   (a union of discs). The judge never sees a big or a small shape labelled by its size, so it
   judges identity (colour and shape), not area. Cached like the pretraining.
3. Two Flow-GRPO runs of configs/diffusion/shapes_flow_grpo_judged.yaml (the image demo's
   settings) from the same checkpoint and seeds: the judge's weight 0 (color_area alone; the
   judge's score is logged), and its weight from the config. Both runs' held-out images are scored
   with both rewards before and after; the grids go side by side into judged_before_after.png.

    python -m grouprl.demos.judged_images [dotted.key=value ...]   overrides for both runs
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
from PIL import Image
from rich.console import Console
from rich.table import Table
from transformers.utils import logging as hf_logging

from grouprl.config.loading import load_config
from grouprl.demos.images import side_by_side
from grouprl.demos.pretrain import PretrainSettings, cached_pretrain
from grouprl.demos.vlm import build_model
from grouprl.demos.vlm_sft import encode, exact_match, fine_tune
from grouprl.envs.shapes import (
    COLORS,
    DATA_VERSION,
    SHAPES,
    SIZE,
    class_names,
    render,
    sample_batch,
)
from grouprl.policies.vision.judge import DEFAULT_QUESTION
from grouprl.train import train

CAPTION = "What is in the image?"
JUDGED = (
    Path(__file__).resolve().parents[2] / "configs" / "diffusion" / "shapes_flow_grpo_judged.yaml"
)
JUDGE_RECIPE = dict(n_train=6000, n_captions=6000, n_probe=600, steps=4000, lr=1e-3,
                    target=0.9, seed=0)  # fmt: skip


def _pil(image: torch.Tensor) -> Image.Image:
    """Float[3, H, W] in [0, 1] -> an RGB PIL image."""
    return Image.fromarray((image.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy())


def _blobs(labels: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Irregular blobs in each label's colour: the union of 3 discs of random centres and radii
    (the circle masks of envs/shapes.render, composited), Float[B, 3, SIZE, SIZE]."""
    n = len(labels)
    circles = (labels // len(SHAPES)) * len(SHAPES)  # [B] the same colour, shape id 0 (circle)
    out = None
    for _ in range(3):
        r = 1.5 + 2.5 * torch.rand(n, generator=g)  # [B]
        cx, cy = (3 + (SIZE - 6) * torch.rand(n, generator=g) for _ in range(2))  # [B] each
        layer = render(circles, cx, cy, r)  # [B, 3, S, S]
        out = layer if out is None else torch.maximum(out, layer)  # colour over the background
    return out


def caption_examples(n: int, seed: int) -> list[dict]:
    """n "What is in the image?" -> "<colour> <shape>" examples of the pretraining distribution:
    trained beside the yes / no questions, they make the tiny judge's image features carry the
    shape (on yes / no questions alone it stayed at chance, 46-54% after 2000 batches)."""
    g = torch.Generator().manual_seed(seed)
    images, labels = sample_batch(n, generator=g)  # [n, 3, S, S], [n]
    names = class_names()
    return [
        {"prompt": [{"role": "user", "content": [{"type": "image", "image": _pil(images[i])},
                                                 {"type": "text", "text": CAPTION}]}],
         "answer": names[int(labels[i])]}
        for i in range(n)
    ]  # fmt: skip


def judge_examples(n: int, seed: int) -> list[dict]:
    """n yes / no questions about shapes images (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    names, n_shapes = class_names(), len(SHAPES)
    images, labels = sample_batch(n, generator=g)  # [n, 3, S, S], [n]
    blobs = _blobs(labels, g)
    kinds = torch.randint(0, 6, (n,), generator=g)  # 0-2: yes; 3: colour; 4: shape; 5: blob
    other = torch.randint(1, len(COLORS), (n,), generator=g)  # an offset to another colour ...
    other_shape = torch.randint(1, n_shapes, (n,), generator=g)  # ... or another shape
    out = []
    for i in range(n):
        label, kind, image, answer = int(labels[i]), int(kinds[i]), images[i], "no"
        colour, shape = divmod(label, n_shapes)
        if kind <= 2:
            asked, answer = label, "yes"
        elif kind == 3:
            asked = ((colour + int(other[i])) % len(COLORS)) * n_shapes + shape
        elif kind == 4:
            asked = colour * n_shapes + (shape + int(other_shape[i])) % n_shapes
        else:
            asked, image = label, blobs[i]
        question = DEFAULT_QUESTION.format(prompt=names[asked])
        prompt = [{"role": "user", "content": [{"type": "image", "image": _pil(image)},
                                               {"type": "text", "text": question}]}]  # fmt: skip
        out.append({"prompt": prompt, "answer": answer})
    return out


def cached_judge(root: Path, console: Console) -> Path:
    """The shapes judge folder under `root` (trained now unless cached; the name hashes the recipe
    and the data version)."""
    key = hashlib.sha1(json.dumps([JUDGE_RECIPE, DATA_VERSION]).encode()).hexdigest()[:8]
    out = root / f"shapes-judge-{key}"
    if (out / "config.json").exists():
        console.print(f"reusing the shapes judge in {out}")
        return out
    r, t0 = JUDGE_RECIPE, time.time()
    tmp = out.with_name(out.name + ".tmp")
    model, processor = build_model(tmp, r["seed"])
    pad = processor.tokenizer.pad_token_id
    rows = encode(processor, judge_examples(r["n_train"], r["seed"])
                  + caption_examples(r["n_captions"], r["seed"] + 2))  # fmt: skip
    probe = encode(processor, judge_examples(r["n_probe"], r["seed"] + 1))  # held out
    console.print(f"training the shapes judge (at most {r['steps']} batches)")
    ran, _ = fine_tune(
        model, rows, pad, max_steps=r["steps"], target_accuracy=r["target"], seed=r["seed"],
        lr=r["lr"], check_every=250,
        on_check=lambda s, loss, a: console.print(f"  judge step {s}: loss {loss:.3f}, "
                                                  f"train accuracy {100 * a:.0f}%"),
    )  # fmt: skip
    held_out = exact_match(model, probe, pad)
    console.print(f"judge: {ran} batches in {time.time() - t0:.0f} s, held-out yes/no accuracy "
                  f"{100 * held_out:.1f}% ({len(probe)} questions)")  # fmt: skip
    model.save_pretrained(tmp)
    (tmp / "judge.json").write_text(json.dumps({**r, "batches": ran, "held_out": held_out}))
    tmp.rename(out)
    return out


def _scores(run_dir: Path) -> dict[str, dict[str, float]]:
    """Held-out metrics per evaluation step of a run (metrics.jsonl's eval/* rows)."""
    out: dict[str, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        evals = {k[5:]: v for k, v in row.items() if k.startswith("eval/")}
        if evals:
            out[str(row.get("step"))] = evals
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grouprl.demos.judged_images", description=__doc__
    )
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides for both runs")
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()
    console, t_start = Console(), time.time()
    cfg = load_config(JUDGED, args.overrides)
    torch.set_num_threads(cfg.run.num_threads or min(2, torch.get_num_threads()))
    root = Path(cfg.run.output_dir)
    weights = cached_pretrain(PretrainSettings(seed=cfg.run.seed), root, log=console.print)
    judge = cached_judge(root, console)
    runs: dict[str, Any] = {}
    # both runs score every image with both rewards; the area-only run gives the judge weight 0
    # (logged, not trained on), so the two runs differ only in that weight
    weight = load_config(JUDGED, args.overrides).rewards[1].weight
    for name, judge_weight in (("area only", 0.0), ("area + judge", weight)):
        rewards = (f"rewards=[{{name: color_area}}, {{name: vlm_judge, weight: {judge_weight}, "
                   f"options: {{model: {judge}}}}}]")  # fmt: skip
        overrides = [*args.overrides, f"model.weights={weights}", "run.overwrite=true", rewards,
                     f"run.name=shapes-{'judged' if judge_weight else 'area'}"]  # fmt: skip
        t0 = time.time()
        runs[name] = train(load_config(JUDGED, overrides))
        console.print(f"{name}: Flow-GRPO in {time.time() - t0:.0f} s")
    keys = ("color_area", "vlm_judge")
    table = Table(title="held-out images (12 prompts x 4 seeds): before -> after")
    table.add_column("run")
    for key in keys:
        table.add_column(key, justify="right")
    for name, result in runs.items():
        table.add_row(
            name, *[f"{result['before'][k]:.3f} -> {result['after'][k]:.3f}" for k in keys]
        )
    console.print(table)
    grids = {n: sorted((Path(r["run_dir"]) / "images").glob("step-*.png")) for n, r in runs.items()}
    first = grids["area only"][0]  # the same weights, prompts and seeds in both runs
    area = side_by_side(first, grids["area only"][-1], root / "area_pair.png",
                        ("before", "after: color_area only"))  # fmt: skip
    judged = side_by_side(first, grids["area + judge"][-1], root / "judged_pair.png",
                          ("before", "after: color_area + vlm_judge"))  # fmt: skip
    out = side_by_side(area, judged, root / "judged_before_after.png", ("", ""))
    for name, result in runs.items():
        for key in keys:
            print(
                f"{name}: held-out {key} {result['before'][key]:.4f} -> {result['after'][key]:.4f}"
            )
    console.print(f"grids: {out}")
    print(f"total minutes: {(time.time() - t_start) / 60:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
