"""Traces, metrics and structured logs of the ztate services (OpenTelemetry).

One ``Telemetry`` per service holds its providers. It is built from the settings
(``Telemetry.from_settings``) and handed to what records: the gRPC server
interceptor, the asyncpg instrumentation, the pipeline's metrics. Nothing here
touches OpenTelemetry's process-wide providers except ``install_globals``, which
only the service commands call, so tests can build as many as they like.

Off (the default unless an OTLP endpoint is configured) means no providers at
all: no interceptor, no instrumentation, no-op instruments; the commit path then
pays for a few no-op calls only.

What is recorded is decided in this module and nowhere else: identifiers (thread
id, SPIFFE id of the caller, version), the decision and the reason code. Never a
state value, a patch, a refusal message (it may name keys an attacker chose), a
key or a DSN: exported spans keep only the attributes of ``SPAN_ATTRIBUTES`` and
lose their status descriptions and exception messages (``_Redacting``); exported
log records lose their exception text and keep its type (``_RedactingLogHandler``),
and only the ``ztate`` loggers' records are exported.

Every server span is recorded, whatever the caller's trace context says
(``SAMPLER``): a worker cannot switch off the record of its own calls. The trace
id a worker sends is kept, as an untrusted correlation hint only.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import sys
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

import asyncpg
import grpc
import orjson
from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Meter, NoOpMeterProvider, Observation
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import SpanContext, Status, TraceState

from ztate.services.runtime.config import ApprovalSettings, LogFormat, Settings
from ztate.services.runtime.scrape import ScrapeEndpoint, Serving
from ztate.services.runtime.thread_ids import THREAD_ID as THREAD_ID_RULE

log = logging.getLogger("ztate.telemetry")

# --- span attributes: the whole list of what a ztate span may say about a call --------

THREAD_ID = "ztate.thread_id"
NODE_ID = "ztate.node_id"  # the caller's SPIFFE ID, from its verified certificate
VERSION = "ztate.version"
DECISION = "ztate.decision"  # committed, parked, replayed, refused, rejected
REASON = "ztate.reason"  # an ErrorReason name (without its prefix)

COMMITTED = "committed"
PARKED = "parked"
REFUSED = "refused"

_EXCEPTION_KEPT = frozenset({"exception.type", "exception.escaped"})

SPAN_ATTRIBUTES = frozenset(
    {
        # ours (the note_* functions below)
        THREAD_ID,
        NODE_ID,
        VERSION,
        DECISION,
        REASON,
        # the gRPC server instrumentation's, minus rpc.user_agent (the caller's text)
        "rpc.system",
        "rpc.service",
        "rpc.method",
        "rpc.grpc.status_code",
        "net.peer.ip",
        "net.peer.port",
        "net.peer.name",
        # asyncpg's: the database, the role, the statement text (our constant SQL;
        # parameters are never captured, and dropped here should that change)
        "db.system",
        "db.system.name",
        "db.name",
        "db.namespace",
        "db.user",
        "db.statement",
        "db.query.text",
        "server.address",
        "server.port",
        "net.transport",
        "network.transport",
        "error.type",
    }
)
"""Every attribute an exported span may carry; anything else is dropped on export."""

# A server span is recorded whatever the caller's traceparent flags say.
SAMPLER = ParentBased(root=ALWAYS_ON, remote_parent_not_sampled=ALWAYS_ON)


def note_caller(spiffe_id: str) -> None:
    """The authenticated caller of the current RPC (``ztate.services.runtime.rpc_guard``)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(NODE_ID, spiffe_id)


