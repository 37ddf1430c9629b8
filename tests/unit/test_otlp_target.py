"""The OTLP target of the orchestrator's span relay (docs/observability.md, Traces), from
the standard variables as the OpenTelemetry exporter specification and the Python SDK
document them: over HTTP the traces endpoint used as given, the general one with
`/v1/traces` appended; over gRPC the endpoint's host and port, insecure for `http://` (or
as `OTEL_EXPORTER_OTLP_INSECURE` says when the scheme is not `https`); the traces-specific
variable before the general one; headers `key=value` pairs, comma-separated, values
URL-decoded; the timeout in seconds (the Python SDK's unit); compression gzip or none (and
deflate, as the Python SDK accepts). A bad value is one line
naming the variable and its value, and `rlship run` refuses with it."""

from __future__ import annotations

import pytest

from tasks import tracing
from tasks.otlp_target import OtlpTarget, otlp_target


def test_nothing_but_the_endpoint_gives_the_defaults():
    assert otlp_target({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}) == OtlpTarget(
        url="http://collector:4318/v1/traces",
        headers={},
        timeout_seconds=10.0,
        compression="none",
        certificate=None,
        client_certificate=None,
        client_key=None,
    )


@pytest.mark.parametrize(
    ("environ", "url"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}, "http://collector:4318/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://otlp.example/base"}, "https://otlp.example/base/v1/traces"),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://general:4318",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4318/custom/path",
            },
            "http://traces:4318/custom/path",
        ),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4318"}, "http://traces:4318"),
    ],
)
def test_the_url(environ, url):
    assert otlp_target(environ).url == url


def test_every_setting_traces_specific_first():
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318",
        "OTEL_EXPORTER_OTLP_HEADERS": "api-key=general",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "api-key=secret%20value,X-Tenant = team-a ",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "30",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2.5",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "none",
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "GZIP",
        "OTEL_EXPORTER_OTLP_CERTIFICATE": "/etc/general-ca.pem",
        "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": "/etc/ca.pem",
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": "/etc/client.pem",
        "OTEL_EXPORTER_OTLP_CLIENT_KEY": "/etc/client.key",
    }
    assert otlp_target(environ) == OtlpTarget(
        url="https://collector:4318/v1/traces",
        headers={"api-key": "secret value", "x-tenant": "team-a"},
        timeout_seconds=2.5,
        compression="gzip",
        certificate="/etc/ca.pem",
        client_certificate="/etc/client.pem",
        client_key="/etc/client.key",
    )


def test_the_general_variables_when_no_traces_one_is_set():
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20t0ken",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "7",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "deflate",
    }
    target = otlp_target(environ)
    assert (target.headers, target.timeout_seconds, target.compression) == (
        {"authorization": "Bearer t0ken"},
        7.0,
        "deflate",
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OTEL_EXPORTER_OTLP_TIMEOUT", "ten"),
        ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0"),
        ("OTEL_EXPORTER_OTLP_COMPRESSION", "brotli"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "collector:4318"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable_and_the_value(monkeypatch, name, value):
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", name: value}
    with pytest.raises(ValueError) as raised:
        otlp_target(environ)
    assert name in str(raised.value) and repr(value) in str(raised.value) and "\n" not in str(raised.value)
    # `rlship run` refuses with that line (`tracing.problem`).
    for variable in list(environ):
        monkeypatch.setenv(variable, environ[variable])
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    assert tracing.problem() == str(raised.value)


@pytest.mark.parametrize(
    ("environ", "address", "insecure"),
    [
        ({}, "localhost:4317", True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, "collector:4317", True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317"}, "collector:4317", False),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317", "OTEL_EXPORTER_OTLP_INSECURE": "true"},
            "collector:4317",
            False,
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
                "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "false",
            },
            "collector:4317",
            False,
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://general:4317",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4317/not/a/path",
            },
            "traces:4317",
            True,
        ),
    ],
)
def test_grpc_takes_the_endpoints_host_and_port_and_whether_it_is_insecure(environ, address, insecure):
    target = otlp_target({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", **environ})
    assert (target.protocol, target.url, target.insecure) == ("grpc", address, insecure)


def test_an_unsupported_protocol_is_one_line_naming_it():
    with pytest.raises(ValueError) as raised:
        otlp_target({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})
    assert (
        str(raised.value)
        == "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: 'http/json' is not supported (http/protobuf or grpc)"
    )
