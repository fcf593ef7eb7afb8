"""The policy versions a ledger names: written when the service loads a policy,
read by verifiers (migration 0014, ``ztate.policies``).

A record carries only its policy's digest. Keeping each version's exact body
beside the ledger lets a verifier check every record against the version it
names, after any number of policy edits. The table is append-only: a version is
written once (``ON CONFLICT DO NOTHING``) and never changed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import asyncpg

KEEP = """
INSERT INTO ztate.policies (policy_digest, policy_name, body)
SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[])
ON CONFLICT (policy_digest) DO NOTHING
"""
READ = "SELECT policy_digest, policy_name, body, octet_length(body) AS size FROM ztate.policies"
READ_NAMED = READ + " WHERE policy_digest = ANY($1::text[])"
# a verifier bounds what it reads: a body above the bound stays in the database
READ_BOUNDED = (
    "SELECT policy_digest, policy_name, "
    "CASE WHEN octet_length(body) <= $1 THEN body END AS body, octet_length(body) AS size "
    "FROM ztate.policies"
)
ORDER = ' ORDER BY policy_digest COLLATE "C"'


@dataclass(frozen=True, slots=True)
class StoredPolicy:
    """One stored policy version, as the database holds it (nothing verified yet)."""

    digest: str
    name: str
    body: bytes  # empty when it was not read (``size`` above the reader's bound)
    size: int | None = None  # the stored body's length, when known


async def keep_policy_versions(pool: asyncpg.Pool, versions: Iterable[StoredPolicy]) -> int:
    """Write the versions not stored yet, in one statement; returns how many were new."""
    rows = list(versions)
    async with pool.acquire() as conn:
        status = await conn.execute(
            KEEP,
            [row.digest for row in rows],
            [row.name for row in rows],
            [row.body for row in rows],
        )
    return int(status.rsplit(" ", 1)[-1])


async def stored_policy_versions(
    conn: asyncpg.Connection,
    digests: Iterable[str] | None = None,
    *,
    max_body: int | None = None,
) -> list[StoredPolicy]:
    """The stored versions (those of ``digests`` only, if given), by digest; with
    ``max_body``, a body longer than that is not read (``body`` empty, ``size`` says)."""
    if max_body is not None:
        rows = await conn.fetch(READ_BOUNDED + ORDER, max_body)
    elif digests is None:
        rows = await conn.fetch(READ + ORDER)
    else:
        rows = await conn.fetch(READ_NAMED + ORDER, sorted(set(digests)))
    return [
        StoredPolicy(
            row["policy_digest"],
            row["policy_name"],
            b"" if row["body"] is None else bytes(row["body"]),
            row["size"],
        )
        for row in rows
    ]
