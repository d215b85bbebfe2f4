"""Metric sinks for RunLogger besides metrics.jsonl: TensorBoard and Weights & Biases.

A backend is a class built as `cls(run_dir, run_name, config)` with `log(step, metrics, split)`
(metrics already JSON-safe floats or None) and `close()`; `BACKENDS` maps the names accepted by
`RunLogger(backends=...)` and `run.log_backends` to them. Each imports its package only when built,
and fails at start with an install hint when the package is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def dashboard_tag(key: str, split: str) -> str:
    """Eval metrics get an `eval/` prefix in dashboards unless their name already carries it."""
    return key if split == "train" or key.startswith(f"{split}/") else f"{split}/{key}"


class _TensorBoardBackend:
    def __init__(self, run_dir: Path, run_name: str | None, config: dict | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "logging backend 'tensorboard' was requested but tensorboard is not installed "
                "(pip install tensorboard), or drop it from `backends`"
            ) from e
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float | None], split: str) -> None:
        for key, value in metrics.items():
            if value is not None:  # TensorBoard has no null; a gap is the honest picture
                self.writer.add_scalar(dashboard_tag(key, split), value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandbBackend:
    """Project from config["wandb_project"] (default "grouprl"); the W&B run id is kept in
    run_dir/wandb_id.txt so a resumed run continues the same W&B run."""

    def __init__(self, run_dir: Path, run_name: str | None, config: dict | None) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "logging backend 'wandb' was requested but wandb is not installed "
                "(pip install wandb), or drop it from `backends`"
            ) from e
        config = config or {}
        id_file = run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=config.get("wandb_project", "grouprl"),
            name=run_name or config.get("run_name"),
            config=config,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
        )

    def log(self, step: int, metrics: dict[str, float | None], split: str) -> None:
        self.run.log(
            {dashboard_tag(k, split): v for k, v in metrics.items() if v is not None}, step=step
        )

    def close(self) -> None:
        self.run.finish()


BACKENDS: dict[str, Any] = {
    "jsonl": None,  # metrics.jsonl is always written by RunLogger itself
    "tensorboard": _TensorBoardBackend,
    "wandb": _WandbBackend,
}
