"""Waking proposers who wait for the outcome of a parked transition, and watchers
of a thread when it commits a new version.

Every new ledger record of a watched thread is announced on ``ztate_commits``
(payload: the thread id) by the session that committed it, right after its commit
(migration 0013); every status change of a parked transition is announced with
``pg_notify`` in the same transaction. Both are sent from the committer's own
session, which on Citus is a coordinator session, as this LISTEN connection is: so
every replica's listener hears both once they are committed, on plain Postgres and
on Citus alike. Waiters also
re-read the status every second, and watchers their thread every few seconds,
which covers an announcement missed while the listening connection was down.

One connection serves every waiter and watcher of the process. When it is lost
(a Postgres restart, a failover), it is re-opened with backoff; once it is back,
every waiter and watcher is woken (they re-read at once: announcements may have
been missed meanwhile) and the ``on_reconnect`` callbacks run (the watcher
registers its threads again under the new session). The connection's identity
(backend pid and start, ``backend``) keys this replica's rows of
``ztate.watched_threads``; the listener sweeps rows of sessions that no longer
exist (crashed replicas) when it starts and every ``sweep_interval`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg

from ztate.services.runtime.telemetry import untraced
from ztate.services.store.approvals import OUTCOME_CHANNEL
from ztate.services.store.rows import Backend
from ztate.services.store.transitions import COMMIT_CHANNEL, session_backend, sweep_watched_threads
from ztate.services.store.work import WORK_CHANNEL

SWEEP_INTERVAL_SECONDS = 60.0
FIRST_RETRY_SECONDS = 0.1
LONGEST_RETRY_SECONDS = 5.0

log = logging.getLogger("ztate.transition")


class OutcomeListener:
    """One LISTEN connection per process, fanning announcements out to waiters."""

    def __init__(
        self, dsn: str, role: str, *, sweep_interval: float = SWEEP_INTERVAL_SECONDS
    ) -> None:
        self._dsn = dsn
        self._role = role
        self._sweep_interval = sweep_interval
        self._conn: asyncpg.Connection | None = None
        self._backend: Backend | None = None
        self._lost = asyncio.Event()
        self._sweeping = asyncio.Lock()  # one query at a time on the connection
        self._supervisor: asyncio.Task[None] | None = None
        self._on_reconnect: list[Callable[[], Awaitable[None]]] = []
        self._waiters: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
        self._watchers: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
        self._on_work: list[Callable[[str | None], None]] = []
        self.reconnects = 0

    @property
    def backend(self) -> Backend | None:
        """The session of the LISTEN connection now (None while it is down)."""
        return self._backend

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run ``callback`` each time the connection is back after a loss."""
        self._on_reconnect.append(callback)

    async def start(self) -> None:
        # the service's own set-up and upkeep, not a request's work: the supervisor
        # task inherits the suppression from this context
        with untraced():
            await self._connect()
            await self.sweep()
            self._supervisor = asyncio.create_task(self._supervise(), name="ztate-outcome-listener")

    async def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
            self._supervisor = None
        if self._conn is not None:
            conn, self._conn, self._backend = self._conn, None, None
            await conn.close()

    async def sweep(self) -> int:
        """Remove watched threads of replicas whose LISTEN session is gone."""
        async with self._sweeping:
            if self._conn is None:
                return 0
            swept = await sweep_watched_threads(self._conn)
        if swept:
            log.info("removed %d watched threads of replicas that are gone", swept)
        return swept

    async def _connect(self) -> None:
        conn = await asyncpg.connect(
            self._dsn, server_settings={"role": self._role, "application_name": "ztate-outcomes"}
        )
        try:
            await conn.add_listener(OUTCOME_CHANNEL, self._announced)
            await conn.add_listener(COMMIT_CHANNEL, self._committed)
            await conn.add_listener(WORK_CHANNEL, self._work_announced)
            backend = await session_backend(conn)
        except BaseException:
            conn.terminate()
            raise
        self._lost.clear()
        conn.add_termination_listener(self._terminated)
        self._conn, self._backend = conn, backend

    def _terminated(self, conn: object) -> None:
        if conn is self._conn:
            self._conn, self._backend = None, None
            self._lost.set()

    async def _supervise(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self._sweep_interval):  # not wait_for: see outbox
                    await self._lost.wait()
            except TimeoutError:
                await self._sweep_quietly()
                continue
            log.warning("the LISTEN connection was lost; reconnecting")
            await self._reconnect()

    async def _reconnect(self) -> None:
        pause = FIRST_RETRY_SECONDS
        while True:
            try:
                await self._connect()
                break
            except Exception as failure:  # whatever it is, keep trying: waiters rely on it
                log.warning("LISTEN reconnect failed: %s", type(failure).__name__)
                await asyncio.sleep(pause)  # backoff between attempts, not synchronisation
                pause = min(pause * 2, LONGEST_RETRY_SECONDS)
        self.reconnects += 1
        log.info("the LISTEN connection is back")
        self._wake_everyone()
        for callback in self._on_reconnect:
            try:
                await callback()
            except Exception as failure:  # the periodic re-reads still cover them
                log.warning("after reconnect: %s", type(failure).__name__)
        await self._sweep_quietly()

    async def _sweep_quietly(self) -> None:
        try:
            await self.sweep()
        except Exception as failure:
            log.warning("could not sweep watched threads: %s", type(failure).__name__)

    def _wake_everyone(self) -> None:
        for callback in self._on_work:
            callback(None)
        for groups in (self._waiters, self._watchers):
            for events in groups.values():
                for event in events:
                    event.set()

    def _announced(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        for event in self._waiters.get(str(payload), ()):
            event.set()

    def on_work(self, callback: Callable[[str | None], None]) -> None:
        """Call ``callback`` with a node's name when some replica announces new work
        for it, and with None when announcements may have been missed (reconnect)."""
        self._on_work.append(callback)

    def _work_announced(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        for callback in self._on_work:
            callback(str(payload))

    def _committed(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        for event in self._watchers.get(str(payload), ()):
            event.set()

    def wake_all_watchers(self) -> None:
        """Wake every thread watcher (the service is stopping)."""
        for events in self._watchers.values():
            for event in events:
                event.set()

    @contextlib.asynccontextmanager
    async def watching_thread(self, thread_id: str) -> AsyncIterator[asyncio.Event]:
        """An event set whenever ``thread_id`` commits a new version."""
        event = asyncio.Event()
        self._watchers[thread_id].add(event)
        try:
            yield event
        finally:
            self._watchers[thread_id].discard(event)
            if not self._watchers[thread_id]:
                del self._watchers[thread_id]

    @contextlib.asynccontextmanager
    async def watching(self, digest: str) -> AsyncIterator[asyncio.Event]:
        """An event set when ``digest``'s status is announced."""
        event = asyncio.Event()
        self._waiters[digest].add(event)
        try:
            yield event
        finally:
            self._waiters[digest].discard(event)
            if not self._waiters[digest]:
                del self._waiters[digest]
