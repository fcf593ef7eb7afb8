"""The telemetry module's parts that need no server: JSON logs correlated with
traces, redaction of exported spans, the settings, the worker's interceptors."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode, format_span_id, format_trace_id
from pydantic import ValidationError

from ztate.services.runtime.config import ApprovalSettings, Settings, describe
from ztate.services.runtime.telemetry import JsonFormatter, _Redacting
from ztate.worker_sdk._tracing import client_interceptors


def record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    made = logging.LogRecord("ztate.test", logging.WARNING, __file__, 1, message, args, None)
    made.__dict__.update(extra)
    return made


def test_json_log_lines_carry_the_active_trace_and_span_ids() -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("call") as span:
        line = JsonFormatter().format(record("refused %s: %s", "ProposeTransition", "STALE"))
    entry = json.loads(line)
    assert "\n" not in line
    assert entry["message"] == "refused ProposeTransition: STALE"
    assert entry["level"] == "WARNING"
    assert entry["logger"] == "ztate.test"
    assert entry["trace_id"] == format_trace_id(span.get_span_context().trace_id)
    assert entry["span_id"] == format_span_id(span.get_span_context().span_id)
    assert entry["time"].endswith("+00:00")


def test_json_log_lines_outside_a_span_have_no_trace_id_and_keep_extras() -> None:
    entry = json.loads(JsonFormatter().format(record("started", port=7443)))
    assert "trace_id" not in entry
    assert "span_id" not in entry
    assert entry["port"] == 7443


def test_json_log_lines_hold_the_exception_on_one_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        failed = logging.LogRecord(
            "ztate.test", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    line = JsonFormatter().format(failed)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exception"]


def test_exported_spans_lose_status_descriptions_and_exception_messages() -> None:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_Redacting(memory)))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("refused", record_exception=False) as span:
        span.set_attribute("ztate.reason", "KEY_NOT_WRITABLE")
        span.record_exception(ValueError("secret-bearing message"))
        span.set_status(Status(StatusCode.ERROR, "key 'attacker_key' not writable"))
    with tracer.start_as_current_span("plain"):
        pass
    refused, plain = memory.get_finished_spans()
    assert refused.status.status_code is StatusCode.ERROR
    assert refused.status.description is None
    assert refused.attributes == {"ztate.reason": "KEY_NOT_WRITABLE"}
    (event,) = refused.events
    assert event.name == "exception"
    assert dict(event.attributes or {}) == {
        "exception.type": "ValueError",
        "exception.escaped": "False",
    }
    assert plain.name == "plain"
    assert plain.status.status_code is StatusCode.UNSET


def test_exported_spans_keep_only_allowlisted_attributes() -> None:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_Redacting(memory)))
    with provider.get_tracer("test").start_as_current_span("served") as span:
        span.set_attributes(
            {
                "rpc.method": "ProposeTransition",
                "rpc.grpc.status_code": 0,
                "ztate.decision": "committed",
                "rpc.user_agent": "caller-chosen text",
                "db.statement.parameters": "('a state value',)",
            }
        )
    (served,) = memory.get_finished_spans()
    assert served.attributes == {
        "rpc.method": "ProposeTransition",
        "rpc.grpc.status_code": 0,
        "ztate.decision": "committed",
    }


def test_server_spans_are_recorded_under_an_unsampled_remote_parent() -> None:
    from opentelemetry import context, trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    from ztate.services.runtime.telemetry import SAMPLER

    remote = SpanContext(0x4BF92F3577B34DA6, 0x5555, is_remote=True, trace_flags=TraceFlags(0))
    parent = trace.set_span_in_context(NonRecordingSpan(remote))
    tracer = TracerProvider(sampler=SAMPLER).get_tracer("test")
    token = context.attach(parent)
    try:
        with tracer.start_as_current_span("served") as span:
            assert span.is_recording()
            assert span.get_span_context().trace_id == remote.trace_id  # kept, as a hint
    finally:
        context.detach(token)


def test_telemetry_is_off_unless_an_endpoint_or_a_mode_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("ZTATE_TELEMETRY", "ZTATE_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert Settings().telemetry_mode == "off"
    assert Settings(telemetry="console").telemetry_mode == "console"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector:4317")
    assert Settings().telemetry_mode == "otlp"
    assert ApprovalSettings().otlp_endpoint == "https://collector:4317"
    monkeypatch.setenv("ZTATE_OTLP_ENDPOINT", "https://other:4317")
    monkeypatch.setenv("ZTATE_TELEMETRY", "off")
    assert Settings().otlp_endpoint == "https://other:4317"
    assert Settings().telemetry_mode == "off"
    monkeypatch.setenv("ZTATE_LOG_FORMAT", "json")
    assert ApprovalSettings().log_format == "json"
    assert ApprovalSettings().service_name == "ztate-approval"


def test_otlp_without_an_endpoint_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("ZTATE_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ZTATE_TELEMETRY", "otlp")
    for settings in (Settings, ApprovalSettings):
        with pytest.raises(ValidationError) as invalid:
            settings()
        assert "ZTATE_TELEMETRY=otlp needs ZTATE_OTLP_ENDPOINT" in describe(invalid.value)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector:4317")
    assert Settings().telemetry_mode == "otlp"


def test_the_approval_service_takes_the_standard_service_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ZTATE_APPROVAL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "approval-eu-1")
    assert ApprovalSettings().service_name == "approval-eu-1"


def test_the_worker_channel_is_traced_only_when_a_tracer_provider_exists() -> None:
    # this process sets no global provider: no interceptor, no cost per call
    assert client_interceptors() == []
    assert len(client_interceptors(TracerProvider())) == 4  # the four call shapes
