"""Watches on Citus: commits are announced from the coordinator.

A ledger row lives on a worker, and a NOTIFY fired there never reaches the
``LISTEN`` connections, which are on the coordinator. The replica that commits
announces the commit on its own (coordinator) session instead (migration 0013).
Here the streams' periodic re-read is pushed far beyond the test's bound, so a
stream can only learn of a commit through that announcement.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import asyncpg
import pytest

from tests.harness import INITIAL, Pki, act, client, new_thread_id, secure_channel
from ztate.transition_service import watch as watch_module
from ztate.v1 import transition_pb2, transition_pb2_grpc
from ztate.worker_sdk import WatchEvent

ANNOUNCED_WITHIN_SECONDS = 10.0  # far below the re-read patched in, far above a NOTIFY


@pytest.fixture(autouse=True)
def no_periodic_reread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch_module, "RECHECK_SECONDS", 3600.0)


async def next_event(stream: AsyncGenerator[WatchEvent, None]) -> WatchEvent:
    return await asyncio.wait_for(anext(stream), ANNOUNCED_WITHIN_SECONDS)


async def test_a_commit_on_a_worker_is_announced_on_the_coordinator(
    citus_target: str, citus_dsn: str, pki: Pki
) -> None:
    thread_id = new_thread_id()
    async with client(citus_target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    conn = await asyncpg.connect(citus_dsn)  # a LISTEN on the coordinator, as a replica's
    announced: asyncio.Queue[str] = asyncio.Queue()
    await conn.add_listener("ztate_commits", lambda *args: announced.put_nowait(args[3]))
    try:
        async with client(citus_target, pki.node("input-parser")) as parser:
            stream = parser.watch(thread_id)
            assert (await next_event(stream)).version == 0  # open: the thread is registered
            await parser.propose(thread_id, 0, {"requested_action": act("heard")})
            assert await asyncio.wait_for(announced.get(), ANNOUNCED_WITHIN_SECONDS) == thread_id
            assert (await next_event(stream)).version == 1
            await stream.aclose()
    finally:
        await conn.close()


async def test_a_revert_wakes_the_stream_too(citus_target: str, pki: Pki) -> None:
    thread_id = new_thread_id()
    async with (
        client(citus_target, pki.operator()) as operator,
        client(citus_target, pki.node("input-parser")) as parser,
    ):
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        stream = parser.watch(thread_id)
        assert (await next_event(stream)).version == 0
        await parser.propose(thread_id, 0, {"requested_action": act("one")})
        assert (await next_event(stream)).version == 1
        async with secure_channel(citus_target, pki.operator()) as channel:
            await transition_pb2_grpc.TransitionServiceStub(channel).RevertThread(
                transition_pb2.RevertThreadRequest(
                    thread_id=thread_id, to_version=0, idempotency_key="watch-revert"
                ),
                timeout=10,
            )
        assert (await next_event(stream)).version == 2
        await stream.aclose()
