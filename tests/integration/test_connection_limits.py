"""No one blocks the door: connections that never start TLS cannot lock workers out.

The service runs as its own process with only 96 open files (soft and hard, so it
cannot raise them). 300 plain TCP connections that never send a byte are opened and
held; without a short handshake timeout the server keeps each one for gRPC's default
120 s, runs out of files, and accepts no one. With ZTATE_HANDSHAKE_TIMEOUT_SECONDS it
closes them, and a legitimate worker connects and proposes while they are held.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from tests.faults import ServedProcess
from tests.harness import INITIAL, Pki, act, client, fresh_database, new_thread_id

IDLE_CONNECTIONS = 300
OPEN_FILES = 96


@pytest_asyncio.fixture
async def starved(
    postgres_server_dsn: str, pki: Pki, policy_dir: Path, keyring_file: Path, tmp_path: Path
) -> AsyncIterator[ServedProcess]:
    service = ServedProcess(
        home=tmp_path / "home",
        dsn=await fresh_database(postgres_server_dsn),
        pki=pki,
        policy=policy_dir,
        keyring=keyring_file,
        open_files=OPEN_FILES,
        handshake_timeout_seconds="1",
        db_pool_size="2",
    )
    try:
        await service.start()
        yield service
    finally:
        await service.ensure_stopped()


async def test_idle_connections_that_never_start_tls_block_no_worker(
    starved: ServedProcess, pki: Pki
) -> None:
    thread_id = new_thread_id()
    async with client(starved.target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    held: list[socket.socket] = []
    try:
        for _ in range(IDLE_CONNECTIONS):  # connect, then say nothing, ever
            held.append(socket.create_connection(("127.0.0.1", starved.port), timeout=5))
        started = time.monotonic()
        async with client(starved.target, pki.node("input-parser"), timeout=30) as worker:
            committed = await worker.propose(thread_id, 0, {"requested_action": act("in")})
        waited = time.monotonic() - started
        assert committed.version == 1
        # far below gRPC's default 120 s handshake timeout: the idle ones were closed
        assert waited < 20, waited
        # ... while the attacker still holds its sockets (the server closed its side)
        assert all(s.fileno() != -1 for s in held)
    finally:
        for s in held:
            s.close()
