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
succeeds, which ``start`` of each service calls once migrations have run. During
a graceful shutdown the health servicer ignores further reports, so the watchdog
cannot turn a stopping server back to SERVING.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

log = logging.getLogger("ztate.health")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class DatabaseHealth:
    """Keeps the gRPC health of ``services`` (and of the server) in step with the database."""

    def __init__(
        self,
        health: HealthServicer,
        services: Sequence[str],
        ping: Callable[[], Awaitable[None]],
        *,
        interval: float,
        timeout: float,
    ) -> None:
        self._health = health
        self._names = ("", *services)
        self._ping = ping
        self._interval = interval
        self._timeout = timeout
        self._serving: bool | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def serving(self) -> bool:
        return bool(self._serving)

    async def not_serving_yet(self) -> None:
        """Report NOT_SERVING before the server binds, until the first ping succeeds."""
        for name in self._names:
            await self._health.set(name, NOT_SERVING)

    async def check(self) -> bool:
        """Ping the database once and report the result; True if it answered."""
        try:
            async with asyncio.timeout(self._timeout):
                await self._ping()
        except Exception as failure:  # unreachable, too slow, or refusing us: not serving
            await self._report(False, type(failure).__name__)
            return False
        await self._report(True, None)
        return True

    async def _report(self, serving: bool, why: str | None) -> None:
        if serving == self._serving:
            return
        if serving:
            log.info("the database answers: reporting SERVING")
        else:
            log.warning("the database does not answer (%s): reporting NOT_SERVING", why)
        self._serving = serving
        status = SERVING if serving else NOT_SERVING
        for name in self._names:
            await self._health.set(name, status)

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
