"""Prompts with images: every dataset form made into chat messages with loaded image items.

The VLM policy reads one form (grouprl/policies/vision/processing.py): a list of chat messages
whose "content" is a string or a list of items {"type": "image", "image": PIL RGB image} and
{"type": "text", "text": str}, several images allowed, in reading order. `vlm_prompt` makes it
from what datasets hold:

- TRL's VLM form: messages whose content items are {"type": "image"} placeholders without the
  image, plus an image column: the k-th placeholder takes the k-th image;
- a string with "<image>" placeholders plus an image column (geometry3k-style): the same rule;
- a string without placeholders plus an image column: the images first, then the text, in one
  user message (how LLaVA-style and ChartQA-style data is usually meant);
- messages whose image items already hold images (any form below).
A count mismatch between placeholders and images is an error naming the row.

An image column holds one image or a list of them, each a PIL image, raw bytes, a
{"bytes": ..., "path": ...} dict (the `datasets` Image feature as stored in parquet / arrow), or
a file path (relative paths resolve against the dataset file's folder).

Images are files written by others, so (`load_image`): they are decoded by PIL only (never
pickle), only the formats in FORMATS are opened (checked from the file's own header, not its
name), the pixel count is checked from the header before any pixel is decoded (MAX_PIXELS, a
decompression-bomb guard that is an error, not PIL's warning), a file or byte string larger than
MAX_BYTES is refused unread, a path must stay inside the dataset's folder or the `image_root`
given (resolved, so neither "../" nor a symlink leads out), and a truncated or corrupt image is
an error naming the row and the file.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_PIXELS = 40_000_000  # e.g. 6300 x 6300; VLM processors resize far below this anyway
MAX_BYTES = 64 * 1024 * 1024
PLACEHOLDER = "<image>"


def prompt_images(prompt: Any) -> list[Image.Image]:
    """The images of a chat prompt, in order (none for a string prompt)."""
    if isinstance(prompt, str):
        return []
    return [
        item["image"]
        for m in prompt
        if isinstance(m.get("content"), list)
        for item in m["content"]
        if isinstance(item, dict) and item.get("type") == "image"
    ]


def prompt_for_log(prompt: Any) -> str:
    """A prompt as text for logs: "role: text" lines, each image as <image WxH>."""
    if isinstance(prompt, str):
        return prompt
    lines = []
    for m in prompt:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for item in content:
                if item.get("type") == "image":
                    image = item.get("image")
                    size = f" {image.width}x{image.height}" if hasattr(image, "width") else ""
                    parts.append(f"<image{size}>")
                else:
                    parts.append(str(item.get("text", "")))
            content = " ".join(parts)
        lines.append(f"{m.get('role')}: {content}")
    return "\n".join(lines)


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def _open(data: bytes | Path, where: str, max_pixels: int) -> Image.Image:
    """Decode one image file's bytes (or a path's) under the rules of the module docstring."""
    try:
        source = io.BytesIO(data) if isinstance(data, bytes) else data
        with Image.open(source, formats=list(FORMATS)) as image:
            w, h = image.size
            if w * h > max_pixels:
                raise ValueError(
                    f"{where}: image of {w}x{h} pixels exceeds max_image_pixels={max_pixels}"
                )
            image.seek(0)  # a GIF's first frame
            return image.convert("RGB")  # decodes here: a truncated file raises
    except UnidentifiedImageError:
        raise ValueError(
            f"{where}: not an image in one of the allowed formats {list(FORMATS)}"
        ) from None
    except (OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"{where}: cannot decode the image ({e})") from None


def load_image(
    value: Any, where: str, root: Path | None = None, max_pixels: int = MAX_PIXELS
) -> Image.Image:
    """One image in any column form (module docstring) -> PIL RGB; root: the folder paths must
    stay in (None: relative or absolute paths are refused)."""
    if isinstance(value, Image.Image):
        w, h = value.size
        if w * h > max_pixels:
            raise ValueError(f"{where}: image of {w}x{h} pixels exceeds {max_pixels}")
        return value.convert("RGB") if value.mode != "RGB" else value
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return load_image(bytes(value["bytes"]), where, root, max_pixels)
        if value.get("path"):
            return load_image(value["path"], where, root, max_pixels)
        raise ValueError(f"{where}: an image dict needs 'bytes' or 'path', got {sorted(value)}")
    if isinstance(value, bytes | bytearray):
        if len(value) > MAX_BYTES:
            raise ValueError(f"{where}: image of {len(value)} bytes exceeds {MAX_BYTES}")
        return _open(bytes(value), where, max_pixels)
    if isinstance(value, str | os.PathLike):
        if root is None:
            raise ValueError(
                f"{where}: image path {str(value)!r} given without a folder to resolve it in "
                "(data passed from Python: give PIL images or bytes, or set image_root)"
            )
        base = root.resolve()
        path = (base / Path(value)).resolve()  # follows symlinks, collapses ".."
        if not _inside(path, base):
            raise ValueError(
                f"{where}: image path {str(value)!r} leads outside {str(base)!r}; set image_root "
                "to the folder the images are in"
            )
        if not path.is_file():
            raise FileNotFoundError(f"{where}: image file {str(path)!r} does not exist")
        if path.stat().st_size > MAX_BYTES:
            raise ValueError(f"{where}: image file {str(path)!r} exceeds {MAX_BYTES} bytes")
        return _open(path, f"{where} ({path})", max_pixels)
    raise TypeError(
        f"{where}: an image must be a PIL image, bytes, a {{'bytes', 'path'}} dict or a path, "
        f"got {type(value).__name__}"
    )


def load_images(
    value: Any, where: str, root: Path | None = None, max_pixels: int = MAX_PIXELS
) -> list[Image.Image]:
    """An image column's cell: one image or a list of them (None: no image)."""
    if value is None:
        return []
    values = value if isinstance(value, list | tuple) else [value]
    return [load_image(v, f"{where} image {k}", root, max_pixels) for k, v in enumerate(values)]


