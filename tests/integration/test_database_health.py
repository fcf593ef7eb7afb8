"""``DatabaseHealth`` and ``pool_ping`` on a real Postgres: what turns a service
NOT_SERVING (two failed pings in a row: no answer, too slow, a standby), what
turns it back (one good ping), what changes nothing (a busy pool), and the
watchdog's life (``start`` once, ``stop`` cancels).

A slow database is made real by locking the table the ping reads; a database
that is gone by a pool pointed at a port nothing listens on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest
import pytest_asyncio

from tests.faults import free_port
from tests.harness import fresh_database
from ztate.services.runtime.health import (
    NOT_SERVING,
    SERVING,
    DatabaseHealth,
    HealthReport,
    pool_ping,
)

TABLE = "probe.things"
TIMEOUT = 0.5


@pytest_asyncio.fixture
async def dsn(postgres_server_dsn: str) -> str:
    dsn = await fresh_database(postgres_server_dsn)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f"CREATE SCHEMA probe; CREATE TABLE {TABLE} (n int)")
    finally:
        await conn.close()
    return dsn


@pytest_asyncio.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        yield pool
    finally:
        await pool.close()


def status(report: HealthReport) -> int:
    statuses = set(report._status.values())
    assert len(statuses) == 1  # one status for every name
    return statuses.pop()


def watched(pool: asyncpg.Pool) -> tuple[HealthReport, DatabaseHealth]:
    report = HealthReport(("ztate.v1.Test",))
    health = DatabaseHealth(
        report, pool_ping(pool, TABLE, timeout=TIMEOUT), interval=60, timeout=TIMEOUT
    )
    return report, health


async def test_a_writable_primary_whose_table_reads_is_serving(pool: asyncpg.Pool) -> None:
    report, health = watched(pool)
    assert status(report) == NOT_SERVING  # until the first good ping
    assert await pool_ping(pool, TABLE, timeout=TIMEOUT)() is True
    assert await health.check() is True
    assert status(report) == SERVING


async def test_a_slow_database_is_not_serving_after_two_pings_and_back_after_one(
    pool: asyncpg.Pool, dsn: str
) -> None:
    report, health = watched(pool)
    assert await health.check() is True
    locker = await asyncpg.connect(dsn)
    try:
        async with locker.transaction():
            await locker.execute(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            assert await health.check() is False  # the read waits for the lock: too slow
            assert time.monotonic() - started < 4 * TIMEOUT  # bounded by the timeout
            assert status(report) == SERVING  # one slow answer does not take it out
            assert await health.check() is False
            assert status(report) == NOT_SERVING  # two in a row do
        # the lock is gone: one good ping brings it back
        assert await health.check() is True
        assert status(report) == SERVING
        # a single failure between good pings never reaches the threshold
        async with locker.transaction():
            await locker.execute(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE")
            assert await health.check() is False
        assert await health.check() is True
        async with locker.transaction():
            await locker.execute(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE")
            assert await health.check() is False
        assert status(report) == SERVING
    finally:
        await locker.close()


async def test_a_database_that_is_gone_is_not_serving() -> None:
    nowhere = f"postgresql://ztate@127.0.0.1:{free_port()}/ztate"
    pool = await asyncpg.create_pool(nowhere, min_size=0, max_size=2)
    try:
        with pytest.raises(ConnectionRefusedError):
            await pool_ping(pool, TABLE, timeout=TIMEOUT)()
        report, health = watched(pool)
        assert await health.check() is False
        assert status(report) == NOT_SERVING  # never served: nothing to hold on to
    finally:
        await pool.close()


async def test_a_table_the_role_cannot_read_is_not_serving(pool: asyncpg.Pool) -> None:
    with pytest.raises(asyncpg.UndefinedTableError):
        await pool_ping(pool, "probe.missing", timeout=TIMEOUT)()


async def test_a_busy_pool_changes_nothing(pool: asyncpg.Pool) -> None:
    report, health = watched(pool)
    assert await health.check() is True
    held = [await pool.acquire(), await pool.acquire()]  # every connection in use
    try:
        for _ in range(3):  # more than the threshold: still not counted as failures
            assert await health.check() is True
        assert status(report) == SERVING
    finally:
        for conn in held:
            await pool.release(conn)
    assert await health.check() is True


async def test_a_standby_is_not_serving(pool: asyncpg.Pool) -> None:
    """A standby (after a failover, a replica the DSN now points at) answers but cannot
    commit. No standby is started here; the decision is tested on the real answer of
    the same query, ``pg_is_in_recovery()``, read from a primary and negated."""

    async def standby() -> bool:
        async with pool.acquire() as conn:
            in_recovery: bool = await conn.fetchval("SELECT pg_is_in_recovery()")
        assert in_recovery is False  # a primary ...
        return in_recovery  # ... whose NOT pg_is_in_recovery() a standby would answer

    report = HealthReport(("ztate.v1.Test",))
    health = DatabaseHealth(report, standby, interval=60, timeout=TIMEOUT)
    await report.set_serving(True)
    health._serving = True
    assert await health.check() is False
    assert await health.check() is False
    assert status(report) == NOT_SERVING


async def test_start_twice_runs_one_watchdog_and_stop_cancels_it(pool: asyncpg.Pool) -> None:
    _report, health = watched(pool)

    others = {t for t in asyncio.all_tasks() if t.get_name() == "ztate-database-health"}

    def watchdogs() -> list[asyncio.Task[object]]:  # this one's (a session's service has its own)
        return [
            t
            for t in asyncio.all_tasks()
            if t.get_name() == "ztate-database-health" and t not in others
        ]

    health.start()
    health.start()
    [task] = watchdogs()
    await health.stop()
    assert task.cancelled()
    assert watchdogs() == []
    health.start()  # and it can start again after a stop
    [again] = watchdogs()
    assert again is not task
    await health.stop()
    assert again.cancelled()
