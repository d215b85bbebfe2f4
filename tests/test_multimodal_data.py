"""Prompts with images: every dataset form, the vqa task, and untrusted image files."""

from __future__ import annotations

import io
import json
import os
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image

from grouprl.config.task import check_task_options
from grouprl.envs.tasks import build_task
from grouprl.envs.tasks.multimodal import load_image, prompt_for_log, prompt_images, vlm_prompt


def _png(colour="red", size=(8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _items(prompt):
    return [(i["type"], i.get("text")) for m in prompt for i in m["content"]]


def test_forms_become_messages_with_images_in_order():
    red, blue = Image.new("RGB", (4, 4), "red"), Image.new("RGB", (4, 4), "blue")
    trl = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "A?"},
                                        {"type": "image"}]}]  # fmt: skip
    out = vlm_prompt(trl, [red, blue], "row 0")
    assert [i["image"].getpixel((0, 0)) for i in out[0]["content"] if i["type"] == "image"] == [
        (255, 0, 0), (0, 0, 255)]  # fmt: skip
    geo = vlm_prompt("<image>Find x. <image> Answer.", [red, blue], "row 1")
    assert _items(geo) == [("image", None), ("text", "Find x."), ("image", None),
                           ("text", "Answer.")]  # fmt: skip
    plain = vlm_prompt("What is shown?", [red], "row 2")
    assert _items(plain) == [("image", None), ("text", "What is shown?")]
    assert prompt_images(geo)[1] is blue
    assert prompt_for_log(geo) == "user: <image 4x4> Find x. <image 4x4> Answer."
    with pytest.raises(ValueError, match="row 3: 1 image placeholders for 2 images"):
        vlm_prompt("<image> x", [red, blue], "row 3")
    with pytest.raises(ValueError, match="row 4: more"):
        vlm_prompt(trl, [red], "row 4")


def test_image_values_in_every_form(tmp_path):
    data = _png("blue")
    (tmp_path / "a.png").write_bytes(data)
    forms = [Image.open(io.BytesIO(data)), data, {"bytes": data, "path": None},
             {"bytes": None, "path": "a.png"}, "a.png", tmp_path / "a.png"]  # fmt: skip
    for value in forms:
        image = load_image(value, "row 0", tmp_path)
        assert (
            image.mode == "RGB" and image.size == (8, 6) and image.getpixel((1, 1)) == (0, 0, 255)
        )


def test_untrusted_files_are_refused_with_the_row(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    secret = tmp_path / "secret.png"
    secret.write_bytes(_png())
    os.symlink(secret, root / "link.png")
    with pytest.raises(ValueError, match="row 1: image path 'link.png' leads outside"):
        load_image("link.png", "row 1", root)
    with pytest.raises(ValueError, match="leads outside"):
        load_image("../secret.png", "row 1", root)
    with pytest.raises(ValueError, match="leads outside"):
        load_image(str(secret), "row 1", root)
    with pytest.raises(ValueError, match="without a folder"):
        load_image("x.png", "row 1", None)
    # a pickle renamed .png: not an allowed image format, never unpickled
    (root / "evil.png").write_bytes(b"\x80\x04\x95" + b"cos\nsystem\n(S'touch /tmp/pwned'\ntR.")
    with pytest.raises(ValueError, match="row 2.*not an image in one of the allowed formats"):
        load_image("evil.png", "row 2", root)
    # truncated JPEG
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "green").save(buf, format="JPEG")
    (root / "cut.jpg").write_bytes(buf.getvalue()[:200])
    with pytest.raises(ValueError, match="row 3.*cannot decode"):
        load_image("cut.jpg", "row 3", root)

    # decompression bombs: PNG headers (a few bytes) claiming 7000^2 (over our limit) and
    # 30000^2 pixels (over PIL's own too), refused before any pixel is decoded
    def header_only(side: int) -> bytes:
        chunk = b"IHDR" + struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + chunk + struct.pack(
            ">I", zlib.crc32(chunk)) + b"\x00\x00\x00\x00IEND\xaeB`\x82"  # fmt: skip

    with pytest.raises(ValueError, match="row 4: image of 7000x7000 pixels exceeds"):
        load_image(header_only(7000), "row 4", root)
    with pytest.raises(ValueError, match="row 5: cannot decode.*decompression bomb"):
        load_image(header_only(30000), "row 5", root)


def test_vqa_geometry_style_parquet_with_the_image_feature(tmp_path):
    from datasets import Dataset, Features, Sequence, Value
    from datasets import Image as ImageFeature

    rows = {
        "images": [[Image.new("RGB", (10, 10), "red")], [Image.new("RGB", (10, 10), "blue")] * 2],
        "problem": ["<image>Find x.", "<image><image>Compare."],
        "answer": ["3", "\\frac{1}{2}"],
    }
    features = Features({"images": Sequence(ImageFeature()), "problem": Value("string"),
                         "answer": Value("string")})  # fmt: skip
    ds = Dataset.from_dict(rows, features=features)
    ds.to_parquet(tmp_path / "geo.parquet")  # stored as {"bytes", "path"} structs
    ds.save_to_disk(tmp_path / "saved")
    for source in (tmp_path / "geo.parquet", tmp_path / "saved", ds):
        src = str(source) if isinstance(source, Path) else source
        task = build_task("vqa", source=src, reward="math")
        second = task.train[1]["prompt"]
        assert len(prompt_images(second)) == 2 and _items(second)[-1] == ("text", "Compare.")
        fn = task.reward_fns["accuracy"]
        assert fn(completions=["x = \\boxed{3}", "\\boxed{0.5}"], answer=["3", "\\frac{1}{2}"],
                  prompts=[None, None]) == [1.0, 1.0]  # fmt: skip


def test_vqa_chartqa_style_jsonl_with_paths_and_exact_answers(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "c.png").write_bytes(_png("green"))
    with (tmp_path / "chart.jsonl").open("w") as f:
        f.write(json.dumps({"image": "img/c.png", "query": "Top bar?", "label": ["Yes", "yes."]}))
        f.write("\n")
    task = build_task("vqa", source=str(tmp_path / "chart.jsonl"), system_prompt="Be brief.")
    ex = task.train[0]
    assert ex["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert prompt_images(ex["prompt"])[0].getpixel((0, 0)) == (0, 128, 0)
    acc = task.reward_fns["accuracy"]
    assert acc(completions=[" YES. ", "no"], answer=[ex["answer"]] * 2) == [1.0, 0.0]
    with pytest.raises(ValueError, match="unknown option 'image_col'"):
        check_task_options("vqa", {"source": "x", "image_col": "a"})
    with pytest.raises(ValueError, match="reward"):
        check_task_options("vqa", {"source": "x", "reward": "fuzzy"})
