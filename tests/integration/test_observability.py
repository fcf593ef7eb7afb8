"""Traces, metrics and logs reach a real OTLP/gRPC receiver, and say nothing secret.

The receiver is an in-process gRPC server implementing OpenTelemetry's collector
services (``opentelemetry-proto``). A second transition service, on the session's
database and PKI, exports to it; a traced worker commits one change and has one
refused over mutual TLS. Every exported byte is then searched for the state
values, the attacker-chosen key name and the HMAC key.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from services.config import Settings
from services.identity import Identity, Role
from tests.harness import INITIAL, TRUST_DOMAIN, Ledger, Pki, client, new_thread_id
from transition_service.app import RunningService, start
from worker_sdk import PermissionDenied, ZtateClient

# State values and a key name only the test knows: none may leave the service.
SENTINEL_TEXT = "sentinel-raw-text-5b1e0c9d"
SENTINEL_ORDER = "SENTINEL-ORDER-7F3A9C"
ATTACKER_KEY = "zz_attacker_chosen_6d2f"
PROPOSE = "/ztate.v1.TransitionService/ProposeTransition"
WORKER_SERVICE = "observability-test-worker"


@dataclass
class Receiver:
    """What an OTLP collector was sent, request by request."""

    port: int = 0
    traces: list[trace_service_pb2.ExportTraceServiceRequest] = field(default_factory=list)
    metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = field(default_factory=list)
    logs: list[logs_service_pb2.ExportLogsServiceRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

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
        with self._receiver.lock:
            self._receiver.traces.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):  # type: ignore[misc]
    def __init__(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:
        with self._receiver.lock:
            self._receiver.metrics.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class _Logs(logs_service_pb2_grpc.LogsServiceServicer):  # type: ignore[misc]
    def __init__(self, receiver: Receiver) -> None:
        self._receiver = receiver

    def Export(self, request: Any, context: Any) -> Any:
        with self._receiver.lock:
            self._receiver.logs.append(request)
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


@pytest_asyncio.fixture
async def traced_service(
    settings: Settings, database_dsn: str, receiver: Receiver
) -> AsyncIterator[RunningService]:
    """A transition service whose telemetry goes to ``receiver``, its logs included."""
    traced = settings.model_copy(
        update={
            "otlp_endpoint": f"http://127.0.0.1:{receiver.port}",
            "otlp_insecure": True,
            "service_name": "ztate-transition-under-test",
            "metrics_interval_seconds": 600.0,  # exported by the test's flush only
        }
    )
    running = await start(traced, dsn=database_dsn)
    handler = running.telemetry.log_handler()
    assert handler is not None
    ztate_logs = logging.getLogger("ztate")
    level = ztate_logs.level
    ztate_logs.setLevel(logging.INFO)
    ztate_logs.addHandler(handler)
    try:
        yield running
    finally:
        ztate_logs.removeHandler(handler)
        ztate_logs.setLevel(level)
        await running.stop(grace=1.0)


def worker_tracing(receiver: Receiver) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": WORKER_SERVICE}))
    exporter = OTLPSpanExporter(f"http://127.0.0.1:{receiver.port}", insecure=True)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


async def flushed_until(
    provider: TracerProvider, arrived: Callable[[], bool], deadline: float = 10.0
) -> None:
    """Flush ``provider`` until ``arrived()``, polling with a deadline."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline
    while True:
        await asyncio.to_thread(provider.force_flush)
        if arrived():
            return
        assert loop.time() < give_up, "the worker's spans never arrived"
        await asyncio.sleep(0.05)


def hmac_key_forms(keyring_file: Path) -> list[bytes]:
    """The HMAC keys as the keyring holds them (base64) and as the raw bytes and hex."""
    forms: list[bytes] = []
    for encoded in json.loads(keyring_file.read_text())["keys"].values():
        raw = base64.b64decode(encoded)
        forms += [encoded.encode(), raw, raw.hex().encode()]
    return forms


