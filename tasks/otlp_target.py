"""The OTLP target the standard `OTEL_EXPORTER_OTLP_*` variables name, read as the Python
SDK's exporters read them, for what sends encoded spans itself (the orchestrator's relay,
`orchestrator.span_relay`): the SDK's exporters take spans, and their configuration has no
public form that sends bytes. `tasks.tracing.problem` checks it before a run starts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
# The SDK's endpoints when none is set: OTLP/HTTP's port, and gRPC's
DEFAULT_ENDPOINT = {"http/protobuf": "http://localhost:4318", "grpc": "http://localhost:4317"}


def protocol_of(environ: Mapping[str, str]) -> str:
    """The OTLP protocol the variables ask for (`http/protobuf` unless they say)."""
    for name in PROTOCOL_ENVS:
        if environ.get(name, "").strip():
            return environ[name].strip().lower()
    return "http/protobuf"


@dataclass(frozen=True)
class OtlpTarget:
    """Where and how the relay sends, as the standard variables say (`otlp_target`)."""

    url: str  # OTLP/HTTP: the traces URL; gRPC: the collector's address (host:port)
    protocol: str = "http/protobuf"  # or grpc
    insecure: bool = False  # gRPC: a channel without TLS
    headers: dict[str, str] = field(default_factory=dict)
    timeout_seconds: float = 10.0
    compression: str = "none"  # or gzip, deflate
    certificate: str | None = None  # a CA bundle to verify the collector with
    client_certificate: str | None = None
    client_key: str | None = None


def _variable(environ: Mapping[str, str], name: str) -> tuple[str, str] | None:
    """(the variable's name, its value): the traces-specific one first, then the general."""
    for full in (f"OTEL_EXPORTER_OTLP_TRACES_{name}", f"OTEL_EXPORTER_OTLP_{name}"):
        if environ.get(full, "").strip():
            return full, environ[full].strip()
    return None


def _grpc_address(environ: Mapping[str, str], endpoint: str) -> tuple[str, bool]:
    """(host:port, insecure) of a gRPC endpoint, as the SDK's gRPC exporter reads them: an
    `https` URL is secure; otherwise `OTEL_EXPORTER_OTLP_(TRACES_)INSECURE` says, or else an
    `http` URL is insecure."""
    parsed = urlparse(endpoint)
    insecure = False
    if parsed.scheme != "https":
        found = _variable(environ, "INSECURE")
        insecure = found[1].lower() == "true" if found else parsed.scheme == "http"
    return (parsed.netloc or endpoint), insecure


def otlp_target(environ: Mapping[str, str]) -> OtlpTarget:
    """The OTLP target the standard variables name, read as the Python SDK's exporters read
    them (their configuration has no public form that sends bytes): OTLP/HTTP's traces
    endpoint as given, or the general one with `/v1/traces`; gRPC's endpoint (either) as a
    host and port, and whether it is insecure; headers `k=v,...` (URL-encoded values); the
    timeout in seconds; compression `gzip`, `deflate` or `none`; the CA certificate and the
    client's certificate and key files. ValueError, one line naming the variable and its
    value, for a value that is not one of these."""
    from opentelemetry.util.re import parse_env_headers

    chosen = protocol_of(environ)
    if chosen not in DEFAULT_ENDPOINT:
        name = next(name for name in PROTOCOL_ENVS if environ.get(name, "").strip())
        raise ValueError(f"{name}: {chosen!r} is not supported (http/protobuf or grpc)")
    traces_endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or DEFAULT_ENDPOINT[chosen]
    target: dict[str, Any] = {"protocol": chosen}
    if chosen == "grpc":
        target["url"], target["insecure"] = _grpc_address(environ, traces_endpoint or base)
    else:
        url = traces_endpoint or f"{base.removesuffix('/')}/v1/traces"
        if not url.startswith(("http://", "https://")):
            name = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" if traces_endpoint else "OTEL_EXPORTER_OTLP_ENDPOINT"
            raise ValueError(f"{name}: {url!r} is not an http:// or https:// URL")
        target["url"] = url
    if found := _variable(environ, "HEADERS"):
        target["headers"] = parse_env_headers(found[1], liberal=True)
    if found := _variable(environ, "TIMEOUT"):
        try:
            target["timeout_seconds"] = float(found[1])
        except ValueError:
            raise ValueError(f"{found[0]}: {found[1]!r} is not a number of seconds") from None
        if target["timeout_seconds"] <= 0:
            raise ValueError(f"{found[0]}: {found[1]!r} must be above 0 seconds")
    if found := _variable(environ, "COMPRESSION"):
        if found[1].lower() not in ("gzip", "deflate", "none"):
            raise ValueError(f"{found[0]}: {found[1]!r} is not gzip, deflate or none")
        target["compression"] = found[1].lower()
    for name, key in (
        ("CERTIFICATE", "certificate"),
        ("CLIENT_CERTIFICATE", "client_certificate"),
        ("CLIENT_KEY", "client_key"),
    ):
        if found := _variable(environ, name):
            target[key] = found[1]
    return OtlpTarget(**target)
