"""The image demo's pieces: the synthetic shapes, the color_area reward, the image_prompts task, the
cached flow-matching pretraining (a tiny budget), the grid PNG, the demo script end to end on a tiny
budget, and (slow) the real demo's reward rise."""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from grouprl.demos import images as diffusion_demo
from grouprl.demos.pretrain import (
    PretrainSettings,
    cache_dir,
    cached_pretrain,
    euler_sample,
    flow_matching_loss,
)
from grouprl.demos.velocity import ShapesVelocityNet
from grouprl.envs.rewards import build_reward
from grouprl.envs.rewards.shapes import color_area
from grouprl.envs.shapes import (
    BACKGROUND,
    COLORS,
    class_names,
    class_of,
    colour_coverage,
    render,
    sample_batch,
)
from grouprl.envs.tasks import build_task
from grouprl.workloads.images.sampling import save_grid

# ---- synthetic shapes --------------------------------------------------------------------------


def test_class_names_and_lookup():
    names = class_names()
    assert len(names) == 12 and names[:4] == ["red circle", "red square", "red triangle",
                                              "green circle"]  # fmt: skip
    assert class_of("yellow triangle") == 11
    with pytest.raises(ValueError, match="unknown shapes prompt 'purple circle'"):
        class_of("purple circle")


def test_render_square_is_exact_on_the_pixel_grid():
    # half side r sqrt(pi) / 2 = 2 for r = 4 / sqrt(pi): a 4x4 square covering pixels 6..9
    r = torch.tensor([4 / math.sqrt(math.pi)])
    img = render(torch.tensor([1]), torch.tensor([8.0]), torch.tensor([8.0]), r)  # red square
    red = torch.tensor(COLORS["red"]).view(3, 1, 1)
    assert torch.allclose(img[0, :, 6:10, 6:10], red.expand(3, 4, 4))
    outside = torch.ones(16, 16, dtype=torch.bool)
    outside[6:10, 6:10] = False
    assert torch.allclose(img[0][:, outside], torch.tensor(BACKGROUND).view(3, 1))
    assert colour_coverage(img, torch.tensor([1])).item() == 16 / 256


def test_render_circle_area_and_triangle_shape():
    r = torch.tensor([5.0])
    circle = render(torch.tensor([0]), torch.tensor([8.0]), torch.tensor([8.0]), r)
    cover = (circle[0, 0] - 0.1) / (0.9 - 0.1)  # red channel -> anti-aliased coverage
    assert abs(cover.sum().item() - math.pi * 25) < 1.0  # area pi r^2 (4x4 supersampling)
    tri = render(torch.tensor([2]), torch.tensor([8.0]), torch.tensor([8.0]), r)
    cover = (tri[0, 0] - 0.1) / (0.9 - 0.1)
    assert abs(cover.sum().item() - 3 * math.sqrt(3) / 4 * 25) < 1.0  # inscribed equilateral
    row_width = cover.sum(1)  # coverage per row, apex (top) to base
    assert row_width[4] < row_width[7] < row_width[9]  # row 10 is half covered (base 10.5)
    assert cover[:3].sum() == 0 and cover[11:].sum() == 0  # apex at y = 3, base at y = 10.5


def test_sample_batch_keeps_shapes_inside_and_is_seeded():
    x, labels = sample_batch(64, generator=torch.Generator().manual_seed(0))
    y, labels2 = sample_batch(64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, y) and torch.equal(labels, labels2)
    assert x.shape == (64, 3, 16, 16) and x.min() >= 0 and x.max() <= 1
    border = torch.cat([x[..., 0, :], x[..., -1, :], x[..., :, 0], x[..., :, -1]], -1)
    assert torch.allclose(border, torch.tensor(BACKGROUND).view(1, 3, 1).expand_as(border))
    cover = colour_coverage(x, labels)
    assert (cover > 0.02).all() and (cover < 0.35).all()


# ---- color_area reward -------------------------------------------------------------------------