async def test_traces_metrics_and_logs_reach_an_otlp_receiver_without_secrets(
    traced_service: RunningService,
    receiver: Receiver,
    pki: Pki,
    ledger: Ledger,
    keyring_file: Path,
) -> None:
    target = f"localhost:{traced_service.port}"
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(
            thread_id, {**INITIAL, "raw_text": SENTINEL_TEXT}, policy="pipeline"
        )
    worker_provider = worker_tracing(receiver)
    creds = pki.node("input-parser")
    async with ZtateClient.from_files(
        target, cert=creds.cert, key=creds.key, ca=creds.ca, tracer_provider=worker_provider
    ) as worker:
        committed = await worker.propose(
            thread_id, 0, {"requested_action": {"action": "refund", "order_id": SENTINEL_ORDER}}
        )
        assert committed.version == 1
        with pytest.raises(PermissionDenied) as refused:
            await worker.propose(thread_id, 1, {ATTACKER_KEY: SENTINEL_TEXT})
        assert refused.value.reason == "KEY_NOT_WRITABLE"
    assert (await ledger.snapshot(thread_id)).head_version == 1  # the refusal wrote nothing
    # Parked transitions are sampled on the service's loop; wait for one sample.
    pending = traced_service.telemetry.pending
    assert pending is not None
    await pending.sample()

    await asyncio.to_thread(traced_service.telemetry.force_flush)
    # A client span ends in the call's done callback: flush until both arrived.
    await flushed_until(
        worker_provider,
        lambda: sum(s["service"] == WORKER_SERVICE for s in receiver.spans()) >= 2,
    )
    worker_provider.shutdown()

    spans = receiver.spans()
    node_id = Identity(TRUST_DOMAIN, Role.NODE, "input-parser").spiffe_id
    served = [
        s for s in spans if s["name"] == PROPOSE and s["kind"] == trace_pb2.Span.SPAN_KIND_SERVER
    ]
    by_decision = {s["attributes"].get("ztate.decision"): s for s in served}
    assert set(by_decision) == {"committed", "refused"}
    commit_span, refusal_span = by_decision["committed"], by_decision["refused"]
    assert commit_span["service"] == "ztate-transition-under-test"
    assert {k: v for k, v in commit_span["attributes"].items() if k.startswith("ztate.")} == {
        "ztate.node_id": node_id,
        "ztate.thread_id": thread_id,
        "ztate.version": 1,
        "ztate.decision": "committed",
    }
    assert {k: v for k, v in refusal_span["attributes"].items() if k.startswith("ztate.")} == {
        "ztate.node_id": node_id,
        "ztate.thread_id": thread_id,
        "ztate.version": 1,
        "ztate.decision": "refused",
        "ztate.reason": "KEY_NOT_WRITABLE",
    }
    assert (
        refusal_span["attributes"]["rpc.grpc.status_code"]
        == grpc.StatusCode.PERMISSION_DENIED.value[0]
    )
    # the refusal's message (it names the attacker's key) stays out of the status
    assert refusal_span["span"].status.message == ""

    # propagation: each server span is the child of the worker's client span
    for server_span in (commit_span, refusal_span):
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

    proposals = {
        (a.get("ztate.decision"), a.get("ztate.reason")): p.as_int
        for a, p in receiver.metric_points("ztate.proposals")
    }
    assert proposals == {("committed", None): 1, ("refused", "KEY_NOT_WRITABLE"): 1}
    (commit_latency,) = receiver.metric_points("ztate.commit.duration")
    assert commit_latency[1].count == 1
    assert 0 < commit_latency[1].sum < 10
    assert receiver.metric_points("ztate.cas.conflicts") == []  # nothing raced
    pool = {
        a["state"]: p.as_int
        for a, p in receiver.metric_points("ztate.db.pool.connections")
        if a["ztate.pool"] == "transition"
    }
    assert set(pool) == {"used", "idle"}
    assert pool["used"] + pool["idle"] >= 1
    ((_, limit),) = receiver.metric_points("ztate.db.pool.max")
    assert limit.as_int == 8
    ((_, waiting),) = receiver.metric_points("ztate.approvals.pending")
    assert waiting.as_int >= 0
    assert len(receiver.metric_points("ztate.approvals.pending.age")) == 1

    # the service's log of the refusal carries the refused call's trace id
    logs = [(s, r) for s, r in receiver.log_records() if s == "ztate-transition-under-test"]
    refused_logs = [r for _, r in logs if "refused ProposeTransition" in r.body.string_value]
    assert refused_logs
    assert {r.trace_id for r in refused_logs} == {refusal_span["trace_id"]}

    # nothing secret, whatever the field: state values, the HMAC key, and in what
    # the service exported, the attacker's key name
    exported = receiver.everything()
    for secret in [SENTINEL_TEXT.encode(), SENTINEL_ORDER.encode(), *hmac_key_forms(keyring_file)]:
        assert secret not in exported
    service_exports = b"".join(
        s["span"].SerializeToString() for s in spans if s["service"] != WORKER_SERVICE
    ) + b"".join(r.SerializeToString() for _, r in logs)
    assert ATTACKER_KEY.encode() not in service_exports


async def test_telemetry_off_adds_no_interceptor_and_records_nothing(settings: Settings) -> None:
    from services.telemetry import NO_METRICS, Telemetry

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
