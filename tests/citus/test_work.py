"""Work subscriptions on Citus: wakes are decided and recorded on the thread's shard,
leases are granted, fenced and released by compare-and-swap there, and a node's
process receives its work (docs/work.md)."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from tests.harness import INITIAL, Pki, act, client, new_thread_id
from ztate.services.store import work as work_sql
from ztate.worker_sdk import LeaseLost, WorkItem

WITHIN_SECONDS = 20.0


async def test_a_node_receives_its_work_under_a_lease_on_citus(
    citus_target: str, citus_dsn: str, pki: Pki
) -> None:
    thread_id = new_thread_id()
    async with client(citus_target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(citus_target, pki.node("input-parser")) as parser:
        stream = parser.subscribe_work(max_in_flight=64)
        async with asyncio.timeout(WITHIN_SECONDS):
            while True:
                item: WorkItem = await anext(stream)
                if item.thread_id == thread_id:
                    break
        assert item.version == 0
        assert set(item.state) == {"raw_text"}
        await parser.renew_lease(thread_id, item.lease_epoch)
        patch = {"requested_action": act("citus")}
        with pytest.raises(LeaseLost):  # another epoch: fenced off, nothing committed
            await parser.propose(thread_id, 0, patch, lease_epoch=item.lease_epoch + 1)
        committed = await parser.propose(thread_id, 0, patch, lease_epoch=item.lease_epoch)
        assert committed.version == 1
        await stream.aclose()
    conn = await asyncpg.connect(citus_dsn)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WITHIN_SECONDS
        while True:  # the planner is woken by the parser's commit
            rows = await conn.fetch(
                "SELECT node, wake_version, handled_version, holder FROM ztate.node_work "
                "WHERE thread_id = $1 ORDER BY node",
                thread_id,
            )
            if any(r["node"] == "planner" for r in rows):
                break
            assert loop.time() < deadline, rows
            await asyncio.sleep(0.1)  # polling for the wake, with a deadline
    finally:
        await conn.close()
    by_node = {r["node"]: r for r in rows}
    assert by_node["input-parser"]["handled_version"] == 0
    assert by_node["input-parser"]["holder"] is None
    assert by_node["planner"]["wake_version"] == 1


async def test_a_backlog_is_dispatched_and_slots_checked_on_citus(
    citus_target: str, citus_dsn: str, pki: Pki
) -> None:
    """The dispatch queries on distributed tables: a node's waiting work in grant order
    (WAITING), and the check of a stream's slots (HELD), which runs every poll while the
    node has a backlog. A stream of one slot is granted one of two threads; the held
    lease is found by HELD and not by WAITING; once released, the other thread comes."""
    first, second = new_thread_id(), new_thread_id()
    async with client(citus_target, pki.operator()) as operator:
        for thread_id in (first, second):
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(citus_target, pki.node("input-parser")) as parser:
        stream = parser.subscribe_work(max_in_flight=1)
        try:
            async with asyncio.timeout(WITHIN_SECONDS):
                item: WorkItem = await anext(stream)
                while item.thread_id not in (first, second):  # another test's work
                    await parser.release_lease(item.thread_id, item.lease_epoch, -1)
                    item = await anext(stream)
            other = second if item.thread_id == first else first
            conn = await asyncpg.connect(citus_dsn)
            try:
                holder = await conn.fetchval(
                    "SELECT holder FROM ztate.node_work WHERE thread_id = $1 AND node = $2",
                    item.thread_id,
                    "input-parser",
                )
                held = await conn.fetch(
                    work_sql.HELD, [item.thread_id, other], ["input-parser"], [holder]
                )
                waiting = await conn.fetch(work_sql.WAITING, "input-parser", 10_000)
            finally:
                await conn.close()
            assert [(r["thread_id"], r["epoch"]) for r in held] == [
                (item.thread_id, item.lease_epoch)
            ]
            assert 0 < held[0]["seconds_left"] <= 30
            found = {r["thread_id"] for r in waiting}
            assert other in found
            assert item.thread_id not in found
            await parser.release_lease(item.thread_id, item.lease_epoch, item.version)
            async with asyncio.timeout(WITHIN_SECONDS):
                following: WorkItem = await anext(stream)
                while following.thread_id != other:
                    await parser.release_lease(following.thread_id, following.lease_epoch, -1)
                    following = await anext(stream)
            await parser.release_lease(other, following.lease_epoch, following.version)
        finally:
            await stream.aclose()
