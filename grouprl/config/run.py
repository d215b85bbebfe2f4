"""The `run:` section: name, folders, seed, resume, device, logging."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from grouprl.config.section import Section


class RunConfig(Section):
    name: str = Field(
        "run",
        description="Run name; the run directory is output_dir/name (a relative path inside "
        "output_dir: sub/folders are fine, '..', '.', '~', absolute paths and backslashes not).",
    )
    output_dir: str = Field("runs", description="Parent folder of run directories.")
    seed: int = Field(0, description="Seed for python, numpy and torch RNGs.")
    resume: bool = Field(False, description="Continue from the last complete checkpoint.")
    overwrite: bool = Field(
        False,
        description="Start afresh in a run directory that has a run (the old run is deleted only "
        "once the new config, task, rewards, model and optimizer are built).",
    )
    allow_config_change: bool = Field(
        False,
        description="Resume even though the config differs from the one the run was started with "
        "(the differences are printed and appended to config_changes.jsonl); false refuses. "
        "Always allowed: run.resume / overwrite / allow_config_change / output_dir / name / "
        "console / log_backends / num_threads / device / peak_flops and train.steps (run_state.RESUME_EXEMPT).",
    )
    device: Literal["cpu", "cuda", "auto"] = Field("auto", description="Where to train.")
    num_threads: int | None = Field(None, description="torch CPU threads (None: torch default).")
    log_backends: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"], description="Metric sinks besides metrics.jsonl."
    )
    console: bool = Field(True, description="Show the progress bar and status lines.")
    peak_flops: Annotated[float, Field(gt=0)] | Literal["auto"] | None = Field(
        "auto",
        description="Peak FLOP/s of one device for perf/mfu (runtime/throughput.py): a number, "
        "'auto' (the GPU's dense bf16 tensor-core peak from a table, tf32 for float32; none on "
        "CPU) or null (MFU not logged).",
    )
    fail_fast: bool = Field(
        False, description="Stop at a reward / env error or timeout instead of NaN / ending it."
    )

    @field_validator("name")
    @classmethod
    def _name_stays_inside_output_dir(cls, name: str) -> str:
        return check_run_name(name)


def check_run_name(name: str) -> str:
    """run.name as a path relative to run.output_dir that cannot leave it (ValueError otherwise)."""
    from pathlib import PurePosixPath, PureWindowsPath

    why = None
    parts = name.split("/")
    if not name.strip():
        why = "it is empty"
    elif "\\" in name or "\0" in name:
        why = "it holds a backslash or a NUL character"
    elif PurePosixPath(name).is_absolute() or PureWindowsPath(name).drive:
        why = "it is an absolute path"
    elif any(p in ("..", ".") for p in parts):
        why = "it has a '..' or '.' component"
    elif name.startswith("~"):
        why = "it starts with '~'"
    elif any(p == "" for p in parts):
        why = "it has an empty component ('//' or a trailing '/')"
    if why:
        raise ValueError(
            f"run.name={name!r} must be a relative path inside run.output_dir ({why}); the run "
            "directory is output_dir/name"
        )
    return name
