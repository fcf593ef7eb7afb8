"""Idle WatchThread and SubscribeWork streams cost the database nothing per stream:
one notification path, one re-read and one work poll per process, whatever the
number of streams (real gRPC, mTLS and Postgres; the database's own transaction
counter is the measure)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest_asyncio

from tests.harness import INITIAL, Pki, client, new_thread_id
from tests.integration.test_watch_limits import eventually
from ztate.services.runtime.config import Settings
from ztate.transition_service import watch as watch_module
from ztate.transition_service.app import RunningService, start

WINDOW_SECONDS = 6.0
SETTLE_SECONDS = 11.0


@pytest_asyncio.fixture
async def roomy(settings: Settings, own_dsn: str) -> AsyncIterator[RunningService]:
    running = await start(
        settings.model_copy(
            update={"watch_max_streams": 400, "watch_max_streams_per_identity": 400}
        ),
        dsn=own_dsn,
    )
    yield running
    await running.stop(grace=1.0)


async def transactions(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        count: int = await conn.fetchval(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        return count
    finally:
        await conn.close()


async def idle_cost(roomy: RunningService, dsn: str, pki: Pki, threads: list[str], n: int) -> int:
    """Database transactions during WINDOW_SECONDS with ``n`` idle streams open."""
    watcher, work = roomy.watcher, roomy.work and roomy.work.dispatcher
    assert watcher is not None
    assert work is not None
    target = f"localhost:{roomy.port}"
    async with (
        client(target, pki.node("planner")) as worker,
        client(target, pki.node("planner")) as subscriber,
    ):
        streams: list[Any] = [worker.watch(threads[i % len(threads)], 0) for i in range(n)]
        streams += [subscriber.subscribe_work() for _ in range(n)]
        # start every stream; each waits for a version after 0
        tasks = [asyncio.create_task(anext(stream)) for stream in streams]
        try:
            await eventually(lambda: _true(watcher.active == n and work.active == n))
            rounds = watcher.rechecks
            await eventually(lambda: _true(watcher.rechecks > rounds), within=10)
            # opening the streams queried; Postgres flushes an idle backend's counters
            # up to 10 s late
            await asyncio.sleep(SETTLE_SECONDS)  # not a sync: the counters' flush delay
            before = await transactions(dsn)
            await asyncio.sleep(WINDOW_SECONDS)  # the measured window, not a sync
            after = await transactions(dsn)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            for stream in streams:
                await stream.aclose()
        await eventually(lambda: _true(watcher.active == work.active == 0))
    return after - before


async def _true(value: bool) -> bool:
    return value


async def test_idle_streams_cost_no_queries_per_stream(
    roomy: RunningService, own_dsn: str, pki: Pki
) -> None:
    assert watch_module.RECHECK_SECONDS <= WINDOW_SECONDS / 2  # the re-read runs in the window
    threads = []
    async with client(f"localhost:{roomy.port}", pki.operator()) as operator:
        for _ in range(20):
            thread_id = new_thread_id()
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
            threads.append(thread_id)
    few = await idle_cost(roomy, own_dsn, pki, threads, 10)
    many = await idle_cost(roomy, own_dsn, pki, threads, 120)
    # one re-read every RECHECK_SECONDS per process either way; re-reading per stream
    # (as before) cost the 110 extra streams ~330 more transactions in this window. The
    # database is this test's own (the session's, shared with other services' sweeps,
    # signers and outboxes, once added 139 in a busy run): the bound is one transaction
    # per extra stream over the window, a third of the per-stream cost.
    assert many <= few + (120 - 10), (few, many)
