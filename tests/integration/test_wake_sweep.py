"""The Waker's sweep for threads whose wake mark is behind their head (docs/work.md).

Since migration 0018 every commit decides its own wakes, so only a thread committed
before it can be behind; the sweep, a scan of every thread, runs at start-up, after the
LISTEN connection came back, and, once a sweep found nothing behind, only once per
``IDLE_SWEEP_SECONDS`` (before: every ``SWEEP_EVERY`` poll periods, forever). A thread
left behind (its mark set back by SQL, its work rows gone, as a lost pre-0018 decision
leaves them) is still caught up. Real Postgres, real gRPC with mTLS; one service of its
own on a database of its own.
"""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg

from tests.harness import INITIAL, Pki, client, new_thread_id
from tests.integration.test_watch_limits import eventually
from ztate.services.runtime.config import Settings
from ztate.testing._ledger import fresh_database
from ztate.transition_service.app import RunningService, start
from ztate.transition_service.work import SWEEP_EVERY, WorkDispatcher


async def leave_behind(dsn: str, thread_id: str) -> None:
    """As a pre-0018 commit whose wakes were never decided: no work, the mark behind."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("DELETE FROM ztate.node_work WHERE thread_id = $1", thread_id)
        await conn.execute(
            "UPDATE ztate.wake_marks SET evaluated_version = -1 WHERE thread_id = $1", thread_id
        )
    finally:
        await conn.close()


async def caught_up(dsn: str, thread_id: str) -> bool:
    """The genesis decided again: the parser's work is back, the mark at the head."""
    conn = await asyncpg.connect(dsn)
    try:
        mark = await conn.fetchval(
            "SELECT evaluated_version FROM ztate.wake_marks WHERE thread_id = $1", thread_id
        )
        work = await conn.fetch(
            "SELECT node, wake_version FROM ztate.node_work WHERE thread_id = $1", thread_id
        )
    finally:
        await conn.close()
    return mark == 0 and [(r["node"], r["wake_version"]) for r in work] == [("input-parser", 0)]


async def polled(dispatcher: WorkDispatcher, rounds: int) -> bool:
    return dispatcher.polls >= rounds


async def test_a_clean_sweep_is_not_repeated_each_poll_yet_a_thread_behind_is_caught_up(
    settings: Settings, postgres_server_dsn: str, pki: Pki
) -> None:
    dsn = await fresh_database(postgres_server_dsn)
    fast = settings.model_copy(update={"listen": "127.0.0.1:0", "work_poll_seconds": 0.05})
    running: RunningService = await start(fast, dsn=dsn)
    thread_id = new_thread_id()
    try:
        assert running.work is not None
        dispatcher = running.work.dispatcher
        async with client(f"localhost:{running.port}", pki.operator()) as operator:
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        assert await caught_up(dsn, thread_id)  # decided by its creation
        async with client(f"localhost:{running.port}", pki.node("planner")) as planner:
            # an idle planner stream: the dispatcher polls each round (the genesis wakes
            # only the parser); its first poll follows the start-up sweep
            stream = planner.subscribe_work()
            subscribed = asyncio.create_task(anext(stream))
            try:
                await eventually(lambda: polled(dispatcher, 1))
                await leave_behind(dsn, thread_id)
                rounds = dispatcher.polls + 3 * SWEEP_EVERY
                await eventually(lambda: polled(dispatcher, rounds))
                # three sweep periods of before: the start-up sweep found nothing behind,
                # so none ran since
                assert not await caught_up(dsn, thread_id)
                assert dispatcher.sweeps == 1
                # the LISTEN connection lost and back: the next round sweeps
                backend = running.listener.backend
                assert backend is not None
                killer = await asyncpg.connect(dsn)
                try:
                    assert await killer.fetchval("SELECT pg_terminate_backend($1)", backend.pid)
                finally:
                    await killer.close()
                await eventually(lambda: caught_up(dsn, thread_id))
                assert dispatcher.sweeps == 2
                assert not subscribed.done()  # the planner never had work here
            finally:
                subscribed.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await subscribed
                await stream.aclose()
        # and at start-up
        await leave_behind(dsn, thread_id)
        await running.stop(grace=1.0)
        running = await start(fast, dsn=dsn)
        await eventually(lambda: caught_up(dsn, thread_id))
    finally:
        await running.stop(grace=1.0)
