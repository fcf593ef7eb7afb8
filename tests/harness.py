"""Shared test machinery: a real Postgres, a real PKI and a real mTLS service.

The PKI, the ledger assertions and approvals live in ``ztate.testing`` (the testing
kit worker authors use too) and are re-exported here.

Nothing here is mocked. Postgres is the embedded server ztate itself uses (or
``ZTATE_TEST_DATABASE_URL`` when set); certificates come from ztate's own CA code;
the service listens on a loopback port with mutual TLS.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
from aiohttp import ClientSession, web

from ztate.services.console.app import ConsoleRunner, guard_of, make_app
from ztate.services.console.backend import Backend
from ztate.testing import TRUST_DOMAIN, Credentials, Ledger, LedgerSnapshot, Pki
from ztate.testing._approval import deliver_approval
from ztate.testing._ledger import fresh_database, with_database
from ztate.testing._pki import secure_channel
from ztate.worker_sdk import AwaitingApproval, ZtateClient

__all__ = [
    "INITIAL",
    "NODES",
    "TRUST_DOMAIN",
    "USER",
    "ConsoleClient",
    "Credentials",
    "Ledger",
    "LedgerSnapshot",
    "Pki",
    "act",
    "as_operator_sees_it",
    "authors",
    "client",
    "deliver_approval",
    "fresh_database",
    "new_thread_id",
    "secure_channel",
    "serving_console",
    "with_database",
]

NODES = ("input-parser", "planner", "approval-gate", "db-writer")
USER = "123e4567-e89b-42d3-a456-426614174000"
# A valid initial state of the default pipeline policy (services/defaults/policy.yaml).
INITIAL = {
    "raw_text": "please refund order A-42",
    "authority": {"tenant": "acme"},
    "target_user_id": USER,
}


def act(tag: str, action: str = "refund") -> dict[str, str]:
    """A requested_action the input parser may write, distinguishable by ``tag``."""
    return {"action": action, "order_id": re.sub(r"[^A-Z0-9-]", "-", tag.upper())[:32]}


def client(target: str, creds: Credentials, *, timeout: float = 10.0) -> ZtateClient:
    return ZtateClient.from_files(
        target, cert=creds.cert, key=creds.key, ca=creds.ca, timeout=timeout
    )


def new_thread_id() -> str:
    return f"t-{uuid.uuid4().hex[:16]}"


async def as_operator_sees_it(dsn: str, parked: AwaitingApproval) -> AwaitingApproval:
    """A parked proposal with the digest and risk rules an operator or reviewer sees.

    A node not marked ``read_records`` gets neither (docs/api.md, "What a node
    receives"); tests that go on to review or decide the proposal read them from the
    database, as the approval service would receive them.
    """
    thread_id, key = parked.handle.split("/", 1)
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT digest, risk_rules FROM ztate.pending_transitions "
            "WHERE thread_id = $1 AND idempotency_key = $2",
            thread_id,
            key,
        )
    finally:
        await conn.close()
    assert row is not None, f"no parked proposal {parked.handle!r}"
    return AwaitingApproval(
        row["digest"], thread_id, parked.base_version, tuple(row["risk_rules"]), parked.handle
    )


async def run_example_worker(
    node: str, script: Path, target: str, creds: Credentials, thread_id: str
) -> list[dict[str, Any]]:
    """Run a JavaScript example worker (``node script``) once against ``target``: it
    views the thread, proposes one patch and tries a forbidden one, printing a JSON
    line per step. Its lines, once it exited 0."""
    process = await asyncio.create_subprocess_exec(
        node,
        str(script),
        "--target",
        target,
        "--cert",
        str(creds.cert),
        "--key",
        str(creds.key),
        "--ca",
        str(creds.ca),
        "--thread",
        thread_id,
        "--patch",
        '{"requested_action": {"action": "lookup", "order_id": "A-42"}}',
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode()
    return [json.loads(line) for line in stdout.decode().splitlines()]


class LoopbackResolver:
    """Every ``*.localhost`` name to 127.0.0.1, as browsers resolve them (the console
    answers under a random one, docs/console.md); any other name as aiohttp would."""

    def __init__(self) -> None:
        from aiohttp.resolver import DefaultResolver

        self._default = DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: int = 0) -> list[dict[str, Any]]:
        import socket

        if host == "localhost" or host.endswith(".localhost"):
            return [
                {
                    "hostname": host,
                    "host": "127.0.0.1",
                    "port": port,
                    "family": socket.AF_INET,
                    "proto": 0,
                    "flags": socket.AI_NUMERICHOST,
                }
            ]
        found: list[dict[str, Any]] = await self._default.resolve(host, port, family)
        return found

    async def close(self) -> None:
        await self._default.close()


async def authors(dsn: str, thread_ids: list[str]) -> dict[tuple[str, int], str]:
    """Who made each version after the genesis of ``thread_ids``: (thread, version) ->
    the node's name (a version has one record: one author)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT thread_id, version, node_id FROM ztate.transitions "
            "WHERE thread_id = ANY($1) AND version > 0",
            thread_ids,
        )
    finally:
        await conn.close()
    return {(r["thread_id"], r["version"]): r["node_id"].rsplit("/", 1)[1] for r in rows}


def console_session() -> Any:
    """An aiohttp client session as a browser reaches the console: cookies kept for a
    bare host name, ``*.localhost`` on this machine."""
    from aiohttp import ClientSession, CookieJar, TCPConnector

    return ClientSession(
        cookie_jar=CookieJar(unsafe=True),
        connector=TCPConnector(resolver=LoopbackResolver()),  # type: ignore[arg-type]
    )


class ConsoleClient:
    """A console served in this process (``serving_console``) and a session of a browser's."""

    def __init__(self, backend: Any, app: web.Application, session: ClientSession) -> None:
        self.backend, self.app, self.session = backend, app, session
        self.guard = guard_of(app)

    @property
    def base(self) -> str:
        return self.guard.origin

    async def sign_in(self) -> str:
        """Exchange the token; the Set-Cookie header it answered with."""
        assert self.guard.token is not None
        async with self.session.get(
            f"{self.base}/?token={self.guard.token}", allow_redirects=False
        ) as got:
            assert (got.status, got.headers["Location"]) == (303, "/reviews")
            return got.headers["Set-Cookie"]

    async def post(self, path: str, form: dict[str, str], **headers: str) -> tuple[int, str]:
        async with self.session.post(
            f"{self.base}{path}", data=form, headers=headers, allow_redirects=False
        ) as got:
            return got.status, await got.text()


@asynccontextmanager
async def serving_console(backend: Backend) -> AsyncIterator[ConsoleClient]:
    """The console of ``backend`` on a loopback port, and a client session for it."""
    app = make_app(backend, 0)
    runner = ConsoleRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert site._server is not None
    guard_of(app).port = site._server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    try:
        async with console_session() as session:
            yield ConsoleClient(backend, app, session)
    finally:
        await runner.cleanup()
