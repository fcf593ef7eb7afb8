"""``NodeRunner.serve`` and its leases across a re-opened work stream (a review of work
dispatch, finding 1): the server ends every SubscribeWork stream after its lifetime and
the SDK re-opens it, while the process's handlers still hold the old stream's leases.
One ``ztate`` service in this process on a database of its own, real gRPC, mTLS and
Postgres; the handlers wait on events the test sets."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator

import asyncpg
import pytest
import pytest_asyncio

from tests.harness import INITIAL, Pki, authors, client, new_thread_id
from tests.integration.test_watch_limits import eventually
from ztate.services.runtime.config import Settings
from ztate.transition_service.app import RunningService, start
from ztate.transition_service.work import WorkDispatcher, WorkStream
from ztate.worker_sdk import NodeRunner, View

PATCH = {"requested_action": {"action": "lookup", "order_id": "A-1"}}
LEASE_SECONDS = 1.0
STREAM_SECONDS = 2.0  # the SDK resumes a stream that lasted 1 s or more at once


@pytest_asyncio.fixture
async def service(settings: Settings, own_dsn: str) -> AsyncIterator[RunningService]:
    running = await start(
        settings.model_copy(
            update={
                "work_poll_seconds": 0.1,
                "work_lease_seconds": LEASE_SECONDS,
                "watch_max_stream_seconds": STREAM_SECONDS,
            }
        ),
        dsn=own_dsn,
    )
    yield running
    await running.stop(grace=1.0)


def streams_of(dispatcher: WorkDispatcher, node: str) -> list[WorkStream]:
    return list(dispatcher._streams.get(node, ()))


async def work_rows(dsn: str, thread_ids: list[str]) -> dict[str, asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT w.thread_id, w.epoch, w.holder, w.expires_at < now() AS lapsed, "
            "w.wake_version, w.handled_version, t.version AS head "
            "FROM ztate.node_work w JOIN ztate.threads t USING (thread_id) "
            "WHERE w.node = 'input-parser' AND w.thread_id = ANY($1)",
            thread_ids,
        )
    finally:
        await conn.close()
    return {r["thread_id"]: r for r in rows}


class Handlers:
    """A handler whose runs on the threads in ``blocking`` wait for ``gate``."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.started: dict[str, asyncio.Event] = {}
        self.gate = asyncio.Event()
        self.blocking: set[str] = set()

    def began(self, thread_id: str) -> asyncio.Event:
        return self.started.setdefault(thread_id, asyncio.Event())

    async def __call__(self, view: View) -> dict[str, object]:
        self.calls[view.thread_id] += 1
        self.began(view.thread_id).set()
        if view.thread_id in self.blocking:
            await self.gate.wait()
        return PATCH


