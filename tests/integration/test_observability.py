"""Traces, metrics and logs reach a real OTLP/gRPC receiver, and say nothing secret.

The receiver is an in-process gRPC server implementing OpenTelemetry's collector
services (``opentelemetry-proto``). A second transition service, on the session's
database and PKI, exports to it; traced and untraced workers commit, are refused,
lose a compare-and-swap, park a risky change, call with a caller-chosen user-agent
and an unsampled trace context, and meet an unexpected failure, over mutual TLS.
Every exported byte is then searched for the state values, the attacker-chosen key
name, the user-agent, the exception's text and the HMAC key.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from tests.harness import INITIAL, TRUST_DOMAIN, Ledger, Pki, act, client, new_thread_id
from ztate.services.runtime.config import Settings
from ztate.services.runtime.identity import Identity, Role
from ztate.services.runtime.telemetry import SPAN_ATTRIBUTES
from ztate.transition_service.app import RunningService, start
from ztate.v1 import transition_pb2, transition_pb2_grpc
from ztate.worker_sdk import (
    AwaitingApproval,
    PermissionDenied,
    StaleVersion,
    Unavailable,
    ZtateClient,
    ZtateError,
)

# State values and a key name only the test knows: none may leave the service.
SENTINEL_TEXT = "sentinel-raw-text-5b1e0c9d"
SENTINEL_ORDER = "SENTINEL-ORDER-7F3A9C"
ATTACKER_KEY = "zz_attacker_chosen_6d2f"
# What a caller or a failure puts in front of the service: none may be exported.
USER_AGENT_SENTINEL = "ua-sentinel-3c8e1f77"
TRACESTATE_SENTINEL = "caller-chosen-tracestate-7f3a"
EXCEPTION_SENTINEL = "exception-sentinel-9a4d2b61"
LIBRARY_SENTINEL = "library-log-sentinel-51f0aa2e"
PROPOSE = "/ztate.v1.TransitionService/ProposeTransition"
WORKER_SERVICE = "observability-test-worker"
SERVICE = "ztate-transition-under-test"
OTHER_USER = "9b2f5d0e-1c3a-4e6b-8d7f-0a1b2c3d4e5f"
DEADLINE = 10.0


@dataclass
class Receiver:
    """What an OTLP collector was sent, request by request."""

    port: int = 0
    traces: list[trace_service_pb2.ExportTraceServiceRequest] = field(default_factory=list)
    metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = field(default_factory=list)
    logs: list[logs_service_pb2.ExportLogsServiceRequest] = field(default_factory=list)
    lock: threading.Condition = field(default_factory=threading.Condition)

    def received(self, kind: list[Any], request: Any) -> None:
        with self.lock:
            kind.append(request)
            self.lock.notify_all()

    async def wait_for(self, arrived: Callable[[], bool], what: str) -> None:
        """Until ``arrived()`` holds, woken by each export, with a deadline."""

        def wait() -> bool:
            with self.lock:
                return self.lock.wait_for(arrived, DEADLINE)

        assert await asyncio.to_thread(wait), f"{what} never arrived"

    def everything(self) -> bytes:
        with self.lock:
            return b"".join(
                r.SerializeToString() for r in [*self.traces, *self.metrics, *self.logs]
            )

    def spans(self) -> list[dict[str, Any]]:
        found = []
        with self.lock:
            requests = list(self.traces)
        for request in requests:
            for resource_spans in request.resource_spans:
                service = attributes(resource_spans.resource.attributes)["service.name"]
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        found.append(
                            {
                                "service": service,
                                "scope": scope_spans.scope.name,
                                "name": span.name,
                                "kind": span.kind,
                                "trace_id": span.trace_id,
                                "span_id": span.span_id,
                                "parent_span_id": span.parent_span_id,
                                "attributes": attributes(span.attributes),
                                "span": span,
                            }
                        )
        return found

    def metric_points(self, name: str) -> list[tuple[dict[str, Any], Any]]:
        points: list[tuple[dict[str, Any], Any]] = []
        with self.lock:
            requests = list(self.metrics)
        for request in requests:
            for resource_metrics in request.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        if metric.name != name:
                            continue
                        data = getattr(metric, metric.WhichOneof("data"))
                        points += [(attributes(p.attributes), p) for p in data.data_points]
        return points

    def log_records(self) -> list[tuple[str, Any]]:
        records: list[tuple[str, Any]] = []
        with self.lock:
            requests = list(self.logs)
        for request in requests:
            for resource_logs in request.resource_logs:
                service = attributes(resource_logs.resource.attributes)["service.name"]
                for scope_logs in resource_logs.scope_logs:
                    records += [(service, record) for record in scope_logs.log_records]
        return records


def attributes(pairs: Any) -> dict[str, Any]:
    def value(any_value: common_pb2.AnyValue) -> Any:
        kind = any_value.WhichOneof("value")
        return getattr(any_value, kind) if kind else None

    return {pair.key: value(pair.value) for pair in pairs}


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    def __init__(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:
        self._receiver.received(self._receiver.traces, request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):  # type: ignore[misc]
    def __init__(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:
        self._receiver.received(self._receiver.metrics, request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class _Logs(logs_service_pb2_grpc.LogsServiceServicer):  # type: ignore[misc]
    def __init__(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:
        self._receiver.received(self._receiver.logs, request)
        return logs_service_pb2.ExportLogsServiceResponse()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """An OTLP/gRPC receiver on a loopback port, on threads of its own (the exporters
    call it from their threads, and a flush blocks until it answered)."""
    received = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(received), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(received), server)
    logs_service_pb2_grpc.add_LogsServiceServicer_to_server(_Logs(received), server)
    received.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield received
    server.stop(grace=None).wait()


def traced_settings(settings: Settings, receiver: Receiver) -> Settings:
    return settings.model_copy(
        update={
            "otlp_endpoint": f"http://127.0.0.1:{receiver.port}",
            "otlp_insecure": True,
            "service_name": SERVICE,
            "metrics_interval_seconds": 600.0,  # exported by the test's flush only
            "outbox_interval_seconds": 0.05,  # background rounds all through the test
        }
    )


@pytest_asyncio.fixture
async def traced_service(
    settings: Settings, database_dsn: str, receiver: Receiver
) -> AsyncIterator[RunningService]:
    """A transition service whose telemetry goes to ``receiver``, its logs included
    (attached as ``install_globals`` attaches them, without the process-wide providers
    the rest of the test session must not inherit)."""
    running = await start(traced_settings(settings, receiver), dsn=database_dsn)
    running.telemetry.attach_logs()
    ztate_logs = logging.getLogger("ztate")
    level = ztate_logs.level
    ztate_logs.setLevel(logging.INFO)
    try:
        yield running
    finally:
        ztate_logs.setLevel(level)
        await running.stop(grace=1.0)


class EndedSpans(SpanProcessor):
    """Signals each ended span: a client span ends in the call's done callback, after
    the call returned."""

    def __init__(self) -> None:
        self.ended = 0
        self._changed = threading.Condition()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        with self._changed:
            self.ended += 1
            self._changed.notify_all()

    async def wait_for(self, count: int) -> None:
        def wait() -> bool:
            with self._changed:
                return self._changed.wait_for(lambda: self.ended >= count, DEADLINE)

        assert await asyncio.to_thread(wait), f"only {self.ended} of {count} spans ended"


def worker_tracing(receiver: Receiver) -> tuple[TracerProvider, EndedSpans]:
    provider = TracerProvider(resource=Resource.create({"service.name": WORKER_SERVICE}))
    ended = EndedSpans()
    provider.add_span_processor(ended)
    exporter = OTLPSpanExporter(f"http://127.0.0.1:{receiver.port}", insecure=True)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider, ended


def hmac_key_forms(keyring_file: Path) -> list[bytes]:
    """The HMAC keys as the keyring holds them (base64) and as the raw bytes and hex."""
    forms: list[bytes] = []
    for encoded in json.loads(keyring_file.read_text())["keys"].values():
        raw = base64.b64decode(encoded)
        forms += [encoded.encode(), raw, raw.hex().encode()]
    return forms


def only_ztate(span: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in span["attributes"].items() if k.startswith("ztate.")}


async def new_thread(target: str, pki: Pki, state: dict[str, Any] | None = None) -> str:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, state or INITIAL, policy="pipeline")
    return thread_id


async def propose_raw(
    target: str, pki: Pki, thread_id: str, version: int, patch: dict[str, Any], trace_id: str
) -> transition_pb2.ProposeTransitionResponse:
    """A proposal as a worker of its own making sends it: its own user-agent, and a
    W3C trace context whose flags say "not sampled"."""
    creds = pki.node("input-parser")
    credentials = grpc.ssl_channel_credentials(
        creds.ca.read_bytes(), creds.key.read_bytes(), creds.cert.read_bytes()
    )
    options = [("grpc.primary_user_agent", USER_AGENT_SENTINEL)]
    async with grpc.aio.secure_channel(target, credentials, options=options) as channel:
        stub = transition_pb2_grpc.TransitionServiceStub(channel)
        response: transition_pb2.ProposeTransitionResponse = await stub.ProposeTransition(
            transition_pb2.ProposeTransitionRequest(
                thread_id=thread_id,
                expected_version=version,
                patch_json=json.dumps(patch).encode(),
                idempotency_key=f"raw-{trace_id[:16]}",
            ),
            metadata=[
                ("traceparent", f"00-{trace_id}-{'5' * 16}-00"),
                # text of the caller's choosing the W3C context carries along: it must
                # not ride the service's spans to the collector
                ("tracestate", f"ztate={TRACESTATE_SENTINEL}"),
            ],
            timeout=10,
        )
    return response


async def test_traces_metrics_and_logs_reach_an_otlp_receiver_without_secrets(
    traced_service: RunningService,
    receiver: Receiver,
    pki: Pki,
    ledger: Ledger,
    keyring_file: Path,
    target: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    traced = f"localhost:{traced_service.port}"
    thread_id = await new_thread(traced, pki, {**INITIAL, "raw_text": SENTINEL_TEXT})
    worker_provider, worker_spans = worker_tracing(receiver)
    creds = pki.node("input-parser")
    async with ZtateClient.from_files(
        traced, cert=creds.cert, key=creds.key, ca=creds.ca, tracer_provider=worker_provider
    ) as worker:
        committed = await worker.propose(
            thread_id, 0, {"requested_action": {"action": "refund", "order_id": SENTINEL_ORDER}}
        )
        assert committed.version == 1
        with pytest.raises(PermissionDenied) as refused:
            await worker.propose(thread_id, 1, {ATTACKER_KEY: SENTINEL_TEXT})
        assert refused.value.reason == "KEY_NOT_WRITABLE"
        assert (await ledger.snapshot(thread_id)).head_version == 1  # the refusal wrote nothing
        # Another replica (the session's service) commits version 2; this service still
        # holds version 1 as the head, so its compare-and-swap is what refuses.
        async with client(target, creds) as elsewhere:
            assert (
                await elsewhere.propose(thread_id, 1, {"requested_action": act("second")})
            ).version == 2
        with pytest.raises(StaleVersion) as lost:
            await worker.propose(thread_id, 1, {"requested_action": act("lost")})
        assert lost.value.reason == "STALE_VERSION"
    assert (await ledger.snapshot(thread_id)).head_version == 2
    # A risky change is parked: one pending approval at least, waiting since now.
    async with client(traced, pki.node("planner")) as planner:
        with pytest.raises(AwaitingApproval):
            await planner.propose(thread_id, 2, {"target_user_id": OTHER_USER})
    # A caller that says "do not sample" and names itself is traced all the same,
    # under its trace id, without its user-agent.
    unsampled = "4bf92f3577b34da6a3ce929d0e0e4736"
    response = await propose_raw(
        traced, pki, thread_id, 2, {"requested_action": act("raw")}, unsampled
    )
    assert response.transition.version == 3
    # An unexpected failure, whose text holds a sentinel, and a library's log line.
    failing = await new_thread(target, pki)  # not in this service's head cache

    async def broken(*_: object) -> Any:
        raise RuntimeError(f"unexpected: {EXCEPTION_SENTINEL}")

    with monkeypatch.context() as patched:
        # the proposal's look-up of a head it has not cached
        patched.setattr(traced_service.store, "head_for_request", broken)
        async with client(traced, creds) as worker:
            with pytest.raises(ZtateError) as internal:
                await worker.propose(failing, 0, {"requested_action": act("failing")})
    assert internal.value.code == grpc.StatusCode.INTERNAL
    assert EXCEPTION_SENTINEL not in str(internal.value)
    assert (await ledger.snapshot(failing)).head_version == 0
    logging.getLogger("thirdparty.library").error("a library says %s", LIBRARY_SENTINEL)

    pending = traced_service.telemetry.pending
    assert pending is not None
    await pending.sample()  # sampled on the service's loop: take one now
    await asyncio.to_thread(traced_service.telemetry.force_flush)
    await worker_spans.wait_for(3)  # the traced worker's three calls
    await asyncio.to_thread(worker_provider.force_flush)
    await receiver.wait_for(
        lambda: sum(s["service"] == WORKER_SERVICE for s in receiver.spans()) >= 3,
        "the worker's spans",
    )
    worker_provider.shutdown()

    spans = receiver.spans()
    node_id = Identity(TRUST_DOMAIN, Role.NODE, "input-parser").spiffe_id
    served = [
        s for s in spans if s["name"] == PROPOSE and s["kind"] == trace_pb2.Span.SPAN_KIND_SERVER
    ]
    assert all(s["service"] == SERVICE for s in served)
    assert len(served) == 6
    by_reason = {s["attributes"].get("ztate.reason"): s for s in served}
    commit_span = next(s for s in served if s["attributes"].get("ztate.version") == 1)
    refusal_span = by_reason["KEY_NOT_WRITABLE"]
    assert only_ztate(commit_span) == {
        "ztate.node_id": node_id,
        "ztate.thread_id": thread_id,
        "ztate.version": 1,
        "ztate.decision": "committed",
    }
    assert only_ztate(refusal_span) == {
        "ztate.node_id": node_id,
        "ztate.thread_id": thread_id,
        "ztate.version": 1,
        "ztate.decision": "refused",
        "ztate.reason": "KEY_NOT_WRITABLE",
    }
    assert only_ztate(by_reason["STALE_VERSION"])["ztate.decision"] == "refused"
    assert (
        refusal_span["attributes"]["rpc.grpc.status_code"]
        == grpc.StatusCode.PERMISSION_DENIED.value[0]
    )
    # the refusal's message (it names the attacker's key) stays out of the status
    assert refusal_span["span"].status.message == ""
    (parked_span,) = [s for s in served if s["attributes"]["ztate.decision"] == "parked"]
    assert parked_span["attributes"]["ztate.version"] == 2
    # the unsampled caller's call: recorded, in its trace, with what ztate says of it
    (unsampled_span,) = [s for s in served if s["trace_id"].hex() == unsampled]
    assert only_ztate(unsampled_span) == {
        "ztate.node_id": node_id,
        "ztate.thread_id": thread_id,
        "ztate.version": 3,
        "ztate.decision": "committed",
    }
    internal_span = by_reason["UNSPECIFIED"]
    assert internal_span["attributes"]["rpc.grpc.status_code"] == grpc.StatusCode.INTERNAL.value[0]
    # nothing but the allowlisted attributes, from any of the service's spans
    for span in spans:
        if span["service"] == SERVICE:
            assert set(span["attributes"]) <= SPAN_ATTRIBUTES, span["name"]

    # propagation: each server span of the traced worker is its client span's child
    for server_span in (commit_span, refusal_span, by_reason["STALE_VERSION"]):
        (caller,) = [
            s
            for s in spans
            if s["service"] == WORKER_SERVICE and s["span_id"] == server_span["parent_span_id"]
        ]
        assert caller["kind"] == trace_pb2.Span.SPAN_KIND_CLIENT
        assert caller["name"] == PROPOSE
        assert caller["trace_id"] == server_span["trace_id"]

    # the commit's queries are spans of the same trace
    queries = [
        s
        for s in spans
        if s["scope"] == "opentelemetry.instrumentation.asyncpg"
        and s["trace_id"] == commit_span["trace_id"]
    ]
    assert queries, "no asyncpg span in the commit's trace"
    assert all(s["kind"] == trace_pb2.Span.SPAN_KIND_CLIENT for s in queries)
    # and no background work is: the outbox ran a round every 50 ms, the outcome
    # listener started and the database health was pinged, none of it traced.
    # (asyncpg is instrumented process-wide, so the session's untraced service's
    # other queries show as roots here: not counted.)
    orphans = {
        str(s["attributes"].get("db.statement"))
        for s in spans
        if s["scope"] == "opentelemetry.instrumentation.asyncpg" and not s["parent_span_id"]
    }
    outbox_round = "WHERE status = 'pending' AND parked_at < $1"
    assert [q for q in orphans if outbox_round in q or q.startswith("LISTEN")] == []
    assert [q for q in orphans if "pg_is_in_recovery" in q] == []  # the health pings

    proposals = {
        (a.get("ztate.decision"), a.get("ztate.reason")): p.as_int
        for a, p in receiver.metric_points("ztate.proposals")
    }
    assert proposals == {
        ("committed", None): 2,
        ("refused", "KEY_NOT_WRITABLE"): 1,
        ("refused", "STALE_VERSION"): 1,
        ("parked", None): 1,
    }
    (commit_latency,) = receiver.metric_points("ztate.commit.duration")
    assert commit_latency[1].count == 3  # two commits and the one that lost
    assert 0 < commit_latency[1].sum < 10
    ((_, conflicts),) = receiver.metric_points("ztate.cas.conflicts")
    assert conflicts.as_int == 1
    pool = {
        a["state"]: p.as_int
        for a, p in receiver.metric_points("ztate.db.pool.connections")
        if a["ztate.pool"] == "transition"
    }
    assert set(pool) == {"used", "idle"}
    assert pool["used"] + pool["idle"] >= 1
    limits = {a["ztate.pool"]: p.as_int for a, p in receiver.metric_points("ztate.db.pool.max")}
    assert limits == {"transition": 8, "ledger-reader": 4}  # the write pool and the reader's
    ((_, waiting),) = receiver.metric_points("ztate.approvals.pending")
    assert waiting.as_int >= 1
    ((_, age),) = receiver.metric_points("ztate.approvals.pending.age")
    assert age.as_double > 0

    # the service's log of the refusal carries the refused call's trace id
    logs = [(s, r) for s, r in receiver.log_records() if s == SERVICE]
    refused_logs = [r for _, r in logs if "refused ProposeTransition" in r.body.string_value]
    assert refused_logs
    assert refusal_span["trace_id"] in {r.trace_id for r in refused_logs}
    # the unexpected failure is logged with its type, not its text or stack
    (failed_log,) = [r for _, r in logs if "failed unexpectedly" in r.body.string_value]
    failure_attributes = attributes(failed_log.attributes)
    assert failure_attributes["exception.type"] == "RuntimeError"
    assert "exception.message" not in failure_attributes
    assert "exception.stacktrace" not in failure_attributes
    assert failed_log.trace_id == internal_span["trace_id"]

    # nothing secret, whatever the field: state values, the HMAC key, the caller's
    # user-agent, the exception's text, a library's log line; and in what the service
    # exported (the worker's own spans may name it), the attacker's key name
    exported = receiver.everything()
    for secret in [
        SENTINEL_TEXT.encode(),
        SENTINEL_ORDER.encode(),
        USER_AGENT_SENTINEL.encode(),
        TRACESTATE_SENTINEL.encode(),
        EXCEPTION_SENTINEL.encode(),
        LIBRARY_SENTINEL.encode(),
        *hmac_key_forms(keyring_file),
    ]:
        assert secret not in exported
    with receiver.lock:
        metric_requests = b"".join(r.SerializeToString() for r in receiver.metrics)
    service_exports = (
        b"".join(s["span"].SerializeToString() for s in spans if s["service"] == SERVICE)
        + b"".join(r.SerializeToString() for _, r in logs)
        + metric_requests
    )
    assert ATTACKER_KEY.encode() not in service_exports


async def test_a_proposal_refused_by_a_storage_outage_is_counted(
    traced_service: RunningService, receiver: Receiver, pki: Pki, ledger: Ledger, target: str
) -> None:
    thread_id = await new_thread(target, pki)
    traced_service.store.pool.terminate()  # the database is gone, for this service
    creds = pki.node("input-parser")
    async with ZtateClient.from_files(
        f"localhost:{traced_service.port}", cert=creds.cert, key=creds.key, ca=creds.ca, retries=0
    ) as worker:
        with pytest.raises(Unavailable) as refused:
            await worker.propose(thread_id, 0, {"requested_action": act("outage")})
    assert refused.value.reason == "STORAGE_UNAVAILABLE"
    assert (await ledger.snapshot(thread_id)).head_version == 0

    await asyncio.to_thread(traced_service.telemetry.force_flush)
    proposals = [
        ((a.get("ztate.decision"), a.get("ztate.reason")), p.as_int)
        for a, p in receiver.metric_points("ztate.proposals")
    ]
    assert proposals == [(("refused", "STORAGE_UNAVAILABLE"), 1)]


INSTALL_SCRIPT = """
import asyncio, logging
from ztate.services.runtime.config import Settings
from ztate.services.runtime.telemetry import Telemetry, configure_logging

