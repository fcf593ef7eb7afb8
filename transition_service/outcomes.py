"""Waking proposers who wait for the outcome of a parked transition, and watchers
of a thread when it commits a new version.

Every new ledger record is announced on ``ztate_commits`` (payload: the thread
id) by a trigger (migration 0008); every status change of a parked transition is
announced with ``pg_notify`` in the same transaction. So every replica's
listener hears both once they are committed. Waiters also re-read the status
every second, which covers an announcement missed while the listening
connection was down (it is not re-opened: a lost listener degrades waiting to
that one-second re-check); watchers likewise re-read their thread every few
seconds. One connection serves every waiter and watcher of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator

import asyncpg

from services.store.approvals import OUTCOME_CHANNEL
from services.telemetry import untraced

COMMIT_CHANNEL = "ztate_commits"

log = logging.getLogger("ztate.transition")


class OutcomeListener:
    """One LISTEN connection per process, fanning announcements out to waiters."""

    def __init__(self, dsn: str, role: str) -> None:
        self._dsn = dsn
        self._role = role
        self._conn: asyncpg.Connection | None = None
        self._waiters: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
        self._watchers: defaultdict[str, set[asyncio.Event]] = defaultdict(set)

    async def start(self) -> None:
        with untraced():  # the service's own set-up, not a request's work
            self._conn = await asyncpg.connect(
                self._dsn,
                server_settings={"role": self._role, "application_name": "ztate-outcomes"},
            )
            await self._conn.add_listener(OUTCOME_CHANNEL, self._announced)
            await self._conn.add_listener(COMMIT_CHANNEL, self._committed)

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    def _announced(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        for event in self._waiters.get(str(payload), ()):
            event.set()

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
