"""The JSON-over-HTTP plumbing shared by the two local servers of this project: `grouprl
vllm-serve` (engines/server/app.py) and the OpenAI-compatible gateway (rollouts/gateway/server.py).
Both are stdlib `http.server` handlers on 127.0.0.1 that answer every request, errors included,
with one JSON body and an exact Content-Length (HTTP/1.1 keep-alive)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any


class JsonHandler(BaseHTTPRequestHandler):
    """A request handler that answers JSON; subclasses route (do_GET / do_POST)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
        pass  # no per-request lines on stderr

    def _send(self, status: int, payload: dict, close: bool = False) -> None:
        """close: the body was not read to its end, so the connection cannot carry another request."""
        data = json.dumps(payload).encode()
        self.send_response(status)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
