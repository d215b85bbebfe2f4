"""The HTTP (JSON) API of `grouprl vllm-serve`: one VLLMEngine (engines/vllm.py) in its own process,
shared by 1..N trainer processes, plus the weight-update channel (channel.py, worker.py).

Endpoints (stdlib `http.server`, one thread per connection, like rollouts/gateway/server.py):
  GET  /health           {"ok": true}
  GET  /info             model, dtype, tensor_parallel_size, weight version, instance id, eos ids,
                         stats (engine seconds and tokens generated, pushes and their seconds)
  POST /generate         {prompt_token_ids: [[int]], seeds?: [int] (one per prompt),
                          sampling: {temperature, top_p, top_k, max_new_tokens, stop}, greedy?,
                          min_version?} -> {completion_ids, logprobs, truncated, versions, version}
  POST /weights/channel  {host, port, tag, backend, timeout_s}: every worker joins the trainer's
                          channel (answered at once, 202; the join completes with the trainer's)
  POST /weights/update   {kind: full|lora, params: [{name, shape, dtype}], scalings?, aliases?}:
                          the workers start receiving the announced tensors (202); the trainer
                          broadcasts them; aliases {name: [other names of the same tensor]} (a
                          tied head: each tensor travels once, see vllm_push.py)
  POST /weights/finish   {timeout_s}: waits for the receive to end, resets the prefix cache,
                          version += 1 -> {version, not_loaded} (vLLM parameters the last push
                          did not load)
Generation semantics are VLLMEngine's (prompt runs -> one request with n samples, per-completion
seeds, processed log-probs, stop strings / EOS kept). Requests are batched: the first waiting
request and those that arrive within --batch-window-ms (or wait while the engine is busy) with equal
sampling settings run as one engine call, so the shares of several trainers are generated
together. A request without seeds gets them drawn when it arrives, and every completion has its
own seed, so a request's samples do not depend on what it was batched with.

Versions: the server starts at version 0 (its model folder's weights) and adds 1 per push. A
generate request with `min_version` v = version + 1 waits (up to the server's --request-timeout)
for the push that brings it, v further ahead is answered 409 at once; a request is never answered
with older weights than it asked for. Every
completion carries the version that produced it.

Errors: JSON {"error": {"message", "type"}} with 400 (bad JSON or fields), 404 (route), 409
(version not reached in time; a push while one is in flight), 411 / 413 (body), 503 (engine busy
past the timeout), 500 (an engine or channel failure, named).
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any

from grouprl.policies.text.engines.base import (
    GenerationOutput,
    SamplingParams,
    check_generate_args,
)
from grouprl.policies.text.engines.server.channel import DTYPES
from grouprl.policies.text.engines.server.http import JsonHandler

MAX_BODY = 64 << 20  # bytes (prompt ids of a large batch)
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "max_new_tokens", "stop"}
GENERATE_FIELDS = {"prompt_token_ids", "seeds", "sampling", "greedy", "min_version"}


@dataclass
class _Job:
    """One generate request waiting for the engine."""

    prompts: list[list[int]]
    seeds: list[int]
    params: SamplingParams
    greedy: bool
    done: Future = field(default_factory=Future)

    def key(self) -> tuple:
        p = self.params
        return (p.temperature, p.top_p, p.top_k, p.max_new_tokens, tuple(p.stop), self.greedy)


class ServerError(Exception):
    """A refused request: the HTTP status and a message naming what is wrong."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def _int_rows(value: Any, field: str) -> list[list[int]]:
    if not isinstance(value, list) or not all(
        isinstance(r, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in r)
        for r in value
    ):
        raise ServerError(400, f"{field} must be a list of lists of token ids (ints)")
    return value


