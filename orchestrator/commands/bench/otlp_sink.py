"""A local OTLP/HTTP receiver that reads and discards what it is sent, for the
`celery-traced` placement of `rlship bench loop`: the placement's processes export every
span as they would to a collector, and the bench counts the requests and bytes (a figure
of zero means tracing was not on). It runs in the bench process, whose CPU is not the
ship path's: a collector runs elsewhere."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class OtlpSink:
    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a collector does

            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length", 0))
                self.rfile.read(size)
                with sink._lock:
                    sink.requests += 1
                    sink.bytes += size
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """What OTEL_EXPORTER_OTLP_ENDPOINT is set to (the exporters append /v1/traces)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> dict[str, int]:
        self._server.shutdown()
        self._server.server_close()
        return {"requests": self.requests, "bytes": self.bytes}
