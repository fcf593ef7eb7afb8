"""What a service reports through ``grpc.health.v1``: whether it can do its work.

Both services can serve only while their database answers. ``DatabaseHealth``
pings the database through the service's own pool every ``interval`` seconds,
with a short timeout, and reports the result for the whole server (``""``) and
for each of the service's names: NOT_SERVING once two pings in a row failed (or
found a standby, which cannot commit), SERVING again as soon as one succeeds; a
pool too busy to lend a connection for the ping changes nothing. Nothing else
changes during an outage: calls that need the database fail fast with
UNAVAILABLE (``ztate.services.runtime.rpc_guard``), the pool opens fresh connections once the
database is back, and a load balancer or an orchestrator watching health takes
the replica out and back in by itself. A pool whose every connection hangs on
a database that stopped answering reads as busy: those calls are bounded by
their callers' deadlines.

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

import asyncpg
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ztate.services.runtime.telemetry import untraced

log = logging.getLogger("ztate.health")
Status: TypeAlias = health_pb2.HealthCheckResponse.ServingStatus
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthReport(health_pb2_grpc.HealthServicer):  # type: ignore[misc]  # untyped base
    """``grpc.health.v1.Health`` for one server: the server (``""``) and its services
    share one status, NOT_SERVING until the first ``set_serving(True)``."""

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

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthListResponse:
        """Every name and its status (the base class would raise, which grpc answers as
        UNKNOWN with the exception's name)."""
        response = health_pb2.HealthListResponse()
        for name, status in self._status.items():
            response.statuses[name].status = status
        return response

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

    def serving_now(self) -> bool:
        """Whether the whole server (``""``) is SERVING: one read of a dict the event
        loop writes, atomic under the GIL, so safe from another thread (the endpoint's
        ``GET /readyz``, ``ztate.services.runtime.scrape``)."""
        serving: bool = self._status[""] == SERVING
        return serving

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


class PoolBusy(Exception):
    """No connection of the pool came free within the ping's timeout: the service is
    busy with its own calls, which says nothing against the database."""


Ping: TypeAlias = Callable[[], Awaitable[bool]]
"""Ask the database once: True if it is a writable primary whose tables the service
can read, False if it answered as a standby (in recovery: it cannot take a commit);
raises if it did not answer, ``PoolBusy`` if the pool had no connection to ask with."""

PING = "SELECT NOT pg_is_in_recovery(), EXISTS (SELECT 1 FROM {table} LIMIT 1)"


def pool_ping(pool: asyncpg.Pool, table: str, *, timeout: float) -> Ping:
    """The ``Ping`` of a service's own pool: one cheap query that proves the server is
    a primary (``pg_is_in_recovery()`` is false) and that ``table`` is readable with
    the service's role. ``timeout`` bounds the wait for a connection and the query
    each; a wait for a connection is ``PoolBusy`` when every connection is in use."""
    query = PING.format(table=table)

    async def ping() -> bool:
        try:
            conn = await pool.acquire(timeout=timeout)
        except TimeoutError:
            if pool.get_idle_size() == 0 and pool.get_size() >= pool.get_max_size():
                raise PoolBusy from None
            raise  # no connection could be opened in time: the database does not answer
        try:
            async with asyncio.timeout(timeout):
                row = await conn.fetchrow(query)
        finally:
            await pool.release(conn)
        assert row is not None
        primary: bool = row[0]
        return primary

    return ping


class DatabaseHealth:
    """Keeps a ``HealthReport`` in step with the database: a watchdog task that pings.

    NOT_SERVING after ``failures`` consecutive failed pings (unanswered, too slow,
    or answered by a standby), SERVING again after one good ping: a single slow
    answer under load does not take a replica out. A ping that finds the pool busy
    changes nothing. Before the first good ping the report is NOT_SERVING.
    """

    def __init__(
        self,
        report: HealthReport,
        ping: Ping,
        *,
        interval: float,
        timeout: float,
        failures: int = 2,
    ) -> None:
        self._report = report
        self._ping = ping
        self._interval = interval
        self._timeout = timeout
        self._failures_to_fail = failures
        self._failures = 0
        self._serving: bool | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def serving(self) -> bool | None:
        """What is reported now (None before the first check)."""
        return self._serving

    async def check(self) -> bool:
        """Ping the database once and report the result; True if it answered as a
        writable primary (or the pool was busy and the status was SERVING)."""
        try:
            # upkeep, not a request's work: a ping every few seconds leaves no root trace
            async with asyncio.timeout(2 * self._timeout):  # acquire, then the query
                with untraced():
                    primary = await self._ping()
        except PoolBusy:
            log.info("the pool is busy: the database health stays as it was")
            return self._serving is True
        except Exception as failure:  # unreachable, too slow, or refusing us
            return await self._failed(type(failure).__name__)
        if not primary:
            return await self._failed("in recovery: a standby cannot commit")
        self._failures = 0
        await self._update(True, None)
        return True

    async def _failed(self, why: str) -> bool:
        self._failures += 1
        if self._failures >= self._failures_to_fail or self._serving is None:
            await self._update(False, why)
        else:
            log.info("the database did not answer (%s): once, still reporting SERVING", why)
        return False

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
        """Start the watchdog (once: a second call while it runs does nothing)."""
        if self._task is not None and not self._task.done():
            return
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
