"""A complete diffusers pipeline folder around a trained denoiser: what a full fine-tune saves.

`DiffusionPipeline.from_pretrained(folder)` needs model_index.json and every component it names
(text encoders, tokenizers, VAE, scheduler, SD 1.5's safety checker and feature extractor). The
policy writes its trained denoiser (transformer/ or unet/) and, for flow models, its scheduler; this
module brings every other component from the pipeline the run started from, unchanged. Files are
hard-linked when the file system allows (a checkpoint then costs no extra disk for a frozen T5),
copied otherwise. A hub id resolves to its local snapshot (huggingface_hub's cache).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

MODEL_INDEX = "model_index.json"


def pipeline_root(source: str) -> Path:
    """The local folder of a pipeline: the folder itself, or a hub id's cached snapshot of
    model_index.json and the component folders it names (never the repo's other files, such as
    single-file checkpoints next to the diffusers layout)."""
    root = Path(source)
    if root.is_dir():
        return root
    from huggingface_hub import hf_hub_download, snapshot_download

    index = json.loads(Path(hf_hub_download(source, MODEL_INDEX)).read_text())
    folders = [f"{k}/*" for k in index if not k.startswith("_")]
    return Path(snapshot_download(source, allow_patterns=[MODEL_INDEX, *folders]))


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst.unlink()
    try:
        os.link(src.resolve(), dst)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(src.resolve(), dst)


def complete_pipeline(source: str, directory: Path, written: set[str]) -> Path:
    """Write model_index.json and every component of `source` not in `written` (the sub-folders
    the policy saved itself) into `directory`; returns directory."""
    root = pipeline_root(source)
    index_path = root / MODEL_INDEX
    if not index_path.is_file():
        raise FileNotFoundError(f"{str(root)!r} has no {MODEL_INDEX}: not a diffusers pipeline")
    index = json.loads(index_path.read_text())
    directory.mkdir(parents=True, exist_ok=True)
    for name, spec in index.items():
        if name.startswith("_") or name in written:
            continue
        if not (isinstance(spec, list) and len(spec) == 2 and spec[1] is not None):
            continue  # an optional component the pipeline does not have (e.g. image_encoder null)
        folder = root / name
        if not folder.is_dir():
            raise FileNotFoundError(f"pipeline {str(root)!r}: component folder {name!r} missing")
        for f in folder.rglob("*"):
            if f.is_file():
                _link_or_copy(f, directory / name / f.relative_to(folder))
    missing = [n for n in written if not (directory / n).is_dir()]
    if missing:
        raise FileNotFoundError(f"the policy did not write {missing} into {str(directory)!r}")
    (directory / MODEL_INDEX).write_text(index_path.read_text())
    return directory
