"""SIGTERM to a serving ``ztate serve`` in the middle of a load: the service says
NOT_SERVING first, finishes the commits it has taken, refuses new ones, and exits
0 within its grace period. Unlike a kill, nothing is left in doubt: a request is
in the ledger exactly when its proposer got the answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest_asyncio
from grpc_health.v1 import health_pb2

from tests.faults import (
    NOT_SERVING,
    SERVING,
    THREADS,
    Load,
    ServedProcess,
    assert_ledger_whole,
    create_threads,
)
from tests.harness import Pki, fresh_database
from ztate.transition_service.app import SHUTDOWN_GRACE_SECONDS


@pytest_asyncio.fixture
async def fresh_dsn(postgres_server_dsn: str) -> str:
    return await fresh_database(postgres_server_dsn)


@pytest_asyncio.fixture
async def served(
    fresh_dsn: str, pki: Pki, policy_dir: Path, keyring_file: Path, tmp_path: Path
) -> AsyncIterator[ServedProcess]:
    service = ServedProcess(
        home=tmp_path / "home", dsn=fresh_dsn, pki=pki, policy=policy_dir, keyring=keyring_file
    )
    try:
        await service.start()
        yield service
    finally:
        await service.ensure_stopped()


async def test_sigterm_finishes_in_flight_commits_and_exits_0(
    served: ServedProcess, fresh_dsn: str, pki: Pki
) -> None:
    threads = await create_threads(served.target, pki, THREADS)
    load = Load(served.target, pki, threads, retries=0)
    proposers = load.run(keep_retrying=False)
    await load.until_acked(20)
    process = served.process
    assert process is not None
    async with served.health() as health:
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await asyncio.wait_for(watch.read(), 5)).status == SERVING
        stopping = time.monotonic()
        process.terminate()  # SIGTERM; every proposer has a call in flight
        assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
        # ... and the Watch stream ends there: an open watch (a load balancer keeps
        # one) must not hold the server for its whole grace period
        assert await asyncio.wait_for(watch.read(), 5) is grpc.aio.EOF
        code = await served.exited(within=SHUTDOWN_GRACE_SECONDS + 5)
    assert code == 0
    assert time.monotonic() - stopping < SHUTDOWN_GRACE_SECONDS
    for proposer in proposers:
        await proposer  # each ends at its first refused call
    refused = load.unacked()
    assert len(refused) == THREADS
    # refused by the stopping server (or by its closing connection), never taken on
    # (the SDK names a server that went away UNREACHABLE, an Unavailable)
    assert {r.failure for r in refused} <= {"UNAVAILABLE", "UNREACHABLE", "CANCELLED"}

    by_key = await assert_ledger_whole(fresh_dsn, load)
    # nothing in doubt: committed exactly the requests that were acknowledged, so every
    # call the server had taken on when SIGTERM came was finished and answered (a call
    # cut off mid-commit would be committed and unacknowledged)
    assert set(by_key) == {r.key for r in load.acked()}
    assert served.logged("shutting down: finishing in-flight calls")