def test_color_area_hand_values():
    fn = color_area(tolerance=0.25)
    target = [0.9, 0.15, 0.15]
    img = torch.tensor(BACKGROUND).view(1, 3, 1, 1).repeat(2, 1, 2, 2)  # [2, 3, 2, 2]
    img[0, :, 0, 0] = torch.tensor(target)  # one of 4 pixels exactly on target
    img[1] = torch.tensor([0.9, 0.15, 0.4]).view(3, 1, 1)  # every pixel at distance 0.25
    d_bg = math.dist(BACKGROUND, target)
    expected0 = (1 + 3 * math.exp(-((d_bg / 0.25) ** 2))) / 4
    out = fn(img, target_rgb=[target, target])
    assert out[0] == pytest.approx(expected0, abs=1e-6)
    assert out[1] == pytest.approx(math.exp(-1), abs=1e-6)
    video = img.unsqueeze(2).repeat(1, 1, 3, 1, 1)  # [2, 3, F, 2, 2]: every frame the same
    assert fn(video, target_rgb=[target, target]) == pytest.approx(out, abs=1e-6)
    pil = [Image.fromarray((i.permute(1, 2, 0).numpy() * 255).round().astype("uint8")) for i in img]
    assert fn(pil, target_rgb=[target, target]) == pytest.approx(out, abs=0.01)
    assert build_reward("color_area", tolerance=0.25)(img, target_rgb=[target] * 2) == out
    with pytest.raises(KeyError, match="needs the column 'target_rgb'"):
        fn(img, prompts=["red circle"] * 2)
    with pytest.raises(ValueError, match="tolerance must be > 0"):
        color_area(tolerance=0)


# ---- the image_prompts task --------------------------------------------------------------------


def test_shapes_task_columns_and_eval_seeds():
    task = build_task("image_prompts", source="shapes", eval_repeats=3, eval_seed=10, n_eval=2)
    assert [ex["prompt"] for ex in task.train] == class_names()
    assert task.train[5] == {"prompt": "green triangle", "class_label": 5, "color": "green",
                             "shape": "triangle", "target_rgb": list(COLORS["green"])}  # fmt: skip
    assert [(ex["prompt"], ex["seed"]) for ex in task.eval] == [
        ("red circle", 10), ("red circle", 11), ("red circle", 12),
        ("red square", 13), ("red square", 14), ("red square", 15),
    ]  # fmt: skip
    assert list(task.reward_fns) == ["color_area"]
    scores = task.reward_fns["color_area"](
        sample_batch(2, generator=torch.Generator().manual_seed(0), labels=torch.tensor([0, 3]))[0],
        target_rgb=[task.train[0]["target_rgb"], task.train[3]["target_rgb"]],
    )
    assert all(0.02 < s < 0.35 for s in scores)


