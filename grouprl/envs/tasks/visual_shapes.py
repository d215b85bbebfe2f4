"""`visual_shapes`: questions about rendered shapes, a synthetic visual task built in code.

Each example is one RGB image (white background, 1..max_shapes non-overlapping shapes: circle,
square or triangle, each in its own colour) and one question of a kind drawn in turn:

  count     "How many shapes are in the image?"                       -> "2"
  colour    "What colour is the triangle?" (a shape kind seen once)   -> "red"
  position  "Is the blue shape on the left or the right?"             -> "left"
            (or top / bottom; the shape sits clearly on one side of the centre)
  larger    "Which is larger, the red shape or the green shape?"      -> "green"
            (two shapes whose drawn areas differ by a factor of at least 1.5)

Answers are one word, so a few new tokens suffice; `accuracy` is 1.0 for the exact answer after
lower-casing and stripping spaces and a final period, else 0.0. Everything is drawn from
`random.Random(seed)`: the same options give the same examples (train and eval from separate
streams). Answers are balanced per kind: counts uniform over 1..max_shapes, the two sides of a
position question and the two orders of a larger question equally likely.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image, ImageDraw

from grouprl.envs.tasks.base import TaskData, check_int

PALETTE = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 200, 30),
}
SHAPE_KINDS = ("circle", "square", "triangle")
KINDS = ("count", "colour", "position", "larger")
SUFFIX = " Answer with one word."
DATA_VERSION = 1  # bumped whenever drawing or questions change: part of the VLM demo's cache key


@dataclass(frozen=True)
class Shape:
    kind: str  # one of SHAPE_KINDS
    colour: str  # a PALETTE name
    cx: float  # centre, pixels
    cy: float
    r: float  # half extent, pixels


def draw(shapes: list[Shape], size: int) -> Image.Image:
    """The image of `shapes` on white, size x size RGB."""
    image = Image.new("RGB", (size, size), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for s in shapes:
        box = [s.cx - s.r, s.cy - s.r, s.cx + s.r, s.cy + s.r]
        fill = PALETTE[s.colour]
        if s.kind == "circle":
            pen.ellipse(box, fill=fill)
        elif s.kind == "square":
            pen.rectangle(box, fill=fill)
        else:  # an upward triangle inside the box
            pen.polygon([(s.cx, s.cy - s.r), (s.cx - s.r, s.cy + s.r), (s.cx + s.r, s.cy + s.r)],
                        fill=fill)  # fmt: skip
    return image


def area(s: Shape) -> float:
    """Drawn area in pixels^2: a circle pi r^2, a square (2r)^2, a triangle of base and height 2r
    half that (a triangle and a circle of one r differ, so "larger" compares areas)."""
    return {"circle": math.pi, "square": 4.0, "triangle": 2.0}[s.kind] * s.r**2


def _place(rng: random.Random, n: int, size: int) -> list[Shape] | None:
    """n shapes of distinct colours at non-overlapping places (bounding circles apart), or None
    when the draw did not fit (the caller draws again)."""
    colours = rng.sample(list(PALETTE), n)
    out: list[Shape] = []
    for colour in colours:
        for _ in range(50):
            r = rng.uniform(0.08, 0.2) * size
            cx, cy = rng.uniform(r + 1, size - r - 1), rng.uniform(r + 1, size - r - 1)
            if all((cx - o.cx) ** 2 + (cy - o.cy) ** 2 > (1.5 * (r + o.r)) ** 2 for o in out):
                out.append(Shape(rng.choice(SHAPE_KINDS), colour, cx, cy, r))
                break
        else:
            return None
    return out


def _count(rng: random.Random, size: int, max_shapes: int) -> tuple[list[Shape], str, str] | None:
    n = rng.randint(1, max_shapes)
    shapes = _place(rng, n, size)
    return None if shapes is None else (shapes, "How many shapes are in the image?", str(n))


def _colour(rng: random.Random, size: int, max_shapes: int) -> tuple | None:
    shapes = _place(rng, rng.randint(1, max_shapes), size)
    if shapes is None:
        return None
    unique = [s for s in shapes if sum(o.kind == s.kind for o in shapes) == 1]
    if not unique:
        return None
    s = rng.choice(unique)
    return shapes, f"What colour is the {s.kind}?", s.colour


def _position(rng: random.Random, size: int, max_shapes: int) -> tuple | None:
    shapes = _place(rng, rng.randint(1, max_shapes), size)
    if shapes is None:
        return None
    s = rng.choice(shapes)
    axis = rng.choice(("x", "y"))
    offset = (s.cx if axis == "x" else s.cy) - size / 2
    if abs(offset) < 0.15 * size:  # too close to the centre to say
        return None
    if axis == "x":
        return (
            shapes,
            f"Is the {s.colour} shape on the left or the right?",
            ("left" if offset < 0 else "right"),
        )
    return (
        shapes,
        f"Is the {s.colour} shape at the top or the bottom?",
        ("top" if offset < 0 else "bottom"),
    )


def _larger(rng: random.Random, size: int, max_shapes: int) -> tuple | None:
    shapes = _place(rng, rng.randint(2, max(2, max_shapes)), size)
    if shapes is None:
        return None
    a, b = rng.sample(shapes, 2)
    if max(area(a), area(b)) < 1.5 * min(area(a), area(b)):
        return None
    big = a if area(a) > area(b) else b
    return shapes, f"Which is larger, the {a.colour} shape or the {b.colour} shape?", big.colour


QUESTIONS: dict[str, Callable[[random.Random, int, int], tuple | None]] = {
    "count": _count,
    "colour": _colour,
    "position": _position,
    "larger": _larger,
}


def make_examples(
    n: int, rng: random.Random, size: int, max_shapes: int, kinds: list[str], system: str | None
) -> list[dict]:
    """n examples, the question kinds in turn (see the module docstring)."""
    out = []
    while len(out) < n:
        kind = kinds[len(out) % len(kinds)]
        drawn = QUESTIONS[kind](rng, size, max_shapes)
        if drawn is None:
            continue
        shapes, question, answer = drawn
        content = [{"type": "image", "image": draw(shapes, size)},
                   {"type": "text", "text": question + SUFFIX}]  # fmt: skip
        prompt = [{"role": "user", "content": content}]
        if system:
            prompt.insert(0, {"role": "system", "content": system})
        out.append({"prompt": prompt, "answer": answer, "kind": kind})
    return out


def normalise(text: str) -> str:
    return text.strip().rstrip(".").strip().lower()


def shapes_accuracy(completions: list, answer: list[str], **_: object) -> list[float]:
    """1.0 where the completion is the answer (case, spaces and a final period ignored)."""
    out = []
    for c, a in zip(completions, answer):
        text = c[-1]["content"] if isinstance(c, list) else c
        out.append(float(normalise(text) == normalise(a)))
    return out


def build_visual_shapes(
    n_train: int = 4000,
    n_eval: int = 200,
    image_size: int = 56,
    max_shapes: int = 3,
    kinds: list[str] | None = None,
    seed: int = 0,
    system_prompt: str | None = None,
) -> TaskData:
    """Questions about rendered shapes (grouprl/envs/tasks/visual_shapes.py).

    n_train, n_eval: examples in the training / held-out split.
    image_size: side of the square RGB images, pixels (>= 28).
    max_shapes: at most this many shapes per image (1..4).
    kinds: the question kinds asked, in turn (count, colour, position, larger; default all).
    seed: seeds the generator of both splits.
    system_prompt: an optional system message before each question.
    """
    check_int("n_train", n_train, minimum=1)
    check_int("n_eval", n_eval, minimum=0)
    check_int("image_size", image_size, minimum=28)
    check_int("max_shapes", max_shapes, minimum=1)
    if max_shapes > len(PALETTE):
        raise ValueError(
            f"max_shapes must be <= {len(PALETTE)} (one colour each), got {max_shapes}"
        )
    kinds = list(KINDS) if kinds is None else list(kinds)
    unknown = [k for k in kinds if k not in QUESTIONS]
    if unknown or not kinds:
        raise ValueError(f"kinds {unknown or kinds} not allowed; choose from {list(KINDS)}")
    if "larger" in kinds and max_shapes < 2:
        raise ValueError("question kind 'larger' needs max_shapes >= 2")
    train = make_examples(
        n_train, random.Random(seed), image_size, max_shapes, kinds, system_prompt
    )
    held = make_examples(
        n_eval, random.Random(seed + 1_000_003), image_size, max_shapes, kinds, system_prompt
    )
    return TaskData(train, held, {"accuracy": shapes_accuracy}, {"accuracy": 1.0})
