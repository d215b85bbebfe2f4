"""What the support matrix says about a model, consulted when a config names it.

The matrix (grouprl/replicas/support_matrix.json, written by `python -m grouprl.replicas sweep`,
grouprl/replicas/sweep/) holds one row per architecture the installed transformers registers,
with the result of each check on a tiny random model of it. `support_status(architecture)` reads
the rows of an architecture class (as config.json's `architectures` names it);
`check_model_support(model_cfg, ...)` applies it to a config's model section before any weight
loads, by model.support_check:

  refuse  (default) an architecture whose scoring check failed (grouprl's log-probs differ from
          the model's own forward: training on them would be silently wrong) is refused by name
          with the check's reason; any other failed check that applies to the run (lora only
          under model.lora, vllm only with a vLLM engine) is a warning naming it; an
          architecture absent from the matrix is a warning naming the transformers version
  warn    every finding above is a warning
  off     the matrix is not consulted

A hub id's config.json is not read at config time (nothing is downloaded then): the text and VLM
workloads check it through transformers just before the policy loads the weights.
"""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MATRIX_JSON = Path(__file__).resolve().parents[1] / "replicas" / "support_matrix.json"
SUPPORT_MODES = ("refuse", "warn", "off")
# kinds of the matrix by model section type
MATRIX_KIND = {"causal_lm": "causal_lm", "vlm": "image_text_to_text"}


class UnsupportedModelError(ValueError):
    """The support matrix records a failed scoring check for this architecture."""


@dataclass
class SupportStatus:
    """An architecture's rows in the matrix: failed checks {check: reason} over its rows."""

    architecture: str
    transformers: str
    rows: list[str] = field(default_factory=list)  # "kind/model_type"
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def known(self) -> bool:
        return bool(self.rows)


@functools.cache
def _matrix(path: str) -> dict:
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else {}


def support_status(
    architecture: str,
    *,
    kind: str | None = None,
    model_type: str | None = None,
    matrix_path: Path | str | None = None,
) -> SupportStatus:
    """The matrix rows of `architecture` (a class name), optionally of one kind ("causal_lm",
    "image_text_to_text") and model type; failed checks merged over the rows found."""
    m = _matrix(str(matrix_path or MATRIX_JSON))
    version = m.get("meta", {}).get("versions", {}).get("transformers", "unknown")
    status = SupportStatus(architecture, version)
    for k, rows in m.get("rows", {}).items():
        if kind is not None and k != kind:
            continue
        for name, row in rows.items():
            if row.get("architecture") != architecture:
                continue
            if model_type is not None and name != model_type:
                continue
            status.rows.append(f"{k}/{name}")
            for check, res in row.get("checks", {}).items():
                if res.get("status") == "fail":
                    status.failed.setdefault(check, res.get("reason", ""))
    return status


def _local_config(name_or_path: str) -> dict | None:
    path = Path(name_or_path).expanduser() / "config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None  # the loader reports an unreadable config.json itself


def applicable(check: str, *, uses_lora: bool, uses_vllm: bool) -> bool:
    """Whether a failed check concerns a run: lora only under LoRA, vllm only with vLLM."""
    if check == "lora":
        return uses_lora
    if check == "vllm":
        return uses_vllm
    return True


def check_config_support(
    config: dict,
    kind: str,
    mode: str,
    *,
    uses_lora: bool,
    uses_vllm: bool,
    where: str = "model.name_or_path",
    matrix_path: Path | str | None = None,
) -> None:
    """Refuse or warn about a model config.json's architectures by the matrix (module doc)."""
    if mode not in SUPPORT_MODES:
        raise ValueError(f"model.support_check must be one of {SUPPORT_MODES}, got {mode!r}")
    if mode == "off":
        return
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if not architectures:
        warnings.warn(
            f"{where}: config.json names no architectures, so the support matrix cannot be "
            "consulted (model.support_check='off' silences this)",
            stacklevel=3,
        )
        return
    for arch in architectures:
        status = support_status(arch, kind=kind, matrix_path=matrix_path or MATRIX_JSON)
        if not status.known:
            warnings.warn(
                f"{where}: {arch} is not in the support matrix of transformers "
                f"{status.transformers} (docs/support_matrix.md); grouprl has not checked its "
                "scoring, LoRA targets, training step or checkpoints (model.support_check='off' "
                "silences this)",
                stacklevel=3,
            )
            continue
        failed = {c: r for c, r in status.failed.items()
                  if applicable(c, uses_lora=uses_lora, uses_vllm=uses_vllm)}  # fmt: skip
        if "scoring" in failed and mode == "refuse":
            raise UnsupportedModelError(
                f"{where}: {arch} ({model_type}) failed the support matrix's scoring check: "
                f"{failed['scoring']}; grouprl's log-probs would not be the model's. Set "
                "model.support_check='warn' to train anyway"
            )
        for check, reason in failed.items():
            warnings.warn(
                f"{where}: {arch} ({model_type}) failed the support matrix's {check} check: "
                f"{reason} (docs/support_matrix.md; model.support_check='off' silences this)",
                stacklevel=3,
            )


def check_model_support(model: Any, *, uses_vllm: bool, at_load: bool = False) -> None:
    """A text / VLM model section by model.support_check (other sections: nothing to check).
    At config read (at_load False): a local folder's config.json. At load (at_load True, just
    before the policy loads weights): a hub id's config.json through transformers (a local
    folder was checked at config read)."""
    kind = MATRIX_KIND.get(getattr(model, "type", None))
    mode = getattr(model, "support_check", "refuse")
    if kind is None or mode == "off":
        return
    config = _local_config(model.name_or_path)
    if at_load and config is None:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(
                model.name_or_path, trust_remote_code=model.trust_remote_code
            ).to_dict()
        except (OSError, ValueError, KeyError):
            return  # not loadable: the policy's loader reports it with its own message next
    elif at_load:
        return
    if config is None:
        return
    check_config_support(config, kind, mode, uses_lora=model.lora is not None,
                         uses_vllm=uses_vllm)  # fmt: skip