def test_prompt_sources(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("a cat\n\n  a dog  \n")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"text": "a cow", "tag": "animal"}\n{"text": "a car", "tag": "vehicle"}\n')
    task = build_task("image_prompts", source="file", path=str(txt), eval_path=str(jsonl),
                      column="text")  # fmt: skip
    assert task.train == [{"prompt": "a cat"}, {"prompt": "a dog"}] and task.reward_fns == {}
    assert task.eval == [{"prompt": "a cow", "tag": "animal", "seed": 0},
                         {"prompt": "a car", "tag": "vehicle", "seed": 1}]  # fmt: skip
    classes = build_task("image_prompts", source="classes", classes=["cat", "dog"])
    assert classes.train == [
        {"prompt": "cat", "class_label": 0},
        {"prompt": "dog", "class_label": 1},
    ]
    hub = tmp_path / "dataset"  # a local folder goes through the same load_dataset as a hub id
    hub.mkdir()
    (hub / "train.jsonl").write_text('{"prompt": "a fox", "n": 1}\n{"prompt": "an owl", "n": 2}\n')
    (hub / "test.jsonl").write_text('{"prompt": "a bee", "n": 3}\n')
    data = build_task("image_prompts", source="hub", path=str(hub), eval_split="test")
    assert data.train == [{"prompt": "a fox", "n": 1}, {"prompt": "an owl", "n": 2}]
    assert data.eval == [{"prompt": "a bee", "n": 3, "seed": 0}]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"source": "web"}, "source='web' is not allowed"),
        ({"source": "file"}, "source 'file' needs `path`"),
        ({"source": "file", "path": "/no/such.txt"}, "does not exist"),
        ({"source": "classes"}, "needs `classes`"),
        ({"source": "shapes", "eval_path": "x.txt"}, "eval_path is for source 'file'"),
        ({"source": "shapes", "eval_repeats": 0}, "eval_repeats must be >= 1"),
    ],
)
def test_prompt_task_errors(options, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        build_task("image_prompts", **options)


# ---- pretraining -------------------------------------------------------------------------------

TINY = PretrainSettings(steps=40, batch_size=16, channels=(8, 16), emb_dim=16, warmup=5)


def test_pretraining_on_a_tiny_budget_is_cached(tmp_path):
    logs = []
    path = cached_pretrain(TINY, tmp_path, log=logs.append)
    assert path == cache_dir(TINY, tmp_path) and path.name == f"shapes-flow-{TINY.key()}"
    record = json.loads((path / "pretrain.json").read_text())
    assert record["settings"]["steps"] == 40 and len(record["loss_curve"]) == 1
    model = ShapesVelocityNet.from_pretrained(path).eval()
    torch.manual_seed(0)  # a fresh net (zero output layer) predicts v = 0: loss = E|eps - x0|^2
    x0, labels = sample_batch(32, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(1)
    fresh = flow_matching_loss(ShapesVelocityNet(channels=(8, 16), emb_dim=16), x0 * 2 - 1,
                               labels, g)  # fmt: skip
    with torch.no_grad():
        trained = flow_matching_loss(model, x0 * 2 - 1, labels, torch.Generator().manual_seed(1))
    assert trained < 0.7 * fresh  # 40 steps of 16 already learn the mean image and the noise
    stamp = (path / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns
    assert cached_pretrain(TINY, tmp_path, log=logs.append) == path  # reused, not retrained
    assert (path / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns == stamp
    assert logs[-1].startswith("reusing the pretrained shapes model")
    other = PretrainSettings(**{**TINY.__dict__, "seed": 1})
    assert cache_dir(other, tmp_path) != path  # every setting is in the key
    imgs = euler_sample(model, torch.arange(3), 4, torch.Generator().manual_seed(0), guidance=2.0)
    assert imgs.shape == (3, 3, 16, 16) and 0 <= imgs.min() and imgs.max() <= 1


def test_grid_has_a_row_per_prompt(tmp_path):
    imgs = torch.rand(5, 3, 16, 16)
    path = save_grid(imgs, ["a", "a", "b", "b", "c"], tmp_path / "g.png")
    grid = Image.open(path)
    assert grid.size == (8 + 7 + 2 * (64 + 2), 3 * (64 + 2))
    tile = torch.from_numpy(np.array(grid.crop((15, 0, 15 + 64, 64)))).float()
    first = (imgs[0].permute(1, 2, 0) * 255).round().repeat_interleave(4, 0).repeat_interleave(4, 1)
    assert torch.equal(tile.view(64, 64, 3), first)  # nearest upscaling of image 0


# ---- the demo ----------------------------------------------------------------------------------


def test_demo_runs_end_to_end_on_a_tiny_budget(tmp_path, capsys):
    code = diffusion_demo.main([
        "--pretrain-steps", "3", f"run.output_dir={tmp_path}", "train.steps=1",
        "rollout.prompts_per_step=1", "rollout.group_size=2", "diffusion.rollout_steps=2",
        "diffusion.eval_steps=2", "task.options.eval_repeats=1", "eval.every=0",
        "checkpoint.every=0",
    ])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "held-out reward before:" in out and "held-out reward after:" in out
    run = tmp_path / "shapes-flow-grpo"
    assert (run / "before_after.png").exists() and (run / "curves.png").exists()
    assert len(list((run / "images").glob("step-*.png"))) == 2


@pytest.mark.slow
def test_demo_reward_rises_clearly(tmp_path, capsys):
    """The real demo (default pretraining and config): the held-out reward at least doubles."""
    assert diffusion_demo.main([f"run.output_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    before = float(out.split("held-out reward before:")[1].split()[0])
    after = float(out.split("held-out reward after:")[1].split()[0])
    assert after > 2 * before and after > 0.2
