"""Postgres storage of nodes' work on threads and of the leases on it (migration 0015).

Every lease change is one compare-and-swap statement on the ``(thread_id, node)``
row, so it is correct whichever replica of the transition service runs it: a grant
takes a free or lapsed row and bumps its epoch; a renewal or a release names the
epoch it holds and does nothing once another grant bumped it. Lease times are the
database's clock (``now()``), the one clock every replica shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg
import orjson

from ztate.services.store.boundary import translated

WORK_CHANNEL = "ztate_work"
ANNOUNCE_WORK = "SELECT pg_notify($1, n) FROM unnest($2::text[]) AS n"


@dataclass(frozen=True, slots=True)
class Lease:
    """A grant of the lease on a thread for one node: ``epoch`` fences it."""

    thread_id: str
    node: str
    epoch: int
    wake_version: int
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class Waiting:
    """Work waiting for a node on a thread (no live holder)."""

    thread_id: str
    node: str


@dataclass(frozen=True, slots=True)
class Held:
    """A grant that still holds its lease, ``seconds_left`` before it lapses."""

    thread_id: str
    node: str
    epoch: int
    holder: str
    seconds_left: float


@dataclass(frozen=True, slots=True)
class Unevaluated:
    """A thread whose newest versions have not been looked at for wakes yet."""

    thread_id: str


@dataclass(frozen=True, slots=True)
class ThreadProgress:
    """How far a thread is, and how far its wakes were decided."""

    version: int
    policy_name: str
    evaluated_version: int  # -1: none yet


@dataclass(frozen=True, slots=True)
class VersionChange:
    """What a version changed and who made it, for deciding whom it wakes."""

    version: int
    node_id: str
    changed: frozenset[str]
    state: bytes | None  # None once pruned


# the wakes and the mark in one statement: together or not at all, one round trip
RECORD_WAKES = """
WITH woken AS (
    INSERT INTO ztate.node_work AS w (thread_id, node, wake_version)
    SELECT $1, n, v FROM unnest($2::text[], $3::bigint[]) AS x(n, v)
    ON CONFLICT (thread_id, node) DO UPDATE
       SET wake_version = greatest(w.wake_version, excluded.wake_version)
    RETURNING 1
)
INSERT INTO ztate.wake_marks AS m (thread_id, evaluated_version) VALUES ($1, $4)
ON CONFLICT (thread_id) DO UPDATE
   SET evaluated_version = greatest(m.evaluated_version, excluded.evaluated_version)
"""

PROGRESS = """
SELECT t.version, t.policy_name, coalesce(m.evaluated_version, -1) AS evaluated_version
  FROM ztate.threads t LEFT JOIN ztate.wake_marks m ON m.thread_id = t.thread_id
 WHERE t.thread_id = $1
"""

UNEVALUATED = """
SELECT t.thread_id
  FROM ztate.threads t LEFT JOIN ztate.wake_marks m ON m.thread_id = t.thread_id
 WHERE m.evaluated_version IS NULL OR m.evaluated_version < t.version
 LIMIT $1
"""

# The work waiting for one node ($1), lapsed leases first (a holder died: the work
# waited a TTL already), then rows never held or given back. Led by the index of
# migration 0030 in that order, so a round reads about what it grants: the rows it
# returns and the leases still held it skips on the way. Measured on 200,000 threads
# (docs/work.md): 0.5 ms a round whether 200 or all 200,000 wait; one query for every
# node at once sorted them all (70 to 85 ms). A row on a thread of another policy (the
# policy renamed, the node moved to another policy file) is granted once, found out by
# the dispatcher and retired (``WorkDispatcher._deliver``): a filter here would have
# skipped such rows at every round, for ever, and a release undone (before) put them
# back ahead of the node's real work, which they starved.
WAITING = """
SELECT thread_id, node FROM ztate.node_work
 WHERE node = $1 AND wake_version > handled_version
   AND (holder IS NULL OR expires_at < now())
 ORDER BY expires_at
 LIMIT $2
"""

ACQUIRE = """
UPDATE ztate.node_work
   SET holder = $3, epoch = epoch + 1, expires_at = now() + make_interval(secs => $4)
 WHERE thread_id = $1 AND node = $2 AND wake_version > handled_version
   AND (holder IS NULL OR expires_at < now())
RETURNING epoch, wake_version, expires_at
"""

# A grant holds the lease while its row names it (epoch, a holder) and it has not
# lapsed: a lapsed grant is lost even before another process takes the row
# (docs/work.md, "Leases"). The commit and the park fence the same way (migration 0028).
RENEW = """
UPDATE ztate.node_work SET expires_at = now() + make_interval(secs => $4)
 WHERE thread_id = $1 AND node = $2 AND epoch = $3 AND holder IS NOT NULL
   AND expires_at >= now()
RETURNING expires_at
"""

# handled_version counts no further than the version that last woke the node: a worker
# claiming a later one (2^63 - 1) would otherwise silence every later wake for good
RELEASE = """
UPDATE ztate.node_work
   SET holder = NULL, expires_at = NULL,
       handled_version = greatest(handled_version, least($4, wake_version))
 WHERE thread_id = $1 AND node = $2 AND epoch = $3 AND holder IS NOT NULL
   AND expires_at >= now()
