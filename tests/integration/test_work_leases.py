"""Leases at their edges (a review of work dispatch): a lapsed lease is lost before
anyone takes it again, a release never marks versions handled that have not woken the
node, and a stream that stops reading is granted nothing more. One ``ztate`` service in
this process on a database of its own, real gRPC, mTLS and Postgres."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from tests.harness import INITIAL, Pki, client, new_thread_id, secure_channel
from tests.integration.test_watch_limits import eventually
from ztate.services.runtime.config import Settings
from ztate.transition_service.app import RunningService, start
from ztate.v1 import transition_pb2, transition_pb2_grpc
from ztate.worker_sdk import LeaseLost

REPO = Path(__file__).resolve().parents[2]
PATCH = {"requested_action": {"action": "lookup", "order_id": "A-1"}}
LEASE_SECONDS = 0.5


@pytest_asyncio.fixture
async def service(settings: Settings, own_dsn: str) -> AsyncIterator[RunningService]:
    running = await start(
        settings.model_copy(
            update={"work_poll_seconds": 0.05, "work_lease_seconds": LEASE_SECONDS}
        ),
        dsn=own_dsn,
    )
    yield running
    await running.stop(grace=1.0)


async def work_row(dsn: str, thread_id: str, node: str) -> asyncpg.Record:
    conn = await asyncpg.connect(dsn)
    try:
        row: asyncpg.Record = await conn.fetchrow(
            "SELECT epoch, holder, wake_version, handled_version FROM ztate.node_work "
            "WHERE thread_id = $1 AND node = $2",
            thread_id,
            node,
        )
        return row
    finally:
        await conn.close()


async def test_a_lapsed_lease_no_one_took_again_is_lost(
    service: RunningService, own_dsn: str, pki: Pki
) -> None:
    """The grant's lease lapses (its expiry moved into the past, as the database's clock
    would) and no process takes the row again. Before, the grant still renewed (live
    again, beyond its stream's max_in_flight), committed and released. Now each is
    refused LEASE_LOST, and nothing is committed."""
    target = f"localhost:{service.port}"
    thread_id = new_thread_id()
    async with (
        client(target, pki.operator()) as operator,
        client(target, pki.node("input-parser")) as parser,
    ):
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        stream = parser.subscribe_work(max_in_flight=1)
        item = await anext(stream)
        await stream.aclose()  # its leases stay (until released or lapsed); no new grant
        assert item.thread_id == thread_id
        admin = await asyncpg.connect(own_dsn)
        try:
            await admin.execute(
                "UPDATE ztate.node_work SET expires_at = now() - interval '1 second' "
                "WHERE thread_id = $1 AND node = 'input-parser'",
                thread_id,
            )
        finally:
            await admin.close()

        for call in (
            parser.renew_lease(thread_id, item.lease_epoch),
            parser.propose(thread_id, item.version, PATCH, lease_epoch=item.lease_epoch),
            parser.release_lease(thread_id, item.lease_epoch, item.version),
        ):
            with pytest.raises(LeaseLost) as refused:
                await call
            assert refused.value.reason == "LEASE_LOST"

    row = await work_row(own_dsn, thread_id, "input-parser")
    assert (row["epoch"], row["holder"] is not None, row["handled_version"]) == (
        item.lease_epoch,
        True,
        -1,
    )
    conn = await asyncpg.connect(own_dsn)
    try:
        assert (
            await conn.fetchval("SELECT version FROM ztate.threads WHERE thread_id = $1", thread_id)
            == 0
        )
    finally:
        await conn.close()


async def test_a_release_marks_no_version_handled_beyond_the_one_that_woke_the_node(
    service: RunningService, own_dsn: str, pki: Pki
) -> None:
    """A release claiming 2^63 - 1 handled used to switch the node's work on the thread
    off for good: no later version ever counted as new. It now counts up to the version
    that woke the node, and the next wake is offered."""
    target = f"localhost:{service.port}"
    thread_id = new_thread_id()
    async with (
        client(target, pki.operator()) as operator,
        client(target, pki.node("input-parser")) as parser,
        client(target, pki.node("planner")) as planner,
    ):
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        await parser.propose(thread_id, 0, PATCH)  # version 1 wakes the planner
        stream = planner.subscribe_work(max_in_flight=1)
        try:
            first = await anext(stream)
            assert (first.thread_id, first.version) == (thread_id, 1)
            await planner.release_lease(thread_id, first.lease_epoch, 2**63 - 1)
            row = await work_row(own_dsn, thread_id, "planner")
            assert (row["wake_version"], row["handled_version"]) == (1, 1)

            refund = {"requested_action": {"action": "refund", "order_id": "B-2"}}
            await parser.propose(thread_id, 1, refund)  # version 2 wakes it again
            second = await anext(stream)
            assert (second.thread_id, second.version) == (thread_id, 2)
        finally:
            await stream.aclose()


async def test_a_stream_that_stops_reading_is_granted_nothing_more(
    service: RunningService, own_dsn: str, pki: Pki
) -> None:
    """A worker opens SubscribeWork(max_in_flight=256) and never reads (64 threads of
    8 KB). Before, each lapse of its leases freed their slots and the same threads were
    granted to it again every lease period, another copy of each head queued each time,
    without end (441 items in 8 s in the review). Now a stream with items waiting is
    granted nothing: once the transport takes no more, the grants stop, and another
    process of the node gets the threads."""
    target = f"localhost:{service.port}"
    big = dict(INITIAL, raw_text="x" * 7900)
    threads = [new_thread_id() for _ in range(64)]
    async with client(target, pki.operator()) as operator:
        for thread_id in threads:
            await operator.create_thread(thread_id, big, policy="pipeline")
    dispatcher = service.work and service.work.dispatcher
    assert dispatcher is not None
    channel = secure_channel(target, pki.node("input-parser"))
    stalled = transition_pb2_grpc.TransitionServiceStub(channel).SubscribeWork(
        transition_pb2.SubscribeWorkRequest(max_in_flight=256)
    )
    admin = await asyncpg.connect(own_dsn)
    try:

        async def granted_and_lapsed_twice_over() -> bool:
            # every thread granted, and every lease lapsed for more than two lease
            # periods: a grant again would have renewed an expiry
            return bool(
                await admin.fetchval(
                    "SELECT count(*) = 64 AND bool_and(expires_at < now() - $1::interval) "
                    "FROM ztate.node_work WHERE node = 'input-parser' AND thread_id = ANY($2)",
                    timedelta(seconds=2 * LEASE_SECONDS),
                    threads,
                )
            )

        await eventually(granted_and_lapsed_twice_over, within=15)
        # Until the transport's buffers filled, what was written counted as taken and
        # was granted again as its leases lapsed; since then nothing was (no expiry in
        # two lease periods), and the items waiting are at most one round's
        (stream,) = dispatcher._streams["input-parser"]
        assert 0 < stream.items.qsize() <= 64

        taken: set[str] = set()
        async with client(target, pki.node("input-parser")) as other:
            taking = other.subscribe_work(max_in_flight=64)
            try:
                async with asyncio.timeout(30):
                    while len(taken) < 64:
                        taken.add((await anext(taking)).thread_id)
            finally:
                await taking.aclose()
        assert taken == set(threads)
    finally:
        await admin.close()
        stalled.cancel()
        with contextlib.suppress(Exception):
            await channel.close()


async def test_rows_on_threads_of_another_policy_are_retired_and_starve_no_one(
    settings: Settings, own_dsn: str, pki: Pki, tmp_path: Path
) -> None:
    """40 threads wait for input-parser under policy ``pipeline``; the operator renames
    the policy to ``pipeline-v2`` and a thread is created under the new name. Before,
    every dispatch round found the 40 old rows first, granted them, saw the thread was
    of another policy and gave them back undone, for ever: the new thread was never
    delivered (a node with max_in_flight=4, in the review 552 grants in 15 s). Now each
    is granted once, found out before anything is sent, and retired: the new thread
    comes, and none of the old ones is left waiting or was ever sent."""
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    text = (REPO / "services" / "defaults" / "policy.yaml").read_text()
    assert "name: pipeline\n" in text
    (old / "pipeline.yaml").write_text(text)
    (new / "pipeline.yaml").write_text(text.replace("name: pipeline\n", "name: pipeline-v2\n", 1))
    base = settings.model_copy(update={"work_poll_seconds": 0.05, "work_lease_seconds": 5.0})
    before = [new_thread_id() for _ in range(40)]
    first = await start(base.model_copy(update={"policy_path": old}), dsn=own_dsn)
    try:
        async with client(f"localhost:{first.port}", pki.operator()) as operator:
            for thread_id in before:
                await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    finally:
        await first.stop(grace=1.0)

    second = await start(base.model_copy(update={"policy_path": new}), dsn=own_dsn)
    try:
        target = f"localhost:{second.port}"
        fresh = new_thread_id()
        async with (
            client(target, pki.operator()) as operator,
            client(target, pki.node("input-parser")) as parser,
        ):
            stream = parser.subscribe_work(max_in_flight=4)
            try:
                await operator.create_thread(fresh, INITIAL, policy="pipeline-v2")
                item = await asyncio.wait_for(anext(stream), 10)
                assert (item.thread_id, item.version) == (fresh, 0)
                await parser.propose(fresh, 0, PATCH, lease_epoch=item.lease_epoch)
            finally:
                await stream.aclose()
    finally:
        await second.stop(grace=1.0)
    admin = await asyncpg.connect(own_dsn)
    try:
        rows = await admin.fetch(
            "SELECT w.epoch, w.holder, w.handled_version, t.version FROM ztate.node_work w "
            "JOIN ztate.threads t USING (thread_id) "
            "WHERE w.node = 'input-parser' AND w.thread_id = ANY($1)",
            before,
        )
        fresh_row = await work_row(own_dsn, fresh, "input-parser")
    finally:
        await admin.close()
    # the old rows: retired, none held, nothing committed on their threads; each granted
    # at most once (0: the fresh thread came before its turn), never sent (the stream's
    # only item was the fresh thread)
    assert len(rows) == 40
    assert {(r["holder"], r["version"]) for r in rows} == {(None, 0)}
    assert {r["epoch"] for r in rows} <= {0, 1}
    retired = [r for r in rows if r["epoch"] == 1]
    assert {r["handled_version"] for r in retired} <= {0}
    assert (fresh_row["epoch"], fresh_row["holder"], fresh_row["handled_version"]) == (1, None, 0)


async def test_a_lapsed_lease_is_granted_before_work_never_held(
    service: RunningService, own_dsn: str, pki: Pki
) -> None:
    """A worker took a thread and died (its lease lapsed) while five newer threads
    waited. Before, rows never held came first (expires_at NULLS FIRST): under a
    backlog the dead worker's thread waited until the whole backlog had drained. Now a
    lapsed lease is granted first."""
    target = f"localhost:{service.port}"
    crashed = new_thread_id()
    backlog = [new_thread_id() for _ in range(5)]
    async with (
        client(target, pki.operator()) as operator,
        client(target, pki.node("input-parser")) as parser,
    ):
        await operator.create_thread(crashed, INITIAL, policy="pipeline")
        dead = parser.subscribe_work(max_in_flight=1)
        taken = await anext(dead)
        await dead.aclose()  # the worker is gone; its lease stays until it lapses
        assert taken.thread_id == crashed
        for thread_id in backlog:
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        admin = await asyncpg.connect(own_dsn)
        try:
            await admin.execute(
                "UPDATE ztate.node_work SET expires_at = now() - interval '1 second' "
                "WHERE thread_id = $1 AND node = 'input-parser'",
                crashed,
            )
        finally:
            await admin.close()
        stream = parser.subscribe_work(max_in_flight=1)
        try:
            item = await asyncio.wait_for(anext(stream), 10)
        finally:
            await stream.aclose()
    assert (item.thread_id, item.lease_epoch) == (crashed, taken.lease_epoch + 1)
    for thread_id in backlog:  # none of the backlog was granted
        row = await work_row(own_dsn, thread_id, "input-parser")
        assert (row["epoch"], row["holder"]) == (0, None)


async def test_a_freed_slot_hands_out_the_backlog_at_once_not_at_the_next_poll(
    settings: Settings, own_dsn: str, pki: Pki
) -> None:
    """Six threads wait for a node whose stream takes one at a time, the poll period
    4 s. Before, a slot freed by a commit under the lease (or by ReleaseLease) started
    no round unless that same thread had more work: each next thread came at the next
    poll (about 2 s apart at a 2 s poll in the review, max_in_flight threads per poll
    period). Now the freed slot asks for a round at once while the node may have a
    backlog."""
    running = await start(
        settings.model_copy(update={"work_poll_seconds": 4.0, "work_lease_seconds": 30.0}),
        dsn=own_dsn,
    )
    try:
        target = f"localhost:{running.port}"
        threads = [new_thread_id() for _ in range(6)]
        loop = asyncio.get_running_loop()
        async with (
            client(target, pki.operator()) as operator,
            client(target, pki.node("input-parser")) as parser,
        ):
            for thread_id in threads:
                await operator.create_thread(thread_id, INITIAL, policy="pipeline")
            stream = parser.subscribe_work(max_in_flight=1)
            gaps: list[float] = []
            seen: list[str] = []
            try:
                item = await asyncio.wait_for(anext(stream), 10)
                for n in range(6):
                    seen.append(item.thread_id)
                    if n % 2 == 0:  # done: a commit under the lease releases it
                        await parser.propose(
                            item.thread_id, item.version, PATCH, lease_epoch=item.lease_epoch
                        )
                    else:  # nothing to do: released, handled
                        await parser.release_lease(item.thread_id, item.lease_epoch, item.version)
                    if n == 5:
                        break
                    freed = loop.time()
                    item = await asyncio.wait_for(anext(stream), 10)
                    gaps.append(loop.time() - freed)
            finally:
                await stream.aclose()
    finally:
        await running.stop(grace=1.0)
    assert sorted(seen) == sorted(threads)  # each once
    assert max(gaps) < 2.0, gaps  # well under the 4 s poll period
    admin = await asyncpg.connect(own_dsn)
    try:
        rows = await admin.fetch(
            "SELECT w.thread_id, w.epoch, w.holder, w.handled_version, t.version "
            "FROM ztate.node_work w JOIN ztate.threads t USING (thread_id) "
            "WHERE w.node = 'input-parser' AND w.thread_id = ANY($1)",
            threads,
        )
    finally:
        await admin.close()
    committed = {t for n, t in enumerate(seen) if n % 2 == 0}
    assert {
        r["thread_id"]: (r["epoch"], r["holder"], r["handled_version"], r["version"]) for r in rows
    } == {t: (1, None, 0, 1 if t in committed else 0) for t in threads}


@pytest_asyncio.fixture
async def pair(settings: Settings, own_dsn: str) -> AsyncIterator[list[RunningService]]:
    """Two replicas on one database (lease 3 s, poll 0.1 s)."""
    both = settings.model_copy(update={"work_poll_seconds": 0.1, "work_lease_seconds": 3.0})
    first = await start(both, dsn=own_dsn)
    second = await start(both, dsn=own_dsn)
    yield [first, second]
    await second.stop(grace=1.0)
    await first.stop(grace=1.0)


async def test_slots_follow_renewals_and_releases_answered_by_another_replica(
    pair: list[RunningService], own_dsn: str, pki: Pki
) -> None:
    """A stream on replica A (max_in_flight=1) holds a lease that its worker renews,
    then commits under, through replica B (round-robin balancing). Before, A forgot
    the lease at its local expiry although B had renewed it, and granted the stream a
    second thread (two live leases, max_in_flight 1); and after B's commit A kept the
    slot until that local expiry (2.5 s of a 3 s lease in the review). Now A checks
    its slots against the database: nothing more is granted while the lease is renewed
    elsewhere, and the freed slot is granted again within a poll or so."""
    a, b = pair
    dispatcher = a.work and a.work.dispatcher
    assert dispatcher is not None
    loop = asyncio.get_running_loop()
    t1, t2 = new_thread_id(), new_thread_id()
    async with (
        client(f"localhost:{a.port}", pki.operator()) as operator,
        client(f"localhost:{a.port}", pki.node("input-parser")) as on_a,
        client(f"localhost:{b.port}", pki.node("input-parser")) as on_b,
    ):
        stream = on_a.subscribe_work(max_in_flight=1)
        try:
            await operator.create_thread(t1, INITIAL, policy="pipeline")
            first = await asyncio.wait_for(anext(stream), 10)
            assert first.thread_id == t1
            (served,) = dispatcher._streams["input-parser"]
            local_expiry = served.held[(t1, first.lease_epoch)]
            await operator.create_thread(t2, INITIAL, policy="pipeline")
            checks = dispatcher.checks

            async def a_lease_period_past_the_local_expiry() -> bool:
                # the worker renews through B meanwhile, as its handler runs
                await on_b.renew_lease(t1, first.lease_epoch)
                return loop.time() > local_expiry + 1.0

            await eventually(a_lease_period_past_the_local_expiry, within=15)
            assert dispatcher.checks > checks  # A looked its slot up in the database
            assert served.held.keys() == {(t1, first.lease_epoch)}  # and kept it
            assert (await work_row(own_dsn, t2, "input-parser"))["epoch"] == 0  # not granted

            await on_b.propose(t1, first.version, PATCH, lease_epoch=first.lease_epoch)
            committed = loop.time()
            second = await asyncio.wait_for(anext(stream), 10)
            took = loop.time() - committed
        finally:
            await stream.aclose()
    assert second.thread_id == t2
    assert took < 1.5, took  # within a poll or so, not at the 3 s lease's local expiry
    row = await work_row(own_dsn, t1, "input-parser")
    assert (row["epoch"], row["holder"], row["handled_version"]) == (first.lease_epoch, None, 0)


async def test_a_slot_freed_by_a_commit_through_another_replica_is_granted_again_at_once(
    pair: list[RunningService], own_dsn: str, pki: Pki
) -> None:
    """The worker of a stream on replica A commits under its lease through replica B
    while another thread waits. Before, A kept the slot until the lease's local expiry
    (about 2.5 s of a 3 s lease in the review); now the next thread comes within a poll
    or so."""
    a, b = pair
    loop = asyncio.get_running_loop()
    t1, t2 = new_thread_id(), new_thread_id()
    async with (
        client(f"localhost:{a.port}", pki.operator()) as operator,
        client(f"localhost:{a.port}", pki.node("input-parser")) as on_a,
        client(f"localhost:{b.port}", pki.node("input-parser")) as on_b,
    ):
        stream = on_a.subscribe_work(max_in_flight=1)
        try:
            await operator.create_thread(t1, INITIAL, policy="pipeline")
            first = await asyncio.wait_for(anext(stream), 10)
            await operator.create_thread(t2, INITIAL, policy="pipeline")
            await on_b.propose(t1, first.version, PATCH, lease_epoch=first.lease_epoch)
            committed = loop.time()
            second = await asyncio.wait_for(anext(stream), 10)
            took = loop.time() - committed
        finally:
            await stream.aclose()
    assert (first.thread_id, second.thread_id) == (t1, t2)
    assert took < 1.5, took