class VLLMServer:
    """The state behind the endpoints: the engine, its lock, the weight version and the channel.

    engine: a VLLMEngine whose LLM was built with grouprl's WeightReceiver worker extension.
    info: static facts reported by /info (model, dtype, tensor_parallel_size).
    request_timeout_s: how long a request waits for the engine or for a weight version.
    """

    def __init__(
        self, engine: Any, info: dict, *, request_timeout_s: float = 600.0,
        batch_window_s: float = 0.01,
    ) -> None:  # fmt: skip
        self.engine, self.info = engine, dict(info)
        self.request_timeout_s, self.batch_window_s = request_timeout_s, batch_window_s
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._seed_lock = threading.Lock()
        threading.Thread(target=self._batch_loop, name="grouprl-batcher", daemon=True).start()
        self.instance = uuid.uuid4().hex
        self.version = 0
        self.not_loaded: list[str] = []  # vLLM parameters the last push did not load
        self.lock = threading.Lock()  # one engine call at a time
        self.changed = threading.Condition()  # version updates
        self._op: threading.Thread | None = None  # a channel join or a weight receive
        self._op_error: BaseException | None = None
        self._op_name = ""
        self._http: ThreadingHTTPServer | None = None
        self.stats = {"generate_s": 0.0, "generated_tokens": 0, "requests": 0, "batches": 0,
                      "pushes": 0,
                      "push_s": 0.0}  # fmt: skip

    # ---- lifecycle -----------------------------------------------------------------------------

    def serve(self, host: str, port: int) -> ThreadingHTTPServer:
        handler = type("Handler", (_Handler,), {"server_state": self,
                                                "timeout": self.request_timeout_s})  # fmt: skip
        self._http = ThreadingHTTPServer((host, port), handler)
        self._http.daemon_threads = True
        return self._http

    # ---- endpoints -----------------------------------------------------------------------------

    def describe(self) -> dict:
        return {**self.info, "version": self.version, "instance": self.instance,
                "eos_ids": list(self.engine.eos_ids), "stats": dict(self.stats)}  # fmt: skip

    def generate(self, body: dict) -> dict:
        unknown = set(body) - GENERATE_FIELDS
        if unknown:
            raise ServerError(400, f"unknown field(s) {sorted(unknown)}; allowed: "
                                   f"{sorted(GENERATE_FIELDS)}")  # fmt: skip
        prompts = _int_rows(body.get("prompt_token_ids"), "prompt_token_ids")
        seeds = body.get("seeds")
        if seeds is not None and (
            not isinstance(seeds, list) or not all(isinstance(s, int) for s in seeds)
        ):
            raise ServerError(400, "seeds must be a list of ints (one per prompt) or absent")
        sampling = body.get("sampling", {})
        if not isinstance(sampling, dict) or set(sampling) - SAMPLING_FIELDS:
            raise ServerError(400, f"sampling must be an object with fields among "
                                   f"{sorted(SAMPLING_FIELDS)}, got {sampling!r}")  # fmt: skip
        greedy = body.get("greedy", False)
        if not isinstance(greedy, bool):
            raise ServerError(400, f"greedy must be true or false, got {greedy!r}")
        try:
            params = SamplingParams(**sampling)
        except (TypeError, ValueError) as exc:
            raise ServerError(400, str(exc)) from None
        min_version = body.get("min_version", 0)
        if not isinstance(min_version, int) or min_version < 0:
            raise ServerError(400, f"min_version must be an int >= 0, got {min_version!r}")
        try:
            check_generate_args("generate", prompts, seeds)
        except ValueError as exc:
            raise ServerError(400, str(exc)) from None
        self._wait_version(min_version)
        if not prompts:
            return {"completion_ids": [], "logprobs": [], "truncated": [], "versions": [],
                    "version": self.version}  # fmt: skip
        if seeds is None:  # drawn now, so a request's samples do not depend on its batch
            with self._seed_lock:
                seeds = self.engine.request_seeds(len(prompts))
        job = _Job(prompts, seeds, params, greedy)
        self._jobs.put(job)
        try:
            out, version = job.done.result(timeout=self.request_timeout_s)
        except FutureTimeout:
            raise ServerError(503, f"no result within {self.request_timeout_s}s (engine busy)",
                              "busy") from None  # fmt: skip
        return {"completion_ids": out.completion_ids, "logprobs": out.logprobs,
                "truncated": out.truncated, "versions": [version] * len(out.completion_ids),
                "version": version}  # fmt: skip

    def _batch_loop(self) -> None:
        """Takes the first waiting request, gathers those arriving within the batch window (and
        any already waiting), and runs each set with equal sampling settings as one generate."""
        while True:
            batch = [self._jobs.get()]
            deadline = time.monotonic() + self.batch_window_s
            while True:
                left = deadline - time.monotonic()
                try:
                    batch.append(
                        self._jobs.get(timeout=left) if left > 0 else self._jobs.get_nowait()
                    )
                except queue.Empty:
                    break
            groups: dict[tuple, list[_Job]] = {}
            for job in batch:
                groups.setdefault(job.key(), []).append(job)
            for jobs in groups.values():
                self._run(jobs)

    def _run(self, jobs: list[_Job]) -> None:
        if not self.lock.acquire(timeout=self.request_timeout_s):
            for job in jobs:
                job.done.set_exception(ServerError(503, "the engine stayed busy", "busy"))
            return
        try:
            version = self.version  # pushes take the same lock: these weights are this version
            start = time.perf_counter()
            prompts = [p for job in jobs for p in job.prompts]
            seeds = [x for job in jobs for x in job.seeds]
            out = self.engine.generate(prompts, jobs[0].params, greedy=jobs[0].greedy, seeds=seeds)
            self.stats["generate_s"] += time.perf_counter() - start
            self.stats["generated_tokens"] += sum(len(c) for c in out.completion_ids)
            self.stats["requests"] += len(jobs)
            self.stats["batches"] += 1
            at = 0
            for job in jobs:
                n = len(job.prompts)
                part = GenerationOutput(out.completion_ids[at : at + n], out.logprobs[at : at + n],
                                        out.truncated[at : at + n])  # fmt: skip
                job.done.set_result((part, version))
                at += n
        except Exception as exc:  # an engine failure fails every request of the batch (a 500)
            for job in jobs:
                if not job.done.done():
                    job.done.set_exception(exc)
        finally:
            self.lock.release()

    def _wait_version(self, needed: int) -> None:
        """Waits for the next push when it brings the version asked for; further ahead: 409."""
        if needed > self.version + 1:
            raise ServerError(
                409, f"weights version {needed} was asked for, but the server holds version "
                f"{self.version} (a push adds 1): is this client talking to another run's "
                "server, or was the server restarted? Resume the run (run.resume=true)",
                "stale_weights",
            )  # fmt: skip
        with self.changed:
            if not self.changed.wait_for(lambda: self.version >= needed, self.request_timeout_s):
                raise ServerError(
                    409, f"weights version {needed} was asked for, but the server still holds "
                    f"version {self.version} after {self.request_timeout_s}s (no push arrived)",
                    "stale_weights",
                )  # fmt: skip

    def open_channel(self, body: dict) -> dict:
        need = {"host", "port", "tag", "backend", "timeout_s"}
        if set(body) != need:
            raise ServerError(400, f"/weights/channel takes exactly {sorted(need)}")
        if body["backend"] not in ("gloo", "nccl"):
            raise ServerError(400, f"backend must be gloo or nccl, got {body['backend']!r}")
        world = 1 + int(self.info["tensor_parallel_size"])
        args = (str(body["host"]), int(body["port"]), str(body["tag"]), body["backend"],
                float(body["timeout_s"]), world)  # fmt: skip

        def join() -> None:
            with self._locked("channel join"):
                self.engine.llm.collective_rpc("grouprl_join_channel", args=args)

        self._start_op("channel join", join)
        return {"world": world}

    def start_update(self, body: dict) -> dict:
        kind, params = body.get("kind"), body.get("params")
        scalings, aliases = body.get("scalings", {}), body.get("aliases", {})
        if set(body) - {"kind", "params", "scalings", "aliases"}:
            raise ServerError(400, "/weights/update takes kind, params, scalings, aliases")
        if not isinstance(aliases, dict) or not all(
            isinstance(v, list) and all(isinstance(n, str) for n in v) for v in aliases.values()
        ):
            raise ServerError(400, "aliases must map a weight name to a list of names")
        if kind not in ("full", "lora"):
            raise ServerError(400, f"kind must be full or lora, got {kind!r}")
        if not isinstance(params, list) or not params:
            raise ServerError(400, "params must be a non-empty list of {name, shape, dtype}")
        for p in params:
            if (
                not isinstance(p, dict) or set(p) != {"name", "shape", "dtype"}
                or p["dtype"] not in DTYPES or not isinstance(p["shape"], list)
            ):  # fmt: skip
                raise ServerError(
                    400, f"bad param entry {p!r}: needs name, shape (list), dtype in {list(DTYPES)}"
                )
        if kind == "lora" and not isinstance(scalings, dict):
            raise ServerError(400, "scalings must map weight names to floats")

        def receive() -> None:
            self.engine._wake()  # sleep is GPU only; a no-op otherwise
            with self._locked("weight receive"):
                start = time.perf_counter()
                reports = self.engine.llm.collective_rpc(
                    "grouprl_receive", args=(kind, params, scalings, aliases)
                )
                self.not_loaded = sorted({n for r in reports for n in r["not_loaded"]})
                if not self.engine.llm.reset_prefix_cache():
                    raise RuntimeError("vLLM refused to reset its prefix cache after a push")
                self.stats["push_s"] += time.perf_counter() - start
                self.stats["pushes"] += 1
                with self.changed:
                    self.version += 1
                    self.changed.notify_all()

        self._start_op("weight receive", receive)
        return {"version": self.version + 1}

    def finish(self, body: dict) -> dict:
        timeout = float(body.get("timeout_s", self.request_timeout_s))
        op, name = self._op, self._op_name
        if op is not None:
            op.join(timeout)
            if op.is_alive():
                raise ServerError(504, f"the {name} did not end within {timeout}s", "timeout")
        self._op = None
        if self._op_error is not None:
            err, self._op_error = self._op_error, None
            raise ServerError(500, f"the {name} failed: {type(err).__name__}: {err}", "server")
        return {"version": self.version, "not_loaded": self.not_loaded}

    # ---- helpers -------------------------------------------------------------------------------

    def _locked(self, what: str) -> Any:
        server = self

        class _Ctx:
            def __enter__(self) -> None:
                if not server.lock.acquire(timeout=server.request_timeout_s):
                    raise RuntimeError(f"the engine stayed busy for {server.request_timeout_s}s "
                                       f"before the {what}")  # fmt: skip

            def __exit__(self, *exc: Any) -> None:
                server.lock.release()

        return _Ctx()

    def _start_op(self, name: str, fn: Any) -> None:
        if self._op is not None and self._op.is_alive():
            raise ServerError(409, f"a {self._op_name} is still in flight", "busy")

        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported by /weights/finish
                self._op_error = exc

        self._op_error, self._op_name = None, name
        self._op = threading.Thread(target=run, name=f"grouprl-{name}", daemon=True)
        self._op.start()


