"""The orchestrator's relay of its run's spans (docs/observability.md, Traces): the Celery
pool processes push each task's spans onto the run's span list in Redis
(`tasks.task_spans`); a daemon thread here pops them in batches, adds the orchestrator's own
ended since the last batch, and POSTs each batch to the collector as one request, over
OTLP/HTTP or gRPC as the standard `OTEL_*` variables say (`tasks.otlp_target`). A batch is
the entries' bytes concatenated: each entry is a serialized `ExportTraceServiceRequest`, and
protobuf parses concatenated messages as one with their repeated fields (`resource_spans`)
appended, each keeping its resource.

A batch the collector does not take (down, or answering 429/5xx) goes back to the head of
the list, logged once, and is tried again; while it waits, the list keeps its newest
`SPANS_HELD_MAX` entries (`tasks.tracing.hold_spans`). A batch refused for good (another
4xx) is dropped and counted. At the run's end the relay sends what is left before the
orchestrator exits; what it could not send waits in Redis for the run's next orchestrator.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import os
import threading
import time
import zlib
from pathlib import Path

from tasks import tracing
from tasks.otlp_target import OtlpTarget, otlp_target
from transport.connection import connect_redis
from transport.keys import RunKeys

log = logging.getLogger("rlship.span_relay")

BATCH_ENTRIES = 256  # a task's spans each: a request of well under a MiB
POLL_SECONDS = 1.0  # a list emptied is looked at again after this
RETRY_SECONDS = 2.0  # after a batch the collector did not take
# At the run's end: the list is sent until it has stayed empty this long (the last tasks'
# pushes, just after their step was released), or for at most `STOP_SECONDS`.
QUIET_SECONDS = 1.0
STOP_SECONDS = 10.0
RETRYABLE_STATUS = frozenset({429, 502, 503, 504})  # the OTLP/HTTP specification's
# gRPC's, as the OTLP specification lists them (RESOURCE_EXHAUSTED: the collector's throttling)
RETRYABLE_GRPC_CODES = frozenset(
    {
        "CANCELLED",
        "DEADLINE_EXCEEDED",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNAVAILABLE",
        "DATA_LOSS",
        "RESOURCE_EXHAUSTED",
    }
)
GRPC_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class OtlpHttpSender:
    """POSTs a body of OTLP protobuf to a target; True if the collector took it, False if
    it may later (not answering, 429, 5xx); raises `Refused` if it never will."""

    def __init__(self, target: OtlpTarget) -> None:
        import requests

        self.target = target
        self.session = requests.Session()
        self.session.headers.update({"Content-Type": "application/x-protobuf", **target.headers})
        if target.compression != "none":
            self.session.headers["Content-Encoding"] = target.compression
        self.session.verify = target.certificate or True
        if target.client_certificate and target.client_key:
            self.session.cert = (target.client_certificate, target.client_key)
        elif target.client_certificate:
            self.session.cert = target.client_certificate

    def send(self, body: bytes) -> bool:
        import requests

        if self.target.compression == "gzip":
            body = gzip.compress(body)
        elif self.target.compression == "deflate":
            body = zlib.compress(body)
        try:
            answer = self.session.post(self.target.url, data=body, timeout=self.target.timeout_seconds)
        except requests.RequestException:
            return False
        if answer.ok:
            return True
        if answer.status_code in RETRYABLE_STATUS:
            return False
        raise Refused(f"{self.target.url} answered {answer.status_code}: {answer.text[:200]!r}")

    def close(self) -> None:
        self.session.close()


class OtlpGrpcSender:
    """Sends a body of OTLP protobuf (a serialized `ExportTraceServiceRequest`) to a
    collector's gRPC trace service as it is, unparsed: True if the collector took it, False
    if it may later (a retryable status), raises `Refused` if it never will."""

    def __init__(self, target: OtlpTarget) -> None:
        import grpc

        self.target = target
        compression = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}
        options = {"compression": compression.get(target.compression, grpc.Compression.NoCompression)}
        if target.insecure:
            self.channel = grpc.insecure_channel(target.url, **options)
        else:

            def read(path: str | None) -> bytes | None:
                return Path(path).read_bytes() if path else None

            credentials = grpc.ssl_channel_credentials(
                read(target.certificate), read(target.client_key), read(target.client_certificate)
            )
            self.channel = grpc.secure_channel(target.url, credentials, **options)
        # No serializers: the body goes as it is, the answer comes back as bytes.
        self.export = self.channel.unary_unary(GRPC_EXPORT_METHOD)
        self.metadata = tuple((key.lower(), value) for key, value in target.headers.items())

    def send(self, body: bytes) -> bool:
        import grpc

        try:
            self.export(body, metadata=self.metadata, timeout=self.target.timeout_seconds)
        except grpc.RpcError as error:
            code = error.code()
            if code is None or code.name in RETRYABLE_GRPC_CODES:
                return False
            raise Refused(f"{self.target.url} answered {code.name}: {error.details()!r}") from None
        return True

    def close(self) -> None:
        self.channel.close()


class Refused(Exception):
    """The collector refused a batch for good (a 4xx other than 429)."""


class SpanRelay:
    """The relay thread of run `run_id` (`start`, `stop`)."""

    def __init__(self, redis_url: str, run_id: str, target: OtlpTarget) -> None:
        self.run_id = run_id
        self.keys = RunKeys(run_id)
        self.client = connect_redis(redis_url)  # the thread's own
        self.sender = OtlpGrpcSender(target) if target.protocol == "grpc" else OtlpHttpSender(target)
        self.relayed = 0  # entries the collector took
        self._stopping = threading.Event()
        self._failing = False  # logged once until a batch goes through again
        self._thread = threading.Thread(target=self._run, name="rlship-span-relay", daemon=True)

    @classmethod
    def for_run(cls, redis_url: str, run_id: str) -> SpanRelay | None:
        """The relay a run needs: one when tracing is on, else None."""
        if not tracing.enabled() or tracing.problem() is not None:
            return None
        return cls(redis_url, run_id, otlp_target(os.environ))

    def start(self) -> SpanRelay:
        self._thread.start()
        return self

    def relay_once(self) -> int | None:
        """Send one batch from the list: how many entries went; 0 when the list is empty,
        None when the batch went back (the collector or Redis not answering)."""
        try:
            batch = self.client.lpop(self.keys.spans, BATCH_ENTRIES) or []
        except Exception:
            self._failed("reading the span list from Redis failed")
            return None
        own = self._own_spans()
        if own is not None:
            batch.append(own)
        if not batch:
            return 0
        try:
            sent = self.sender.send(b"".join(batch))
        except Refused as refused:
            log.error("rlship: %d entries of spans dropped: %s", len(batch), refused)
            with contextlib.suppress(Exception):  # counted if Redis answers
                tracing.count_dropped_spans(self.client, self.run_id, len(batch))
            return len(batch)
        if not sent:
            try:
                tracing.hold_spans(self.client, self.run_id, batch, oldest=True)
            except Exception:
                log.exception("rlship: %d entries of spans lost: Redis did not take them back", len(batch))
            url = self.sender.target.url
            self._failed(f"the OTLP collector at {url} did not take {len(batch)} entries of spans")
            return None
        if self._failing:
            log.warning("rlship: the OTLP collector takes the run's spans again")
        self._failing = False
        self.relayed += len(batch)
        return len(batch)

    @staticmethod
    def _own_spans() -> bytes | None:
        """This process's own spans ended since the last batch (the step roots and prepare
        enqueues, `orchestrator.step_traces`), as one entry; None when there are none."""
        spans = tracing.tracing("orchestrator").task_spans
        taken = spans.take()
        return spans.request(taken) if taken else None

    def _failed(self, what: str) -> None:
        if not self._failing:
            log.warning("rlship: %s; they wait in Redis (%s) and are tried again", what, self.keys.spans)
        self._failing = True

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                sent = self.relay_once()
            except Exception:  # never the end of the relay: logged, tried again
                log.exception("rlship: relaying spans failed")
                sent = None
            if sent is None:
                self._stopping.wait(RETRY_SECONDS)
            elif sent < BATCH_ENTRIES:  # the list emptied: let it fill for one request, not one a task
                self._stopping.wait(POLL_SECONDS)

    def stop(self) -> None:
        """Stop the thread, then send what is left until the list stays empty for
        `QUIET_SECONDS` (or `STOP_SECONDS` have passed, or a batch does not go)."""
        self._stopping.set()
        self._thread.join()
        deadline, left = time.monotonic() + STOP_SECONDS, 0
        quiet_since = time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - quiet_since < QUIET_SECONDS:
            sent = self.relay_once()
            if sent is None:
                break
            if sent:
                quiet_since = time.monotonic()
            else:
                time.sleep(POLL_SECONDS / 5)
        with contextlib.suppress(Exception):
            left = self.client.llen(self.keys.spans)
        if left:
            log.warning("rlship: %d entries of spans wait in Redis for the run's next orchestrator", left)
        self.sender.close()
        self.client.close()
