"""The health servicer over real gRPC and mTLS: NOT_SERVING until told otherwise,
one status for every name, unknown names refused, and a graceful shutdown that
tells every watcher NOT_SERVING and then ends its stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.harness import Pki, secure_channel
from ztate.services.runtime import tls
from ztate.services.runtime.health import NOT_SERVING, SERVICE_UNKNOWN, SERVING, HealthReport

NAMES = ("ztate.v1.TransitionService", "ztate.v1.LedgerService")


@pytest_asyncio.fixture
async def served_report(pki: Pki) -> AsyncIterator[tuple[HealthReport, health_pb2_grpc.HealthStub]]:
    report = HealthReport(NAMES)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(report, server)
    port = server.add_secure_port(
        "127.0.0.1:0",
        tls.server_credentials(
            pki.certs / "service-transition.crt",
            pki.certs / "service-transition.key",
            pki.certs / "ca.crt",
        ),
    )
    await server.start()
    try:
        async with secure_channel(f"localhost:{port}", pki.operator()) as channel:
            yield report, health_pb2_grpc.HealthStub(channel)
    finally:
        await server.stop(None)


async def statuses(stub: health_pb2_grpc.HealthStub) -> list[int]:
    return [
        (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status
        for name in ("", *NAMES)
    ]


async def test_not_serving_until_told_and_one_status_for_every_name(
    served_report: tuple[HealthReport, health_pb2_grpc.HealthStub],
) -> None:
    report, stub = served_report
    assert await statuses(stub) == [NOT_SERVING] * 3
    await report.set_serving(True)
    assert await statuses(stub) == [SERVING] * 3
    await report.set_serving(False)
    assert await statuses(stub) == [NOT_SERVING] * 3
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await stub.Check(health_pb2.HealthCheckRequest(service="ztate.v1.Nothing"))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_watchers_see_each_change_and_the_shutdown_ends_their_streams(
    served_report: tuple[HealthReport, health_pb2_grpc.HealthStub],
) -> None:
    report, stub = served_report
    watches = [stub.Watch(health_pb2.HealthCheckRequest(service=name)) for name in ("", *NAMES)]

    async def next_statuses() -> list[int]:
        return [(await asyncio.wait_for(w.read(), 5)).status for w in watches]

    assert await next_statuses() == [NOT_SERVING] * 3
    await report.set_serving(True)
    assert await next_statuses() == [SERVING] * 3
    await report.enter_graceful_shutdown()
    assert await next_statuses() == [NOT_SERVING] * 3
    assert [await asyncio.wait_for(w.read(), 5) for w in watches] == [grpc.aio.EOF] * 3
    await report.set_serving(True)  # ignored: a stopping server never serves again
    assert await statuses(stub) == [NOT_SERVING] * 3


async def test_watching_an_unknown_service_answers_service_unknown(
    served_report: tuple[HealthReport, health_pb2_grpc.HealthStub],
) -> None:
    """Check refuses an unknown name (NOT_FOUND); Watch, as the protocol says, answers
    SERVICE_UNKNOWN and keeps the stream open (the name may be registered later)."""
    report, stub = served_report
    watch = stub.Watch(health_pb2.HealthCheckRequest(service="ztate.v1.Nothing"))
    assert (await asyncio.wait_for(watch.read(), 5)).status == SERVICE_UNKNOWN
    await report.set_serving(True)  # the known names change; the unknown one does not
    assert await statuses(stub) == [SERVING] * 3
    await report.enter_graceful_shutdown()  # ... and its stream ends with the server's
    assert await asyncio.wait_for(watch.read(), 5) is grpc.aio.EOF