configure_logging("text")
telemetry = Telemetry.from_settings(Settings())
telemetry.install_globals()
try:
    raise RuntimeError("unexpected: {exception}")
except RuntimeError:
    logging.getLogger("ztate.rpc").exception("Propose failed unexpectedly: RuntimeError")
logging.getLogger("thirdparty.library").error("a library says {library}")
asyncio.run(telemetry.shutdown())
"""


async def test_the_installed_log_handler_exports_ztate_records_without_exception_text(
    receiver: Receiver, tmp_path: Path
) -> None:
    """The service commands' own path, ``install_globals``, in a process of its own
    (it sets the process-wide providers)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZTATE_", "OTEL_"))}
    env.update(
        ZTATE_HOME=str(tmp_path),
        ZTATE_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.port}",
        ZTATE_OTLP_INSECURE="true",
        ZTATE_SERVICE_NAME=SERVICE,
    )
    script = INSTALL_SCRIPT.format(exception=EXCEPTION_SENTINEL, library=LIBRARY_SENTINEL)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    assert EXCEPTION_SENTINEL in err.decode()  # stderr keeps the whole traceback
    assert LIBRARY_SENTINEL in err.decode()

    (record,) = [r for s, r in receiver.log_records() if s == SERVICE]
    assert record.body.string_value == "Propose failed unexpectedly: RuntimeError"
    assert attributes(record.attributes)["exception.type"] == "RuntimeError"
    exported = receiver.everything()
    assert EXCEPTION_SENTINEL.encode() not in exported
    assert LIBRARY_SENTINEL.encode() not in exported


