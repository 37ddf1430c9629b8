"""The OTLP/HTTP target the standard `OTEL_EXPORTER_OTLP_*` variables name, read as the
Python SDK's exporter reads them, for what sends encoded spans itself (the orchestrator's
relay, `orchestrator.span_relay`): the SDK's exporter takes spans, and its configuration has
no public form that sends bytes. `tasks.tracing.problem` checks it before a run starts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_ENDPOINT = "http://localhost:4318"  # the SDK's, when no endpoint is set


@dataclass(frozen=True)
class OtlpHttpTarget:
    """Where and how the relay POSTs, as the standard variables say (`otlp_http_target`)."""

    url: str
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


def otlp_http_target(environ: Mapping[str, str]) -> OtlpHttpTarget:
    """The OTLP/HTTP target the standard variables name, read as the Python SDK's
    exporter reads them (its configuration has no public form that sends bytes): the traces
    endpoint as given, or the general one with `/v1/traces`; headers `k=v,...` (URL-encoded
    values); the timeout in seconds; compression `gzip`, `deflate` or `none`; the CA
    certificate and the client's certificate and key files. ValueError, one line naming the
    variable and its value, for a value that is not one of these."""
    from opentelemetry.util.re import parse_env_headers

    traces_endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or DEFAULT_ENDPOINT
    url = traces_endpoint or f"{base.removesuffix('/')}/v1/traces"
    if not url.startswith(("http://", "https://")):
        name = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" if traces_endpoint else "OTEL_EXPORTER_OTLP_ENDPOINT"
        raise ValueError(f"{name}: {url!r} is not an http:// or https:// URL")
    target: dict[str, Any] = {"url": url}
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
    return OtlpHttpTarget(**target)
