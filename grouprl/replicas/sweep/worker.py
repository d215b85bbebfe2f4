"""One sweep worker process: reads `{"kind", "name", "limit_s", "vllm"}` lines on stdin, runs the
checks of each under a time limit (SIGALRM) and writes one result line per request on stdout,
prefixed with RESULT (model code prints to stdout too; those lines are ignored by the runner).

A worker outlives one architecture's failure (each check is caught) and its time limit (the
alarm stops the check that ran over; the checks after it are recorded as not run); a crash of
the process itself (a segfault in a kernel) is recorded by the runner, which starts a new worker.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from typing import Any

RESULT = "@@sweep-result@@ "
READY = "@@sweep-ready@@"


class TimeLimit(BaseException):
    """Raised by the alarm: a BaseException, so a check's own `except Exception` never swallows
    it and the sweep moves on to the next architecture."""


def _alarm(signum: int, frame: Any) -> None:
    raise TimeLimit()


def run_one(kind: str, name: str, limit_s: float, vllm: bool) -> dict[str, dict]:
    from grouprl.replicas.sweep.checks import CHECKS, check_architecture
    from grouprl.replicas.sweep.diffusion import DIFFUSION_CHECKS, check_pipeline

    names = DIFFUSION_CHECKS if kind == "diffusion" else CHECKS
    results: dict[str, dict] = {}
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        if kind == "diffusion":
            check_pipeline(name, results=results)
        else:
            check_architecture(kind, name, vllm=vllm, results=results)
    except TimeLimit:
        running = next((c for c in names if c not in results), None)
        for c in names:
            if c == running:
                results[c] = {"status": "fail", "reason": f"time limit: over {limit_s:g} s"}
            elif c not in results:
                results[c] = {"status": "skip", "reason": f"not run: {running} hit the time limit"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return {c: results[c] for c in names if c in results}


def warm_up() -> None:
    """One torch thread (tiny models gain nothing from more, and workers side by side would
    oversubscribe the cores: 6x slower per matmul measured with 3 workers on 2 cores); the imports
    and the replica folders every architecture uses, before the first time limit starts (so the
    first architecture of a worker is not charged for them)."""
    import peft  # noqa: F401
    import torch

    torch.set_num_threads(1)

    from grouprl.policies.text import causal_lm  # noqa: F401
    from grouprl.policies.vision import policy  # noqa: F401
    from grouprl.replicas.sweep import checks, diffusion  # noqa: F401

    checks.tokenizer()
    checks._replica_folder("qwen2-vl")


def main() -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever model code prints goes to stderr
    warm_up()
    out.write(READY + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        res = run_one(req["kind"], req["name"], req["limit_s"], req.get("vllm", False))
        out.write(RESULT + json.dumps(res) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
