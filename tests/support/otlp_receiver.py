"""A real OTLP/HTTP trace receiver for tests: a threaded HTTP server in the test process
that decodes each `POST /v1/traces` body as the protocol's
`ExportTraceServiceRequest` (the `opentelemetry-proto` package, not the SDK that sent it)
and keeps every span with its resource's attributes."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.processes import require_module


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_id: str  # "" for a root
    name: str
    kind: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: tuple[tuple[str, str], ...]  # (trace id, span id)
    status_code: int
    start_ns: int
    end_ns: int


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


@dataclass
class OtlpReceiver:
    """Listening on 127.0.0.1 (on `port`, or any free one) from `start` to `stop`;
    `endpoint` is what OTEL_EXPORTER_OTLP_ENDPOINT is set to (the exporter appends /v1/traces)."""

    port: int = 0
    protocol: str = "http/protobuf"  # what OTEL_EXPORTER_OTLP_PROTOCOL is set to
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    def start(self) -> OtlpReceiver:
        trace_service = require_module("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service.ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._take(request)
                reply = trace_service.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _take(self, request: Any) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            name=span.name,
                            kind=span.kind,
                            attributes=_attributes(span.attributes),
                            resource=resource,
                            links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                            status_code=span.status.code,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        with self._lock:
            self.spans.extend(received)
            self.requests += 1

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


@dataclass
class OtlpGrpcReceiver(OtlpReceiver):
    """The same over gRPC: a real `grpcio` server answering the OTLP trace service's
    `Export`, decoding each request with `opentelemetry-proto`; `endpoint` is an
    `http://` URL (insecure, as the SDK reads it)."""

    protocol: str = "grpc"
    _grpc_server: Any = None

    def start(self) -> OtlpGrpcReceiver:
        grpc = require_module("grpc")
        trace_service = require_module("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

        def export(request: Any, context: Any) -> Any:
            self._take(request)
            return trace_service.ExportTraceServiceResponse()

        handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {
                "Export": grpc.unary_unary_rpc_method_handler(
                    export,
                    request_deserializer=trace_service.ExportTraceServiceRequest.FromString,
                    response_serializer=trace_service.ExportTraceServiceResponse.SerializeToString,
                )
            },
        )
        from concurrent.futures import ThreadPoolExecutor

        self._grpc_server = grpc.server(ThreadPoolExecutor(max_workers=2), handlers=[handler])
        self.port = self._grpc_server.add_insecure_port(f"127.0.0.1:{self.port}")
        self._grpc_server.start()
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._grpc_server is not None:
            self._grpc_server.stop(grace=None)