async def test_a_full_runner_reads_nothing_and_a_reopened_stream_takes_only_its_free_slot(
    service: RunningService, own_dsn: str, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """concurrency=1, its one handler running longer than the stream lives. Before,
    the runner read the next item while its slot was taken: the re-opened stream was
    granted the second thread, whose lease lapsed unrenewed in the runner's hands, and
    the handler then ran on it and was fenced off (LEASE_LOST, the work done twice).
    Now the runner reads only with a free slot, so nothing is granted to it while it is
    full: the second thread is granted once, when the first is done, and committed."""
    caplog.set_level(logging.INFO, logger="ztate.worker_sdk.runner")
    dispatcher = service.work and service.work.dispatcher
    assert dispatcher is not None
    target = f"localhost:{service.port}"
    t1, t2 = new_thread_id(), new_thread_id()
    handlers = Handlers()
    handlers.blocking = {t1}
    async with (
        client(target, pki.operator()) as operator,
        client(target, pki.node("input-parser")) as parser,
    ):
        runner = NodeRunner.for_node(parser, handlers, node_name="input-parser", concurrency=1)
        stop = asyncio.Event()
        serving = asyncio.create_task(runner.serve(stop))
        try:
            await operator.create_thread(t1, INITIAL, policy="pipeline")
            await asyncio.wait_for(handlers.began(t1).wait(), 15)
            (first,) = streams_of(dispatcher, "input-parser")
            await operator.create_thread(t2, INITIAL, policy="pipeline")

            async def first_stream_ended() -> bool:
                return first.closed

            await eventually(first_stream_ended, within=STREAM_SECONDS + 10)
            # a window of three lease periods in which a grant to the full runner (and
            # its lapse) would show; nothing is waited for in it
            await asyncio.sleep(3 * LEASE_SECONDS)
            granted_meanwhile = (await work_rows(own_dsn, [t2]))[t2]["epoch"]
            handlers.gate.set()

            async def both_committed() -> bool:
                rows = await work_rows(own_dsn, [t1, t2])
                return all(r["head"] == 1 for r in rows.values())

            await eventually(both_committed, within=20)
        finally:
            stop.set()
            steps = await asyncio.wait_for(serving, 30)
    assert granted_meanwhile == 0  # the full runner was granted nothing
    rows = await work_rows(own_dsn, [t1, t2])
    assert {t: (r["epoch"], r["holder"], r["handled_version"]) for t, r in rows.items()} == {
        t1: (1, None, 0),
        t2: (1, None, 0),  # granted once, handled once
    }
    assert handlers.calls == {t1: 1, t2: 1}
    assert sorted((s.thread_id, s.status) for s in steps) == sorted(
        [(t1, "committed"), (t2, "committed")]
    )
    assert await authors(own_dsn, [t1, t2]) == {
        (t1, 1): "input-parser",
        (t2, 1): "input-parser",
    }
    assert not [r for r in caplog.records if "lease lost" in r.getMessage()]


async def test_an_item_whose_lease_lapsed_on_the_way_is_dropped_not_run(
    service: RunningService, own_dsn: str, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """concurrency=2, one handler running when the stream is re-opened: the new stream
    knows nothing of the old one's lease and is granted two threads while the runner
    can start one. The other waits unread (in the transport) until its lease lapsed.
    Before, the runner then ran the handler on it, and the proposal was fenced off
    (LEASE_LOST, the work done twice). Now the runner sees the lease is old, renews it
    first, is told it is lost, drops it, and runs the handler once, on a later grant."""
    caplog.set_level(logging.INFO, logger="ztate.worker_sdk.runner")
    dispatcher = service.work and service.work.dispatcher
    assert dispatcher is not None
    target = f"localhost:{service.port}"
    t1, t2, t3 = new_thread_id(), new_thread_id(), new_thread_id()
    handlers = Handlers()
    handlers.blocking = {t1}
    second_started = asyncio.Event()

    async def handler(view: View) -> dict[str, object]:
        if view.thread_id in (t2, t3) and not second_started.is_set():
            second_started.set()  # the first of the two to start holds the last slot
            handlers.blocking.add(view.thread_id)
        return await handlers(view)

    async with (
        client(target, pki.operator()) as operator,
        client(target, pki.node("input-parser")) as parser,
    ):
        runner = NodeRunner.for_node(parser, handler, node_name="input-parser", concurrency=2)
        stop = asyncio.Event()
        serving = asyncio.create_task(runner.serve(stop))
        try:
            await operator.create_thread(t1, INITIAL, policy="pipeline")
            await asyncio.wait_for(handlers.began(t1).wait(), 15)
            (first,) = streams_of(dispatcher, "input-parser")

            async def reopened() -> bool:
                return first.closed and any(
                    s is not first for s in streams_of(dispatcher, "input-parser")
                )

            # the runner had a free slot, so it re-opened the stream at once
            await eventually(reopened, within=STREAM_SECONDS + 10)
            await asyncio.gather(
                operator.create_thread(t2, INITIAL, policy="pipeline"),
                operator.create_thread(t3, INITIAL, policy="pipeline"),
            )
            await asyncio.wait_for(second_started.wait(), 15)
            (late,) = {t2, t3} - handlers.blocking

            async def late_lease_lapsed() -> bool:
                row = (await work_rows(own_dsn, [late])).get(late)
                return row is not None and row["epoch"] >= 1 and bool(row["lapsed"])

            await eventually(late_lease_lapsed, within=15)
            handlers.gate.set()

            async def all_committed() -> bool:
                rows = await work_rows(own_dsn, [t1, t2, t3])
                return len(rows) == 3 and all(r["head"] == 1 for r in rows.values())

            await eventually(all_committed, within=30)
        finally:
            stop.set()
            steps = await asyncio.wait_for(serving, 30)
    assert handlers.calls == {t1: 1, t2: 1, t3: 1}  # no handler ran on the lapsed lease
    assert sorted((s.thread_id, s.status) for s in steps) == sorted(
        [(t1, "committed"), (t2, "committed"), (t3, "committed")]
    )
    assert await authors(own_dsn, [t1, t2, t3]) == {(t, 1): "input-parser" for t in (t1, t2, t3)}
    said = [r.getMessage() for r in caplog.records if r.name == "ztate.worker_sdk.runner"]
    assert not [m for m in said if "lease lost" in m]
    assert (
        "input-parser: a lease lapsed before its handler could start; it is handed out again"
        in said
    )