RETURNING wake_version > handled_version AS more
"""

HOLDS = """
SELECT 1 FROM ztate.node_work
 WHERE thread_id = $1 AND node = $2 AND epoch = $3 AND holder IS NOT NULL
   AND expires_at >= now()
"""

# Which of these grants still hold their lease, and for how long (seconds): the truth a
# replica checks its streams' slots against, as renewals, releases and commits under a
# lease may reach another replica. thread_id = ANY prunes to the threads' shards on Citus.
HELD = """
SELECT thread_id, node, epoch, holder,
       extract(epoch FROM expires_at - now())::float8 AS seconds_left
  FROM ztate.node_work
 WHERE thread_id = ANY($1::text[]) AND node = ANY($2::text[]) AND holder = ANY($3::text[])
   AND expires_at >= now()
"""

CHANGES = """
SELECT version, node_id, record, state FROM ztate.transitions
 WHERE thread_id = $1 AND version > $2 ORDER BY version LIMIT $3
"""


class WorkStore:
    """Nodes' work and leases, on the transition service's pool and role."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @translated
    async def changes_after(self, thread_id: str, version: int, limit: int) -> list[VersionChange]:
        """Up to ``limit`` versions newer than ``version``: the keys each patch set or
        removed, its author and the state it made."""
        rows = await self._pool.fetch(CHANGES, thread_id, version, limit)
        return [
            VersionChange(
                r["version"],
                r["node_id"],
                frozenset(orjson.loads(r["record"])["patch"]),
                r["state"],
            )
            for r in rows
        ]

    @translated
    async def progress(self, thread_id: str) -> ThreadProgress | None:
        """The thread's head version, policy and wake mark, in one query; None if no
        such thread."""
        row = await self._pool.fetchrow(PROGRESS, thread_id)
        if row is None:
            return None
        return ThreadProgress(row["version"], row["policy_name"], row["evaluated_version"])

    @translated
    async def record_wakes(
        self, thread_id: str, wakes: Sequence[tuple[str, int]], evaluated_version: int
    ) -> None:
        """Nodes woken on ``thread_id`` (node, version), and the thread's versions up
        to ``evaluated_version`` as decided; together or not at all."""
        await self._pool.execute(
            RECORD_WAKES, thread_id, [n for n, _ in wakes], [v for _, v in wakes], evaluated_version
        )

    @translated
    async def unevaluated(self, limit: int) -> list[Unevaluated]:
        """Threads whose head is ahead of their wake mark."""
        rows = await self._pool.fetch(UNEVALUATED, limit)
        return [Unevaluated(r["thread_id"]) for r in rows]

    @translated
    async def waiting(self, node: str, limit: int) -> list[Waiting]:
        """Up to ``limit`` rows of work of ``node`` that nobody holds (or whose holder's
        lease lapsed); lapsed leases first."""
        rows = await self._pool.fetch(WAITING, node, limit)
        return [Waiting(r["thread_id"], r["node"]) for r in rows]

    @translated
    async def acquire(self, thread_id: str, node: str, holder: str, ttl: float) -> Lease | None:
        """Take the lease if the node has work there and nobody holds it: a new epoch."""
        row = await self._pool.fetchrow(ACQUIRE, thread_id, node, holder, ttl)
        if row is None:
            return None
        return Lease(thread_id, node, row["epoch"], row["wake_version"], row["expires_at"])

    @translated
    async def renew(self, thread_id: str, node: str, epoch: int, ttl: float) -> datetime | None:
        """Extend the lease of ``epoch``; None when it is no longer this grant's."""
        expires: datetime | None = await self._pool.fetchval(RENEW, thread_id, node, epoch, ttl)
        return expires

    @translated
    async def release(
        self, thread_id: str, node: str, epoch: int, handled_version: int
    ) -> bool | None:
        """Give the lease of ``epoch`` back, the node done with versions up to
        ``handled_version``: whether more work waits (None: not this grant's)."""
        more: bool | None = await self._pool.fetchval(
            RELEASE, thread_id, node, epoch, handled_version
        )
        return more

    @translated
    async def holds(self, thread_id: str, node: str, epoch: int) -> bool:
        """Whether grant ``epoch`` still holds the lease (the fencing check)."""
        return await self._pool.fetchval(HOLDS, thread_id, node, epoch) is not None

    @translated
    async def held(
        self, thread_ids: Sequence[str], nodes: Sequence[str], holders: Sequence[str]
    ) -> list[Held]:
        """The live leases among those of ``thread_ids`` and ``nodes`` held by
        ``holders`` (match each grant on all four fields)."""
        rows = await self._pool.fetch(HELD, list(thread_ids), list(nodes), list(holders))
        return [
            Held(r["thread_id"], r["node"], r["epoch"], r["holder"], r["seconds_left"])
            for r in rows
        ]

    @translated
    async def announce(self, nodes: Sequence[str]) -> None:
        """Tell every replica's dispatcher that these nodes have new work."""
        await announce_work(self._pool, nodes)


async def announce_work(pool: asyncpg.Pool, nodes: Sequence[str]) -> None:
    """Tell every replica's dispatcher (its LISTEN on ``ztate_work``) that ``nodes`` have
    new work; sent after the commit that recorded it, by a coordinator session."""
    await pool.execute(ANNOUNCE_WORK, WORK_CHANNEL, list(nodes))
