"""visual_shapes: the rendered images say what the answers say; answers balanced; options typed."""

from __future__ import annotations

import collections
import random

import pytest

from grouprl.config.task import check_task_options
from grouprl.envs.tasks import build_task
from grouprl.envs.tasks.multimodal import prompt_images
from grouprl.envs.tasks.visual_shapes import PALETTE, Shape, _place, draw, shapes_accuracy


def test_drawing_puts_each_colour_where_the_shape_is():
    shapes = [Shape("circle", "red", 14, 14, 8), Shape("square", "blue", 40, 40, 10),
              Shape("triangle", "green", 40, 12, 8)]  # fmt: skip
    image = draw(shapes, 56)
    assert image.getpixel((14, 14)) == PALETTE["red"]
    assert image.getpixel((40, 40)) == PALETTE["blue"]
    assert image.getpixel((40, 16)) == PALETTE["green"]  # below the apex, inside the triangle
    assert image.getpixel((33, 5)) == (255, 255, 255)  # left of the triangle's top: background
    assert image.getpixel((3, 52)) == (255, 255, 255)


def test_placed_shapes_never_overlap_and_have_distinct_colours():
    rng = random.Random(0)
    for _ in range(200):
        shapes = _place(rng, 3, 56)
        if shapes is None:
            continue
        assert len({s.colour for s in shapes}) == 3
        for a in shapes:
            assert a.r <= a.cx <= 56 - a.r and a.r <= a.cy <= 56 - a.r
            for b in shapes:
                if a is not b:
                    assert (a.cx - b.cx) ** 2 + (a.cy - b.cy) ** 2 > (a.r + b.r) ** 2


def test_answers_are_the_truth_of_the_image():
    task = build_task("visual_shapes", n_train=400, n_eval=40, image_size=56)
    for ex in task.train:
        image = prompt_images(ex["prompt"])[0]
        question = ex["prompt"][0]["content"][1]["text"]
        colours = {c for c, rgb in PALETTE.items() if rgb in {p for _, p in image.getcolors(10000)}}
        if ex["kind"] == "count":
            assert int(ex["answer"]) == len(colours)  # one colour per shape
        elif ex["kind"] in ("colour", "larger"):
            assert ex["answer"] in colours
        if ex["kind"] == "larger":
            areas = {c: sum(n for n, p in image.getcolors(10000) if p == PALETTE[c])
                     for c in colours}  # fmt: skip
            a, b = (w for w in question.split() if w in PALETTE)
            assert ex["answer"] == max((a, b), key=areas.get)
        if ex["kind"] == "position":
            colour = next(w for w in question.split() if w in PALETTE)
            xs = [(x, y) for x in range(56) for y in range(56)
                  if image.getpixel((x, y)) == PALETTE[colour]]  # fmt: skip
            cx, cy = (sum(v) / len(xs) for v in zip(*xs))
            side = {"left": cx < 28, "right": cx > 28, "top": cy < 28, "bottom": cy > 28}
            assert side[ex["answer"]]


def test_balanced_deterministic_and_typed():
    task = build_task("visual_shapes", n_train=800, n_eval=100, seed=3)
    by_kind = collections.defaultdict(collections.Counter)
    for ex in task.train:
        by_kind[ex["kind"]][ex["answer"]] += 1
    assert set(by_kind) == {"count", "colour", "position", "larger"}
    for counts in by_kind.values():
        assert max(counts.values()) <= 0.5 * sum(counts.values())
    again = build_task("visual_shapes", n_train=800, n_eval=100, seed=3)
    assert [e["answer"] for e in again.eval] == [e["answer"] for e in task.eval]
    assert list(prompt_images(again.train[5]["prompt"])[0].getdata()) == list(
        prompt_images(task.train[5]["prompt"])[0].getdata()
    )
    assert shapes_accuracy(["Red.", " red ", [{"role": "assistant", "content": "blue"}]],
                           ["red", "red", "red"]) == [1.0, 1.0, 0.0]  # fmt: skip
    with pytest.raises(ValueError, match="unknown option 'shapes'"):
        check_task_options("visual_shapes", {"shapes": 3})
    with pytest.raises(ValueError, match="image_size"):
        check_task_options("visual_shapes", {"image_size": "56"})
    with pytest.raises(ValueError, match="kinds"):
        build_task("visual_shapes", kinds=["area"])
