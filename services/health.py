"""What a service reports through ``grpc.health.v1``: whether it can do its work.

Both services can serve only while their database answers. ``DatabaseHealth``
pings the database through the service's own pool every ``interval`` seconds,
with a short timeout, and reports the result for the whole server (``""``) and
for each of the service's names: NOT_SERVING while the ping fails, SERVING again
as soon as it succeeds. Nothing else changes during an outage: calls that need
the database fail fast with UNAVAILABLE (``services.rpc_guard``), the pool opens
fresh connections once the database is back, and a load balancer or an
orchestrator watching health takes the replica out and back in by itself.

A server starts NOT_SERVING and reports SERVING only after ``check`` first
succeeds, which ``start`` of each service calls once migrations have run.

``HealthReport`` is the health servicer. It differs from grpcio-health-checking's
reference servicer in one way that matters at shutdown: a Watch stream ends once
it has sent the NOT_SERVING of a graceful shutdown. With the reference servicer
an open Watch (load balancers and gRPC's client-side health checking keep one per
backend) is an in-flight call like any other, and holds the server's stop for
its whole grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeAlias

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("ztate.health")
Status: TypeAlias = health_pb2.HealthCheckResponse.ServingStatus
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthReport(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # untyped base
    """``grpc.health.v1.Health`` for one server: the server (``""``) and its services
    share one status, NOT_SERVING until the first ``set_serving(True)``. (Methods
    of the protocol it does not define, such as List, answer UNIMPLEMENTED.)"""

    def __init__(self, services: Sequence[str]) -> None:
        self._status: dict[str, Status] = dict.fromkeys(("", *services), NOT_SERVING)
        self._changed = asyncio.Condition()
        self._shutting_down = False

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        sent: Status | None = None
        while True:
            status = self._status.get(request.service, SERVICE_UNKNOWN)
            if status != sent:
                yield health_pb2.HealthCheckResponse(status=status)
                sent = status
                continue  # the status may have changed while the answer was sent
            if self._shutting_down:
                return  # NOT_SERVING was sent: do not hold the shutdown's grace
            async with self._changed:
                await self._changed.wait_for(partial(self._moved, request.service, sent))

    def _moved(self, service: str, sent: Status) -> bool:
        return self._shutting_down or self._status.get(service, SERVICE_UNKNOWN) != sent

    async def set_serving(self, serving: bool) -> None:
        """Report every name SERVING or NOT_SERVING (ignored once shutting down)."""
        await self._set(SERVING if serving else NOT_SERVING, shutting_down=False)

    async def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for good: watchers are told, and their streams end."""
        await self._set(NOT_SERVING, shutting_down=True)

    async def _set(self, status: Status, *, shutting_down: bool) -> None:
        async with self._changed:
            if self._shutting_down:
                return
            # both at once (no await between): a watcher sees the shutdown only
            # together with its NOT_SERVING, which it sends before its stream ends
            for name in self._status:
                self._status[name] = status
            self._shutting_down = shutting_down
            self._changed.notify_all()


class DatabaseHealth:
    """Keeps a ``HealthReport`` in step with the database: a watchdog task that pings."""

    def __init__(
        self,
        report: HealthReport,
        ping: Callable[[], Awaitable[None]],
        *,
        interval: float,
        timeout: float,
    ) -> None:
        self._report = report
        self._ping = ping
        self._interval = interval
        self._timeout = timeout
        self._serving: bool | None = None
        self._task: asyncio.Task[None] | None = None

    async def check(self) -> bool:
        """Ping the database once and report the result; True if it answered."""
        try:
            async with asyncio.timeout(self._timeout):
                await self._ping()
        except Exception as failure:  # unreachable, too slow, or refusing us: not serving
            await self._update(False, type(failure).__name__)
            return False
        await self._update(True, None)
        return True

    async def _update(self, serving: bool, why: str | None) -> None:
        if serving == self._serving:
            return
        if serving:
            log.info("the database answers: reporting SERVING")
        else:
            log.warning("the database does not answer (%s): reporting NOT_SERVING", why)
        self._serving = serving
        await self._report.set_serving(serving)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ztate-database-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.check()