class _Handler(JsonHandler):
    """HTTP plumbing: route, read and parse the body, answer JSON (errors included)."""

    server_state: VLLMServer

    def _error(self, exc: ServerError, close: bool = False) -> None:
        err = {"error": {"message": exc.message, "type": exc.kind, "code": exc.status}}
        self._send(exc.status, err, close=close)

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        path = self.path.rstrip("/")
        if path == "/health":
            self._send(200, {"ok": True})
        elif path == "/info":
            self._send(200, self.server_state.describe())
        else:
            self._error(ServerError(404, f"no route GET {self.path}", "not_found"))

    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        s = self.server_state
        routes = {"/generate": (s.generate, 200), "/weights/channel": (s.open_channel, 202),
                  "/weights/update": (s.start_update, 202), "/weights/finish": (s.finish, 200)}  # fmt: skip
        try:
            route = routes.get(self.path.rstrip("/"))
            if route is None:
                raise ServerError(404, f"no route POST {self.path}", "not_found")
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise ServerError(411, "a Content-Length header is needed")
            if int(length) > MAX_BODY:
                raise ServerError(413, f"the body has {length} bytes; at most {MAX_BODY}")
            try:
                body = json.loads(self.rfile.read(int(length)))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ServerError(400, f"the body is not valid JSON: {exc}") from None
            if not isinstance(body, dict):
                raise ServerError(400, "the body must be a JSON object")
            fn, status = route
            self._send(status, fn(body))
        except ServerError as exc:
            self._error(exc, close=exc.status in (411, 413))
        except Exception as exc:  # an engine failure: a 500 naming it, not a hang
            self._error(ServerError(500, f"{type(exc).__name__}: {exc}", "server"))
