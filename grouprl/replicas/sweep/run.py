"""Running the sweep: every registered architecture in worker processes, one result per row.

`targets()` lists (kind, name, architecture class) for every model type in transformers'
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and every
diffusers pipeline replica. `run_sweep` hands them to `jobs` worker processes (worker.py); each
architecture runs under `limit_s` seconds (the worker's alarm); a worker that does not answer
within limit_s + GRACE_S (a kernel that never returns to Python) or that dies is killed, its
architecture recorded as failed with the reason, and a new worker started.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from queue import Empty, Queue
from typing import Any

from grouprl.replicas.sweep.worker import READY, RESULT

GRACE_S = 60.0
WARM_UP_S = 900.0  # a worker's imports and replica builds, before its first architecture


def targets(only: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(kind, name, architecture) of every row: causal LMs and image-text-to-text models by model
    type (architecture: the class name config.json's `architectures` holds), diffusion pipelines
    by replica name. only: keep rows whose name or architecture is listed."""
    from transformers.models.auto import modeling_auto

    from grouprl.replicas.sweep.diffusion import pipeline_replicas

    rows = [("causal_lm", t, c) for t, c in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()]
    rows += [("image_text_to_text", t, c)
             for t, c in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()]  # fmt: skip
    rows += [("diffusion", n, n) for n in pipeline_replicas()]
    if only:
        unknown = set(only) - {r[1] for r in rows} - {r[2] for r in rows}
        if unknown:
            raise ValueError(f"--only: no registered architecture or model type {sorted(unknown)}")
        rows = [r for r in rows if r[1] in only or r[2] in only]
    return rows


class _Worker:
    def __init__(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grouprl.replicas.sweep.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=env,
        )  # fmt: skip
        self.ready = self._wait_ready()

    def _wait_ready(self) -> bool:
        end = time.monotonic() + WARM_UP_S
        while (left := end - time.monotonic()) > 0:
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                return False
            if line.startswith(READY):
                return True
        self.kill()
        return False

    def ask(self, request: dict, deadline_s: float) -> dict | str:
        """The result dict, or a string saying why none came (the worker is then dead)."""
        if not self.ready:
            return f"the worker process did not start within {WARM_UP_S:g} s"
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return f"the worker process died (exit {self.proc.poll()})"
        end = time.monotonic() + deadline_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                self.kill()
                return f"time limit: no answer within {deadline_s:g} s (worker killed)"
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                return f"the worker process died (exit {code}) while checking it"
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT) :])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def run_sweep(
    rows: list[tuple[str, str, str]],
    *,
    jobs: int = 1,
    limit_s: float = 180.0,
    vllm: bool = False,
    progress: Callable[[str], None] | None = None,
    journal: Path | None = None,
) -> dict[tuple[str, str], dict]:
    """{(kind, name): {"architecture", "checks": {check: {"status", "reason"}}, "seconds"}}.
    journal: a JSON-lines file each row is appended to as it completes; rows already in it are
    taken from it, not rerun (an interrupted sweep resumes where it stopped)."""
    from grouprl.replicas.sweep.checks import CHECKS
    from grouprl.replicas.sweep.diffusion import DIFFUSION_CHECKS

    out: dict[tuple[str, str], dict] = {}
    if journal is not None and journal.is_file():
        for line in journal.read_text().splitlines():
            done = json.loads(line)
            out[(done["kind"], done["name"])] = done["row"]
    todo: Queue = Queue()
    for row in rows:
        if (row[0], row[1]) not in out:
            todo.put(row)
    out = {k: v for k, v in out.items() if k in {(r[0], r[1]) for r in rows}}
    lock = threading.Lock()

    def loop() -> None:
        worker = _Worker()
        try:
            while True:
                try:
                    kind, name, arch = todo.get_nowait()
                except Empty:
                    return
                start = time.monotonic()
                req = {"kind": kind, "name": name, "limit_s": limit_s, "vllm": vllm}
                res = worker.ask(req, limit_s + GRACE_S)
                if isinstance(res, str):  # no answer: the first check fails with the reason
                    names = DIFFUSION_CHECKS if kind == "diffusion" else CHECKS
                    res = {names[0]: {"status": "fail", "reason": res}} | {
                        c: {"status": "skip", "reason": "not run: the worker died"}
                        for c in names[1:]
                    }
                    worker = _Worker()
                seconds = round(time.monotonic() - start, 1)
                with lock:
                    out[(kind, name)] = {"architecture": arch, "checks": res, "seconds": seconds}
                    if journal is not None:
                        with journal.open("a") as f:
                            f.write(json.dumps({"kind": kind, "name": name,
                                                "row": out[(kind, name)]}) + "\n")  # fmt: skip
                    if progress:
                        marks = " ".join(f"{c}:{v['status']}" for c, v in res.items())
                        progress(f"[{len(out)}/{len(rows)}] {kind} {name} {seconds}s {marks}")
        finally:
            worker.close()

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def sweep_meta(command: str, seconds: float, jobs: int, limit_s: float) -> dict[str, Any]:
    """Versions, date, machine, command and time of a sweep."""
    import datetime
    import platform

    import diffusers
    import peft
    import torch
    import transformers

    return {
        "versions": {"transformers": transformers.__version__, "diffusers": diffusers.__version__,
                     "peft": peft.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "command": command,
        "sweep_seconds": round(seconds, 1),
        "jobs": jobs,
        "limit_s": limit_s,
    }  # fmt: skip
