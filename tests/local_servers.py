"""Local HTTP servers on 127.0.0.1 (stdlib http.server in a daemon thread, a free port chosen by
the OS) for the tests of the remote rewards: each request's JSON is logged, and a handler function
decides the answer."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# handler(path, request json, call number from 0) -> (status, answer json or raw bytes, delay s)
Handler = Callable[[str, Any, int], tuple[int, Any, float]]


@contextmanager
def serve(handler: Handler) -> Iterator[tuple[str, list]]:
    """Yields (http://127.0.0.1:PORT, log of (path, request json, headers) per request)."""
    log: list = []
    lock = threading.Lock()

    class H(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                call = len(log)
                log.append((self.path, body, dict(self.headers)))
            status, answer, delay = handler(self.path, body, call)
            time.sleep(delay)
            raw = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
            except (BrokenPipeError, ConnectionResetError):  # the client timed out first
                pass

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), H)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log
    finally:
        server.shutdown()
        server.server_close()


def chat_answer(text: str) -> dict:
    """An OpenAI chat-completions response carrying `text`."""
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": "stop"}],
    }  # fmt: skip
