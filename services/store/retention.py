"""Retention: prune old state bodies, keep every record.

A ledger row holds the signed record (with the state's digest) and a copy of the
state after it. The copy is what grows; the record is what proves history. Pruning
sets old copies to NULL through the role ``ztate_pruner``, which may update that
one column and nothing else, and the database trigger allows only that change,
never on a thread's head. The chain still verifies: the verifier replays states
from the patches and checks them against the signed digests.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg

from ztate.services.store.migrate import PRUNER_ROLE

PRUNE = """
UPDATE ztate.transitions t
   SET state = NULL
  FROM ztate.threads h
 WHERE t.thread_id = h.thread_id
   AND t.state IS NOT NULL
   AND t.version < h.version
   AND ($1::bigint IS NULL OR t.version <= h.version - $1::bigint)
   AND ($2::timestamptz IS NULL OR t.committed_at < $2::timestamptz)
   AND ($3::text IS NULL OR t.thread_id = $3::text)
"""


class RetentionError(ValueError):
    """The retention limits are unusable, or the database is not ready for pruning."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What to keep: the newest ``keep_versions`` state bodies of each thread and
    those younger than ``older_than``. A body is pruned only outside every limit
    given; the head's is always kept."""

    keep_versions: int | None = None
    older_than: timedelta | None = None

    def __post_init__(self) -> None:
        if self.keep_versions is None and self.older_than is None:
            raise RetentionError("give --keep-versions, --older-than or both")
        if self.keep_versions is not None and self.keep_versions < 1:
            raise RetentionError("--keep-versions must be at least 1 (the head is always kept)")
        if self.older_than is not None and self.older_than < timedelta(0):
            raise RetentionError("--older-than must not be negative")


async def prune(
    dsn: str,
    limits: Limits,
    *,
    thread_id: str | None = None,
    now: datetime | None = None,
    dry_run: bool = False,
) -> int:
    """Set to NULL the state bodies outside ``limits``; returns how many were pruned.
    ``dry_run``: the same statement in a transaction rolled back, so the count is exactly
    what a real run would prune at this moment, and nothing changes."""
    cutoff = None
    if limits.older_than is not None:
        cutoff = (now or datetime.now(UTC)) - limits.older_than
    try:
        conn = await asyncpg.connect(dsn, server_settings={"role": PRUNER_ROLE})
    except asyncpg.InvalidParameterValueError:
        raise RetentionError(
            f"role {PRUNER_ROLE!r} does not exist: start the transition service once to "
            "apply its migrations"
        ) from None
    try:
        if dry_run:
            transaction = conn.transaction()
            await transaction.start()
            try:
                status: str = await conn.execute(PRUNE, limits.keep_versions, cutoff, thread_id)
            finally:
                await transaction.rollback()
        else:
            status = await conn.execute(PRUNE, limits.keep_versions, cutoff, thread_id)
    finally:
        await conn.close()
    return int(status.rsplit(" ", 1)[-1])
