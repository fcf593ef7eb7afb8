"""Read-only ledger queries for operators, on a role that can only read.

Pagination is keyset (``WHERE id < $after ORDER BY id DESC``), so a page costs the
same at the millionth row as at the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import asyncpg

from services.store.transitions import keep_session


@dataclass(frozen=True, slots=True)
class RejectionFilter:
    thread_id: str | None = None
    node_id: str | None = None
    reason: str | None = None
    since: datetime | None = None
    until: datetime | None = None


@dataclass(frozen=True, slots=True)
class StoredRejection:
    id: int
    rejected_at: datetime
    method: str
    node_id: str
    thread_id: str | None
    base_version: int | None
    reason: str
    keys: list[str]
    patch_digest: str | None
    patch_bytes: int | None
    message: str


LIST_REJECTIONS = """
SELECT id, rejected_at, method, node_id, thread_id, base_version, reason, keys,
       patch_digest, patch_bytes, message
  FROM ztate.rejections
 WHERE ($1::text IS NULL OR thread_id = $1)
   AND ($2::text IS NULL OR node_id = $2)
   AND ($3::text IS NULL OR reason = $3)
   AND ($4::timestamptz IS NULL OR rejected_at >= $4)
   AND ($5::timestamptz IS NULL OR rejected_at < $5)
   AND ($6::bigint IS NULL OR id < $6)
 ORDER BY id DESC
 LIMIT $7
"""


class LedgerQueries:
    """Queries over the ledger tables through the read-only role."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @classmethod
    async def open(cls, dsn: str, *, role: str, pool_size: int = 4) -> LedgerQueries:
        pool = await asyncpg.create_pool(
            dsn,
            min_size=1,
            max_size=pool_size,
            reset=keep_session,
            server_settings={
                "role": role,
                "application_name": "ztate-ledger",
                "default_transaction_read_only": "on",
            },
        )
        return cls(pool)

    async def close(self) -> None:
        await self._pool.close()

    async def rejections(
        self, where: RejectionFilter, *, limit: int, before_id: int | None
    ) -> list[StoredRejection]:
        """Newest first; ``before_id`` continues after the last id of a previous page."""
        rows = await self._pool.fetch(
            LIST_REJECTIONS,
            where.thread_id,
            where.node_id,
            where.reason,
            where.since,
            where.until,
            before_id,
            limit,
        )
        return [StoredRejection(**dict(row.items())) for row in rows]
