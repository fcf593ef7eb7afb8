"""Client-side tracing for the worker SDK, when the worker uses OpenTelemetry.

A worker that configured an OpenTelemetry tracer provider (or passes one to
``ZtateClient``) gets a client span per call, and the W3C trace context travels
in the call's metadata, so the transition service's spans join the worker's
trace. Without OpenTelemetry installed, or with no provider configured, the
channel gets no interceptor at all.
"""

from __future__ import annotations

from typing import Any

import grpc


def client_interceptors(tracer_provider: Any = None) -> list[grpc.aio.ClientInterceptor]:
    """The OpenTelemetry gRPC client interceptors, or none when tracing is not set up."""
    try:
        from opentelemetry import trace
    except ImportError:
        return []
    if tracer_provider is None:
        configured = trace.get_tracer_provider()
        if isinstance(configured, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return []  # nothing would be recorded: spare the calls the interceptor
    try:
        from opentelemetry.instrumentation.grpc import aio_client_interceptors
    except ImportError:
        return []
    interceptors: list[grpc.aio.ClientInterceptor] = aio_client_interceptors(  # type: ignore[no-untyped-call]
        tracer_provider=tracer_provider
    )
    return interceptors
