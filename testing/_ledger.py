"""Direct, superuser access to a test database's ledger tables, for assertions only
(what a refused call must leave untouched, the rejections it must leave)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from ztate.contract.keyring import Keyring
from ztate.contract.record import GENESIS_PARENT, verify_record


def with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, parts.fragment))


async def fresh_database(server_dsn: str) -> str:
    """A new, empty database on the test session's Postgres server."""
    name = f"ztate_t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return with_database(server_dsn, name)


@dataclass(frozen=True)
class LedgerSnapshot:
    """Everything a refused call must leave untouched."""

    head_version: int | None
    head_digest: str | None
    transitions: int


class Ledger:
    """Direct, superuser access to the tables, for assertions only."""

    def __init__(self, dsn: str, keyring: Keyring) -> None:
        self.dsn = dsn
        self.keyring = keyring

    async def snapshot(self, thread_id: str) -> LedgerSnapshot:
        conn = await asyncpg.connect(self.dsn)
        try:
            head = await conn.fetchrow(
                "SELECT version, head_digest FROM ztate.threads WHERE thread_id = $1", thread_id
            )
            count = await conn.fetchval(
                "SELECT count(*) FROM ztate.transitions WHERE thread_id = $1", thread_id
            )
        finally:
            await conn.close()
        return LedgerSnapshot(
            head["version"] if head else None, head["head_digest"] if head else None, count
        )

    async def rejections(self, thread_id: str) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.dsn)
        try:
            return await conn.fetch(
                "SELECT * FROM ztate.rejections WHERE thread_id = $1 ORDER BY id", thread_id
            )
        finally:
            await conn.close()

    async def rejection_count(self) -> int:
        conn = await asyncpg.connect(self.dsn)
        try:
            count: int = await conn.fetchval("SELECT count(*) FROM ztate.rejections")
            return count
        finally:
            await conn.close()

    async def rows(self, thread_id: str) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.dsn)
        try:
            return await conn.fetch(
                "SELECT * FROM ztate.transitions WHERE thread_id = $1 ORDER BY version", thread_id
            )
        finally:
            await conn.close()

    async def record(self, thread_id: str, version: int) -> dict[str, Any]:
        """The ledger record at ``version``, as an operator reads it (nodes not marked
        ``read_records`` are told versions only)."""
        conn = await asyncpg.connect(self.dsn)
        try:
            body = await conn.fetchval(
                "SELECT record FROM ztate.transitions WHERE thread_id = $1 AND version = $2",
                thread_id,
                version,
            )
        finally:
            await conn.close()
        assert body is not None, f"no record {thread_id}@{version}"
        parsed: dict[str, Any] = json.loads(bytes(body))
        return parsed

    async def verify(self, thread_id: str) -> int:
        """Verify the thread's whole chain from genesis; returns its length."""
        rows = await self.rows(thread_id)
        parent = GENESIS_PARENT
        for expected, row in enumerate(rows):
            record = verify_record(
                bytes(row["record"]),
                digest=row["digest"],
                signature=row["signature"],
                keyring=self.keyring,
                expected_parent=parent,
                expected_version=expected,
            )
            assert (record["thread_id"], record["key_id"]) == (thread_id, row["key_id"])
            parent = row["digest"]
        return len(rows)
