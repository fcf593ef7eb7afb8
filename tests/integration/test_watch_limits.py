"""WatchThread's resource limits and its bookkeeping in Postgres: streams per
identity, stream lifetime, rows of dead replicas swept, the LISTEN connection
re-opened after it is lost (real gRPC, mTLS and Postgres)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import grpc
import pytest
import pytest_asyncio

from tests.harness import TRUST_DOMAIN, Ledger, Pki, act, client
from tests.integration.test_watch import new_thread, take
from ztate.services.runtime.config import Settings
from ztate.services.runtime.identity import Identity, Role
from ztate.services.store.transitions import session_backend
from ztate.transition_service.app import RunningService, start
from ztate.v1 import transition_pb2
from ztate.worker_sdk import NodeRunner, TooManyStreams, View, ZtateClient


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 15.0) -> None:
    """Poll ``check`` until it holds, or fail after ``within`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await check():
        assert loop.time() < deadline, "the condition never held"
        await asyncio.sleep(0.05)  # polling a condition, with a deadline


@pytest_asyncio.fixture
async def limited(settings: Settings, database_dsn: str) -> AsyncIterator[RunningService]:
    running = await start(
        settings.model_copy(
            update={
                "watch_max_streams": 10,
                "watch_max_streams_per_identity": 2,
                "watch_max_stream_seconds": 1.0,
            }
        ),
        dsn=database_dsn,
    )
    yield running
    await running.stop(grace=1.0)


async def rows_of(dsn: str, thread_id: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(
            "SELECT backend_pid, backend_start FROM ztate.watched_threads WHERE thread_id = $1",
            thread_id,
        )
    finally:
        await conn.close()


async def test_one_identity_holds_at_most_its_share_of_streams(
    limited: RunningService, pki: Pki, ledger: Ledger
) -> None:
    target = f"localhost:{limited.port}"
    thread_id = await new_thread(target, pki)
    before = await ledger.snapshot(thread_id)
    async with (
        client(target, pki.node("planner")) as planner,
        client(target, pki.node("db-writer")) as writer,
    ):
        first, second = planner.watch(thread_id), planner.watch(thread_id)
        await take(first, 1)
        await take(second, 1)
        with pytest.raises(TooManyStreams) as refused:
            await anext(planner.watch(thread_id))
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.reason == "TOO_MANY_STREAMS"
        assert refused.value.limit == 2
        # another identity is not held back by the planner's streams
        other = writer.watch(thread_id)
        (seen,) = await take(other, 1)
        assert seen.version == 0
        await other.aclose()
        await first.aclose()
        await second.aclose()
    assert await ledger.snapshot(thread_id) == before


async def test_a_stream_ends_cleanly_at_its_lifetime_and_the_sdk_resumes(
    limited: RunningService, pki: Pki
) -> None:
    target = f"localhost:{limited.port}"
    thread_id = await new_thread(target, pki)
    async with (
        client(target, pki.node("input-parser")) as parser,
        client(target, pki.operator()) as operator,
    ):
        # the raw stream: it ends with OK once its 1 s lifetime is over
        call = operator._stub.WatchThread(
            transition_pb2.WatchThreadRequest(thread_id=thread_id, from_version=-1)
        )
        raw = [message.version async for message in call]
        assert raw == [0]
        assert await call.code() is grpc.StatusCode.OK
        # the SDK resumes from the last version across several lifetimes: every
        # version once, in order, with no error
        stream = operator.watch(thread_id, reconnects=0)
        assert [e.version for e in await take(stream, 1)] == [0]
        for version in range(3):
            opened = limited.watcher.opened if limited.watcher else 0
            # the consumer waits; meanwhile the stream reaches its lifetime and the
            # SDK opens the next one
            pending = asyncio.create_task(take(stream, 1, within=15))
            await eventually(lambda opened=opened: _more_opened(limited, opened), within=10)
            await parser.propose(thread_id, version, {"requested_action": act(f"v{version}")})
            (event,) = await pending
            assert event.version == version + 1
        await stream.aclose()


async def test_the_runner_acts_across_stream_lifetimes(limited: RunningService, pki: Pki) -> None:
    """``NodeRunner.run`` goes on when the server ends its watch stream at the stream's
    lifetime (the SDK's ``watch`` resumes from the last version): a change committed
    after two lifetimes is acted on, once; run ends at ``stop_after``, not with the
    stream (the TypeScript runner had this defect; the Python one is held to it here)."""
    target = f"localhost:{limited.port}"
    thread_id = await new_thread(target, pki)
    watching = asyncio.Event()

    def plan(view: View) -> dict[str, Any] | None:
        if view.version == 0:
            watching.set()
        requested = view.state.get("requested_action")
        if requested is None:
            return None
        return {"pending_transition": {"action": "lookup", "order_id": requested["order_id"]}}

    async with (
        client(target, pki.node("planner")) as planner,
        client(target, pki.node("input-parser")) as parser,
    ):
        runner = NodeRunner(planner, thread_id, plan, node_name="planner")
        running = asyncio.create_task(runner.run(stop_after=2))
        try:
            await asyncio.wait_for(watching.wait(), 10)
            for base in (0, 2):
                for _ in range(2):  # two lifetimes: the runner's stream ended and was re-opened
                    opened = limited.watcher.opened if limited.watcher else 0
                    await eventually(
                        lambda opened=opened: _more_opened(limited, opened, unless=running)
                    )
                assert not running.done(), "run() ended with the server's stream"
                await parser.propose(thread_id, base, {"requested_action": act(f"L-{base}")})
                await eventually(lambda base=base: _committed(planner, thread_id, base + 2))
            steps = await asyncio.wait_for(running, 15)
        finally:
            running.cancel()
    assert [(s.view_version, s.status, s.transition and s.transition.version) for s in steps] == [
        (1, "committed", 2),
        (3, "committed", 4),
    ]


async def _committed(reader: ZtateClient, thread_id: str, version: int) -> bool:
    return (await reader.get_view(thread_id)).version >= version


async def _more_opened(
    running: RunningService, than: int, *, unless: asyncio.Task[Any] | None = None
) -> bool:
    """More streams were opened than ``than`` (or ``unless`` ended: stop waiting)."""
    if unless is not None and unless.done():
        return True
    return running.watcher is not None and running.watcher.opened > than


async def test_rows_of_a_replica_whose_session_died_are_swept(
    service: RunningService, settings: Settings, database_dsn: str, pki: Pki
) -> None:
    target = f"localhost:{service.port}"
    thread_id = await new_thread(target, pki)
    # a replica registers as the service role, then crashes (its session ends
    # without unregistering)
    crashed = await asyncpg.connect(database_dsn, server_settings={"role": settings.db_role})
    dead = await session_backend(crashed)
    await crashed.execute(
        "INSERT INTO ztate.watched_threads (thread_id, backend_pid, backend_start) "
        "VALUES ($1, $2, $3)",
        thread_id,
        dead.pid,
        dead.started,
    )
    # a row whose pid is alive but whose session started at another time (pid reuse)
    alive = service.listener.backend
    assert alive is not None
    await crashed.execute(
        "INSERT INTO ztate.watched_threads (thread_id, backend_pid, backend_start) "
        "VALUES ($1, $2, $3)",
        thread_id,
        alive.pid,
        datetime(2000, 1, 1, tzinfo=UTC),
    )
    # why the sweep is a SECURITY DEFINER function: the service role alone does not
    # see when other sessions started, so it could not tell a reused pid apart
    hidden = await crashed.fetchval(
        "SELECT backend_start FROM pg_stat_activity WHERE pid = $1", alive.pid
    )
    assert hidden is None
    crashed.terminate()
    async with client(target, pki.node("planner")) as planner:
        stream = planner.watch(thread_id)
        await take(stream, 1)  # this replica's own row, which must stay
        assert len(await rows_of(database_dsn, thread_id)) == 3

        async def swept() -> bool:
            await service.listener.sweep()
            return [
                (r["backend_pid"], r["backend_start"])
                for r in await rows_of(database_dsn, thread_id)
            ] == [(alive.pid, alive.started)]

        await eventually(swept)  # the dead session may take a moment to leave
        await stream.aclose()


async def test_a_replica_sweeps_dead_rows_when_it_starts(
    settings: Settings, database_dsn: str, pki: Pki, service: RunningService
) -> None:
    thread_id = await new_thread(f"localhost:{service.port}", pki)
    crashed = await asyncpg.connect(database_dsn, server_settings={"role": settings.db_role})
    dead = await session_backend(crashed)
    await crashed.execute(
        "INSERT INTO ztate.watched_threads (thread_id, backend_pid, backend_start) "
        "VALUES ($1, $2, $3)",
        thread_id,
        dead.pid,
        dead.started,
    )
    await crashed.close()
    probe = await asyncpg.connect(database_dsn)
    try:
        await eventually(lambda: _gone(probe, dead.pid))  # the session has left pg_stat_activity
    finally:
        await probe.close()
    running = await start(settings, dsn=database_dsn)
    try:
        assert await rows_of(database_dsn, thread_id) == []
    finally:
        await running.stop(grace=1.0)


async def _gone(conn: asyncpg.Connection, pid: int) -> bool:
    return not await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid)


async def test_the_listener_reconnects_and_registers_its_threads_again(
    limited: RunningService, pki: Pki, postgres_server_dsn: str, database_dsn: str
) -> None:
    target = f"localhost:{limited.port}"
    thread_id = await new_thread(target, pki)
    listener = limited.listener
    old = listener.backend
    assert old is not None
    async with (
        client(target, pki.node("input-parser")) as parser,
        client(target, pki.node("planner")) as planner,
    ):
        stream = planner.watch(thread_id)
        await take(stream, 1)
        assert [r["backend_pid"] for r in await rows_of(database_dsn, thread_id)] == [old.pid]
        admin = await asyncpg.connect(postgres_server_dsn)
        try:
            assert await admin.fetchval("SELECT pg_terminate_backend($1)", old.pid)
        finally:
            await admin.close()

        async def back() -> bool:
            new = listener.backend
            if new is None or new == old:
                return False
            rows = await rows_of(database_dsn, thread_id)
            return [(r["backend_pid"], r["backend_start"]) for r in rows] == [
                (new.pid, new.started)
            ]

        await eventually(back)
        assert listener.reconnects >= 1
        # announcements reach the stream again through the new session
        conn = await asyncpg.connect(database_dsn)
        heard: asyncio.Queue[str] = asyncio.Queue()
        await conn.add_listener("ztate_commits", lambda *args: heard.put_nowait(args[3]))
        try:
            await parser.propose(thread_id, 0, {"requested_action": act("after")})
            assert await asyncio.wait_for(heard.get(), 10) == thread_id
            (event,) = await take(stream, 1)
            assert event.version == 1
        finally:
            await conn.close()
        await stream.aclose()


async def test_a_cancel_while_closing_gives_the_slot_back(
    service: RunningService, pki: Pki, database_dsn: str
) -> None:
    watcher = service.watcher
    assert watcher is not None
    thread_id = await new_thread(f"localhost:{service.port}", pki)
    caller = Identity(TRUST_DOMAIN, Role.NODE, "planner")
    before = watcher.active
    subscription = await watcher.open(caller, thread_id, -1)
    assert watcher.active == before + 1
    assert watcher.watched().get(thread_id) == 1
    closing = asyncio.create_task(subscription.close())
    await asyncio.sleep(0)  # let close() start, then cancel it at its first await
    closing.cancel()
    await asyncio.gather(closing, return_exceptions=True)
    assert watcher.active == before
    assert thread_id not in watcher.watched()

    async def unregistered() -> bool:
        return await rows_of(database_dsn, thread_id) == []

    await eventually(unregistered)