def note_refusal(reason: str) -> None:
    """The current RPC was refused, for ``reason`` (``ztate.services.runtime.rpc_guard``)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({DECISION: REFUSED, REASON: reason})


def note_transition(thread_id: str, version: int, decision: str | None = None) -> None:
    """The thread and version the current RPC is about, and what became of it.

    A thread id that does not have the form of one (the caller chose it) is left out.
    """
    span = trace.get_current_span()
    if not span.is_recording():
        return
    if THREAD_ID_RULE.fullmatch(thread_id):
        span.set_attribute(THREAD_ID, thread_id)
    span.set_attribute(VERSION, version)
    if decision is not None:
        span.set_attribute(DECISION, decision)


# --- metrics ---------------------------------------------------------------------------

# seconds: a commit is one round trip, usually well under 10 ms
COMMIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The instruments the request path records into (no-ops when telemetry is off,
    and ``enabled`` False: the request path then skips its notes altogether)."""

    def __init__(self, meter: Meter, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.proposals = meter.create_counter(
            "ztate.proposals",
            unit="{proposal}",
            description="proposals by decision and, when refused, reason",
        )
        self.cas_conflicts = meter.create_counter(
            "ztate.cas.conflicts",
            unit="{conflict}",
            description="commits refused by compare-and-swap: the head had moved",
        )
        self.commit_duration = meter.create_histogram(
            "ztate.commit.duration",
            unit="s",
            description="round trip of the compare-and-swap commit statement",
            explicit_bucket_boundaries_advisory=COMMIT_BUCKETS,
        )

    def proposal(self, decision: str, reason: str | None = None) -> None:
        if reason is None:
            self.proposals.add(1, {DECISION: decision})
        else:
            self.proposals.add(1, {DECISION: decision, REASON: reason})


NO_METRICS = Metrics(NoOpMeterProvider().get_meter("ztate"), enabled=False)


class PendingApprovals:
    """How many parked transitions wait for a decision, and since when the oldest.

    Sampled from Postgres every ``interval`` seconds on the service's event loop
    (a metric callback runs on the exporter's thread and cannot query); the age is
    computed when read, so it keeps growing between samples.
    """

    def __init__(
        self, read: Callable[[], Awaitable[tuple[int, datetime | None]]], interval: float
    ) -> None:
        self._read = read
        self._interval = interval
        self.count: int | None = None
        self.oldest: datetime | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pending-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception as failure:  # logged, never raised: shutdown must flush
                log.warning("pending-approvals sampler ended with %s", type(failure).__name__)
            self._task = None

    async def sample(self) -> None:
        from opentelemetry.instrumentation.utils import suppress_instrumentation

        with suppress_instrumentation():  # no trace of the sampler's own queries
            self.count, self.oldest = await self._read()

    async def _run(self) -> None:
        while True:
            try:
                await self.sample()
            except Exception as failure:  # sampling must never end the service's flush
                log.warning("cannot sample pending approvals: %s", type(failure).__name__)
            await asyncio.sleep(self._interval)

    def observe_count(self, _: CallbackOptions) -> Iterable[Observation]:
        return [] if self.count is None else [Observation(self.count)]

    def observe_age(self, _: CallbackOptions) -> Iterable[Observation]:
        if self.count is None:
            return []
        if self.oldest is None:
            return [Observation(0.0)]
        return [Observation((datetime.now(UTC) - self.oldest).total_seconds())]


def _pool_observer(
    pools: Mapping[str, asyncpg.Pool],
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(_: CallbackOptions) -> Iterable[Observation]:
        found: list[Observation] = []
        for name, pool in pools.items():
            size, idle = pool.get_size(), pool.get_idle_size()
            found.append(Observation(size - idle, {"ztate.pool": name, "state": "used"}))
            found.append(Observation(idle, {"ztate.pool": name, "state": "idle"}))
        return found

    return observe


def _pool_limits(
    pools: Mapping[str, asyncpg.Pool],
) -> Callable[[CallbackOptions], Iterable[Observation]]:
    def observe(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(pool.get_max_size(), {"ztate.pool": n}) for n, pool in pools.items()]

    return observe


# --- what leaves the process -----------------------------------------------------------


class _Redacting(SpanExporter):
    """Exports spans with the attributes of ``SPAN_ATTRIBUTES`` only, and without
    status descriptions or exception messages.

    The gRPC instrumentation puts a refused call's details (shown to the caller, and
    naming keys the caller chose) into the span status, the caller's user-agent into
    an attribute, and a recorded exception's text into an event; a span keeps the
    status code, the exception type, and the reason code ``note_refusal`` set.
    """

    def __init__(self, inner: SpanExporter) -> None:
        self._inner = inner

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self._inner.export([_redacted(span) for span in spans])

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._inner.force_flush(timeout_millis)


def _without_trace_state(context: SpanContext) -> SpanContext:
    """``context`` without its W3C ``tracestate``: text of the caller's choosing (up to
    32 members, some 8 KB) that a span inherits from the remote parent's headers and the
    exporter would send to the collector with every span of the call."""
    if not context.trace_state:
        return context
    return SpanContext(
        context.trace_id, context.span_id, context.is_remote, context.trace_flags, TraceState()
    )


def _redacted(span: ReadableSpan) -> ReadableSpan:
    attributes = span.attributes or {}
    exceptional = any(event.name == "exception" for event in span.events)
    if (
        span.status.description is None
        and not exceptional
        and SPAN_ATTRIBUTES.issuperset(attributes)
        and not (span.context and span.context.trace_state)
        and not (span.parent and span.parent.trace_state)
    ):
        return span
    events = [
        Event(
            event.name,
            {k: v for k, v in (event.attributes or {}).items() if k in _EXCEPTION_KEPT},
            event.timestamp,
        )
        if event.name == "exception"
        else event
        for event in span.events
    ]
    return ReadableSpan(
        name=span.name,
        context=_without_trace_state(span.context) if span.context else None,
        parent=_without_trace_state(span.parent) if span.parent else None,
        resource=span.resource,
        attributes={k: v for k, v in attributes.items() if k in SPAN_ATTRIBUTES},
        events=events,
        links=span.links,
        kind=span.kind,
        status=Status(span.status.status_code),
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


EXPORTED_LOGGER = "ztate"
"""The logger hierarchy whose records are exported (``Telemetry.install_globals``)."""


def _redacting_log_handler(logger_provider: Any) -> logging.Handler:
    from opentelemetry.instrumentation.logging.handler import LoggingHandler

    class _RedactingLogHandler(LoggingHandler):
        """Exports a record without its exception's message and stack trace.

        OpenTelemetry's handler turns ``exc_info`` into ``exception.message`` and
        ``exception.stacktrace``; an unexpected failure's text may hold state values
        or key names a caller chose. The record exported keeps the exception's type
        name; the record itself (which stderr's handler formats too) is untouched.
        """

        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info or record.exc_text or record.stack_info:
                failure = record.exc_info[0] if record.exc_info else None
                record = copy.copy(record)
                record.exc_info, record.exc_text, record.stack_info = None, None, None
                if failure is not None:
                    record.__dict__["exception.type"] = failure.__name__
            super().emit(record)

    return _RedactingLogHandler(logger_provider=logger_provider)


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """No spans for the database work inside (background loops: only work a request
    drove is traced, not a root trace every few seconds per loop)."""
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    with suppress_instrumentation():
        yield


def _version() -> str:
    try:
        return metadata.version("ztate")
    except metadata.PackageNotFoundError:
        return "0"


def _otlp_credentials(settings: Settings | ApprovalSettings) -> grpc.ChannelCredentials | None:
    if settings.otlp_insecure:
        return None
    roots = settings.otlp_ca_file.read_bytes() if settings.otlp_ca_file else None
    return grpc.ssl_channel_credentials(root_certificates=roots)


@dataclass
class Telemetry:
    """The providers of one service; all ``None`` when telemetry is off."""

    tracer_provider: TracerProvider | None = None
    meter_provider: Any = None  # opentelemetry.sdk.metrics.MeterProvider
    logger_provider: Any = None  # opentelemetry.sdk._logs.LoggerProvider
    metrics: Metrics = field(default=NO_METRICS)
    _asyncpg: Any = field(default=None, repr=False)
    pending: PendingApprovals | None = field(default=None, repr=False)
    _handler: logging.Handler | None = field(default=None, repr=False)
    # the Prometheus scrape endpoint (ZTATE_METRICS_LISTEN): its address and registry,
    # and the endpoint once ``serve_metrics`` started it
    scrape_listen: str | None = field(default=None, repr=False)
    _scrape_registry: Any = field(default=None, repr=False)
    scrape: ScrapeEndpoint | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        """Traces, logs and metrics exported (OTLP or console)."""
        return self.tracer_provider is not None

    @property
    def metrics_port(self) -> int | None:
        """The port of the scrape endpoint, once serving."""
        return None if self.scrape is None else self.scrape.port

    @classmethod
    def from_settings(cls, settings: Settings | ApprovalSettings) -> Telemetry:
        mode, listen = settings.telemetry_mode, settings.metrics_listen
        if mode == "off" and not listen:
            return cls()
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader

        resource = Resource.create(
            {"service.name": settings.service_name, "service.version": _version()}
        )
        readers: list[MetricReader] = []
        registry = None
        if listen:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import CollectorRegistry

            # a registry of this service's own: two services of one process (tests)
            # never show each other's metrics
            registry = CollectorRegistry(auto_describe=True)
            readers.append(PrometheusMetricReader(registry=registry))
        if mode == "off":  # metrics for the scrape endpoint only
            meter_provider = MeterProvider(resource=resource, metric_readers=readers)
            return cls(
                None,
                meter_provider,
                None,
                Metrics(meter_provider.get_meter("ztate", _version())),
                scrape_listen=listen,
                _scrape_registry=registry,
            )
        if mode == "otlp":
            if not settings.otlp_endpoint:
                raise ValueError("ZTATE_TELEMETRY=otlp needs ZTATE_OTLP_ENDPOINT")
            from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            endpoint, insecure = settings.otlp_endpoint, settings.otlp_insecure
            credentials = _otlp_credentials(settings)
            spans: Any = OTLPSpanExporter(endpoint, insecure, credentials=credentials)
            points: Any = OTLPMetricExporter(endpoint, insecure, credentials=credentials)
            records: Any = OTLPLogExporter(endpoint, insecure, credentials=credentials)
        else:
            from opentelemetry.sdk._logs.export import ConsoleLogRecordExporter
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            spans = ConsoleSpanExporter(out=sys.stderr)
            points = ConsoleMetricExporter(out=sys.stderr)
            records = ConsoleLogRecordExporter(out=sys.stderr)

        tracer_provider = TracerProvider(resource=resource, sampler=SAMPLER)
        tracer_provider.add_span_processor(BatchSpanProcessor(_Redacting(spans)))
        readers.append(
            PeriodicExportingMetricReader(
                points, export_interval_millis=settings.metrics_interval_seconds * 1000
            )
        )
        meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        logger_provider = LoggerProvider(resource=resource)
        logger_provider.add_log_record_processor(BatchLogRecordProcessor(records))
        return cls(
            tracer_provider,
            meter_provider,
            logger_provider,
            Metrics(meter_provider.get_meter("ztate", _version())),
            scrape_listen=listen,
            _scrape_registry=registry,
        )

    def serve_metrics(self, serving: Serving | None = None) -> None:
        """Start the scrape endpoint, if one is configured (binds now: a port in use
        fails the start-up). The services call this from their event loop with their
        ``HealthReport.serving_now``: ``GET /readyz`` answers from it and ``GET /livez``
        from the running loop. ``ztate verify`` does not call it."""
        if self.scrape_listen and self.scrape is None:
            self.scrape = ScrapeEndpoint(self.scrape_listen, self._scrape_registry)
            if serving is not None:
                self.scrape.probes.attach(serving, asyncio.get_running_loop())

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor[Any, Any]]:
        """Server spans, continuing the caller's trace (W3C trace context)."""
        if not self.enabled:
            return []
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        interceptor: grpc.aio.ServerInterceptor[Any, Any] = aio_server_interceptor(  # type: ignore[no-untyped-call]
            tracer_provider=self.tracer_provider
        )
        return [interceptor]

    def instrument_asyncpg(self) -> None:
        """A client span per query (the statement text; never its parameters).

        asyncpg is instrumented for the whole process (its methods are wrapped);
        ``shutdown`` undoes it.
        """
        if not self.enabled or self._asyncpg is not None:
            return
        from opentelemetry.instrumentation.asyncpg import AsyncPGInstrumentor

        instrumentor = AsyncPGInstrumentor(capture_parameters=False)  # type: ignore[no-untyped-call]
        if instrumentor.is_instrumented_by_opentelemetry:
            return  # another Telemetry of this process did it
        instrumentor.instrument(tracer_provider=self.tracer_provider)
        self._asyncpg = instrumentor

    def watch_pools(self, pools: Mapping[str, asyncpg.Pool]) -> None:
        """Pool saturation, as observable gauges (read from the pools, no query)."""
        if self.meter_provider is None:
            return
        meter: Meter = self.meter_provider.get_meter("ztate", _version())
        meter.create_observable_gauge(
            "ztate.db.pool.connections",
            [_pool_observer(pools)],
            unit="{connection}",
            description="open connections of each asyncpg pool, used or idle",
        )
        meter.create_observable_gauge(
            "ztate.db.pool.max",
            [_pool_limits(pools)],
            unit="{connection}",
            description="the most connections each pool opens",
        )

    def watch_database(
        self,
        pools: Mapping[str, asyncpg.Pool],
        interval: float,
        *,
        pending_from: Callable[[], Awaitable[tuple[int, datetime | None]]],
    ) -> None:
        """Pool saturation and, sampled through ``pending_from`` (the store's
        ``pending_summary``), pending approvals."""
        if self.meter_provider is None:
            return
        self.watch_pools(pools)
        meter: Meter = self.meter_provider.get_meter("ztate", _version())
        pending = PendingApprovals(pending_from, interval)
        meter.create_observable_gauge(
            "ztate.approvals.pending",
            [pending.observe_count],
            unit="{transition}",
            description="parked transitions waiting for a decision",
        )
        meter.create_observable_gauge(
            "ztate.approvals.pending.age",
            [pending.observe_age],
            unit="s",
            description="how long the oldest parked transition has waited",
        )
        pending.start()
        self.pending = pending

    def log_handler(self) -> logging.Handler | None:
        """A handler that sends log records to the logs exporter, with trace ids, and
        without exception text (``_RedactingLogHandler``)."""
        if self.logger_provider is None:
            return None
        return _redacting_log_handler(self.logger_provider)

    def install_globals(self) -> None:
        """Make these the process's providers, and send the ``ztate`` loggers' records
        to the logs exporter too (the service commands do this, once per process).

        Only the ``ztate`` hierarchy: other libraries' records may carry anything
        (a driver's error text, a peer's address), so they stay on stderr.
        """
        from opentelemetry import _logs, metrics

        if self.meter_provider is not None:
            metrics.set_meter_provider(self.meter_provider)
        if not self.enabled:
            return
        trace.set_tracer_provider(self.tracer_provider)  # type: ignore[arg-type]
        _logs.set_logger_provider(self.logger_provider)
        self.attach_logs()

    def attach_logs(self) -> None:
        """Export the ``ztate`` loggers' records (``shutdown`` detaches the handler)."""
        handler = self.log_handler()
        if handler is not None and self._handler is None:
            logging.getLogger(EXPORTED_LOGGER).addHandler(handler)
            self._handler = handler

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Export everything recorded so far, giving up after ``timeout_millis`` for
        each signal (blocking: call it off the event loop). False if one timed out."""
        flushed = True
        for provider in (self.tracer_provider, self.meter_provider, self.logger_provider):
            if provider is not None:
                flushed = bool(provider.force_flush(timeout_millis)) and flushed
        return flushed

    async def stop_sampling(self) -> None:
        """Stop querying the database (before the service closes its pool)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            await pending.stop()

    async def shutdown(self) -> None:
        """Stop sampling, undo the instrumentation, flush and close the exporters.

        Each step runs whatever the one before it did, so what was recorded is
        flushed even if sampling ended in an error.
        """
        try:
            if self.scrape is not None:
                scrape, self.scrape = self.scrape, None
                await asyncio.to_thread(scrape.stop)
            await self.stop_sampling()
        finally:
            if self._handler is not None:
                logging.getLogger(EXPORTED_LOGGER).removeHandler(self._handler)
                self._handler = None
            if self._asyncpg is not None:
                self._asyncpg.uninstrument()
                self._asyncpg = None
            for provider in (self.tracer_provider, self.meter_provider, self.logger_provider):
                if provider is not None:
                    await asyncio.to_thread(provider.shutdown)


# --- logs ------------------------------------------------------------------------------

_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the exception if any,
    ``extra`` fields, and the trace and span ids of the span active when logged."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            entry["trace_id"] = trace.format_trace_id(context.trace_id)
            entry["span_id"] = trace.format_span_id(context.span_id)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        for name, value in vars(record).items():
            if name not in _RECORD_FIELDS and not name.startswith("_"):
                entry[name] = value
        return orjson.dumps(entry, default=str).decode()


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def configure_logging(log_format: LogFormat) -> None:
    """Logs to stderr, as text or as JSON lines (``ZTATE_LOG_FORMAT``)."""
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=logging.INFO, handlers=[stream])