async def test_a_failed_start_undoes_its_telemetry(
    settings: Settings, database_dsn: str, receiver: Receiver, tmp_path: Path
) -> None:
    import asyncpg.connection

    from ztate.services.runtime.serving import CannotListen

    unbindable = traced_settings(settings, receiver).model_copy(
        update={"listen": f"unix:{tmp_path / 'missing-dir' / 'ztate.sock'}"}
    )
    with pytest.raises(CannotListen, match="cannot listen on unix:"):
        await start(unbindable, dsn=database_dsn)
    assert not hasattr(asyncpg.connection.Connection.fetchval, "__wrapped__")


async def test_verify_on_worker_processes_exports_every_failure_it_prints(
    postgres_server_dsn: str,
    pki: Pki,
    keyring_file: Path,
    policy_dir: Path,
    tmp_path: Path,
    receiver: Receiver,
) -> None:
    """Forked workers find, the leader prints: the leader counts, and flushes."""
    from tests.integration.test_verify import REPO, open_world, update

    own = await open_world(postgres_server_dsn, pki, keyring_file, policy_dir, tmp_path)
    try:
        tampered = [await own.thread(), await own.thread()]
    finally:
        await own.service.stop(grace=1.0)
    for thread_id in tampered:
        await own.tamper(
            thread_id, update("node_id", "spiffe://ztate.test/node/db-writer", thread_id, 3)
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZTATE_", "OTEL_"))}
    env.update(
        DATABASE_URL=own.dsn,
        ZTATE_HOME=str(own.root / "cli-home"),
        ZTATE_HMAC_KEYRING_FILE=str(own.settings.hmac_keyring_file),
        ZTATE_APPROVAL_PUBLIC_KEYS_FILE=str(own.settings.approval_public_keys_file),
        ZTATE_POLICY_PATH=str(own.settings.policy_path),
        ZTATE_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.port}",
        ZTATE_OTLP_INSECURE="true",
    )
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("ztate")),
        *("verify", "--jobs", "2", "--json"),
        env=env,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 1, err.decode()
    findings = [json.loads(line) for line in out.splitlines()][:-1]
    assert [f["check"] for f in findings] == ["column.node_id", "column.node_id"]

    # cumulative: the flush and the exit's shutdown may each export the same total
    counted = {
        (a["ztate.check"], p.as_int) for a, p in receiver.metric_points("ztate.verify.failures")
    }
    assert counted == {("column.node_id", 2)}


async def test_telemetry_off_adds_no_interceptor_and_records_nothing(settings: Settings) -> None:
    from ztate.services.runtime.telemetry import NO_METRICS, Telemetry

    off = Telemetry.from_settings(settings)
    assert settings.telemetry_mode == "off"
    assert not off.enabled
    assert off.server_interceptors() == []
    assert off.log_handler() is None
    assert off.metrics is NO_METRICS
    off.instrument_asyncpg()  # a no-op: asyncpg is not wrapped
    import asyncpg.connection

    assert not hasattr(asyncpg.connection.Connection.fetchval, "__wrapped__")
    await off.shutdown()