def _fill(content: Any, images: list[Image.Image], used: list[int], where: str) -> Any:
    """A message content with each {"type": "image"} placeholder holding the next image and
    each "<image>" placeholder of a text item split out as an image item."""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    out = []
    for item in content:
        if not isinstance(item, dict) or "type" not in item:
            raise TypeError(f"{where}: a content item must be a dict with 'type', got {item!r}")
        if item["type"] == "image":
            if item.get("image") is not None:
                out.append({"type": "image", "image": load_image(item["image"], where)})
                continue
            if used[0] >= len(images):
                raise ValueError(f"{where}: more image placeholders than images ({len(images)})")
            out.append({"type": "image", "image": images[used[0]]})
            used[0] += 1
        elif item["type"] == "text":
            pieces = str(item.get("text", "")).split(PLACEHOLDER)
            for k, piece in enumerate(pieces):
                if k > 0:
                    if used[0] >= len(images):
                        raise ValueError(
                            f"{where}: more {PLACEHOLDER} placeholders than images ({len(images)})"
                        )
                    out.append({"type": "image", "image": images[used[0]]})
                    used[0] += 1
                if piece.strip():
                    out.append({"type": "text", "text": piece.strip()})
        else:
            raise ValueError(f"{where}: content item type {item['type']!r} (image or text)")
    return out


def vlm_prompt(prompt: Any, images: list[Image.Image], where: str) -> list[dict]:
    """A string or messages plus the row's images -> the VLM's message form (module docstring)."""
    if isinstance(prompt, str):
        if PLACEHOLDER not in prompt:  # images first, then the text
            items = [{"type": "image", "image": im} for im in images]
            return [{"role": "user", "content": [*items, {"type": "text", "text": prompt}]}]
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
        raise TypeError(f"{where}: a prompt is a string or a list of messages")
    used = [0]
    out = [{**m, "content": _fill(m.get("content", ""), images, used, where)} for m in prompt]
    if used[0] != len(images):
        raise ValueError(
            f"{where}: {used[0]} image placeholders for {len(images)} images (each image needs "
            f"its {{'type': 'image'}} item or {PLACEHOLDER!r} in the text)"
        )
    return out
