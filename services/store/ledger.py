"""Read-only ledger queries for operators, on a role that can only read.

Pagination is keyset (``WHERE id < $after ORDER BY id DESC`` for rejections,
``(committed_at, digest) < $after`` for transitions), so a page costs the same at
the millionth row as at the first; migration 0007 holds the indexes these walk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Concatenate, ParamSpec, TypeVar

import asyncpg

from ztate.services.runtime import errors
from ztate.services.store.boundary import translated
from ztate.services.store.transitions import keep_session


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


# Transitions -----------------------------------------------------------------
#
# A page of transitions is ordered by (committed_at, digest), newest first, and
# continues strictly after the last (committed_at, digest) seen: one btree range
# scan per page whatever the depth. The SQL is assembled from the filters that
# are set, so that every prepared statement has a plan for exactly its filters
# (a generic plan over "$1 IS NULL OR ..." could not pick an index).

PARKED_STATUSES = frozenset({"pending", "rejected", "expired", "stale", "refused"})
COMMITTED = "committed"


@dataclass(frozen=True, slots=True)
class TransitionFilter:
    thread_id: str | None = None
    node_id: str | None = None
    changed_key: str | None = None
    # "committed", or a parked proposal's status (PARKED_STATUSES)
    status: str = COMMITTED
    since: datetime | None = None
    until: datetime | None = None


@dataclass(frozen=True, slots=True)
class PageKey:
    """Where a page of transitions ended: its last (moment, digest)."""

    at: datetime
    digest: str


@dataclass(frozen=True, slots=True)
class StoredEntry:
    thread_id: str
    version: int
    digest: str
    parent_digest: str
    node_id: str
    kind: str
    status: str
    at: datetime
    changed_keys: list[str]
    has_receipt: bool


@dataclass(frozen=True, slots=True)
class StoredDetail:
    entry: StoredEntry
    record: bytes
    state: bytes | None
    key_id: str
    signature: str
    receipt: bytes | None
    receipt_signature: str | None
    receipt_key_id: str | None


@dataclass(frozen=True, slots=True)
class StoredKeyChange:
    version: int
    digest: str
    node_id: str
    committed_at: datetime
    record: bytes


COMMITTED_COLUMNS = """
SELECT t.thread_id, t.version, t.digest, t.parent_digest, t.node_id,
       convert_from(t.record, 'UTF8')::jsonb ->> 'kind' AS kind, 'committed' AS status,
       t.committed_at AS at, ztate.patch_keys(t.record) AS changed_keys,
       t.receipt IS NOT NULL AS has_receipt"""

PARKED_COLUMNS = """
SELECT t.thread_id, t.base_version + 1 AS version, t.digest, t.parent_digest, t.node_id,
       'proposal' AS kind, t.status, t.parked_at AS at,
       ztate.patch_keys(t.proposal) AS changed_keys, false AS has_receipt"""

# A changed key without a thread walks ztate.transition_keys, whose primary key
# (key, committed_at, digest) is the page order for one key; with a thread, the
# thread's own rows are few, and their patches are read directly.
BY_KEY = """
  FROM ztate.transition_keys k
  JOIN ztate.transitions t ON t.digest = k.digest"""


def list_transitions_sql(
    where: TransitionFilter, after: PageKey | None, limit: int
) -> tuple[str, list[object]]:
    """The statement and its arguments for one page; only the set filters appear."""
    committed = where.status == COMMITTED
    by_key = committed and where.changed_key is not None and where.thread_id is None
    # the columns that order and filter the page: the key table's when it drives
    source = "k" if by_key else "t"
    moment = f"{source}.committed_at" if committed else "t.parked_at"
    digest = f"{source}.digest"
    conditions: list[str] = []
    args: list[object] = []

    def condition(template: str, *values: object) -> None:
        numbers = [f"${len(args) + i + 1}" for i in range(len(values))]
        conditions.append(template.format(*numbers))
        args.extend(values)

    if not committed:
        condition("t.status = {0}", where.status)
    if where.thread_id is not None:
        condition("t.thread_id = {0}", where.thread_id)
    if where.node_id is not None:
        condition(f"{source}.node_id = {{0}}", where.node_id)
    if by_key:
        condition("k.key = {0}", where.changed_key)
    elif where.changed_key is not None:
        document = "t.record" if committed else "t.proposal"
        condition(f"ztate.patch_keys({document}) @> ARRAY[{{0}}::text]", where.changed_key)
    if where.since is not None:
        condition(f"{moment} >= {{0}}", where.since)
    if where.until is not None:
        condition(f"{moment} < {{0}}", where.until)
    if after is not None:
        condition(f"({moment}, {digest}) < ({{0}}, {{1}})", after.at, after.digest)
    if by_key:
        table = BY_KEY
    elif committed:
        table = "\n  FROM ztate.transitions t"
    else:
        table = "\n  FROM ztate.pending_transitions t"
    sql = (
        f"{COMMITTED_COLUMNS if committed else PARKED_COLUMNS}{table}\n"
        + (f" WHERE {' AND '.join(conditions)}\n" if conditions else "")
        + f" ORDER BY {moment} DESC, {digest} DESC\n LIMIT ${len(args) + 1}"
    )
    return sql, [*args, limit]


DETAIL = (
    COMMITTED_COLUMNS
    + """,
       record, state, key_id, signature, receipt, receipt_signature, receipt_key_id
  FROM ztate.transitions t
"""
)
DETAIL_BY_DIGEST = DETAIL + " WHERE t.digest = $1"
DETAIL_BY_VERSION = DETAIL + " WHERE t.thread_id = $1 AND t.version = $2"

KEY_HISTORY = """
SELECT version, digest, node_id, committed_at, record
  FROM ztate.transitions
 WHERE thread_id = $1 AND version > $3 AND ztate.patch_keys(record) @> ARRAY[$2::text]
 ORDER BY version
 LIMIT $4
"""

ENTRY_FIELDS = frozenset(StoredEntry.__dataclass_fields__)


def _entry(row: asyncpg.Record) -> StoredEntry:
    return StoredEntry(**{name: row[name] for name in ENTRY_FIELDS})


@dataclass(frozen=True, slots=True)
class StoredThread:
    """A thread's head as operators list it."""

    thread_id: str
    policy: str
    version: int
    head_digest: str
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class StoredWork:
    """A node's work on a thread and its lease (migration 0015)."""

    node: str
    wake_version: int
    handled_version: int
    holder: str | None
    epoch: int
    expires_at: datetime | None


LIST_THREADS = """
SELECT thread_id, policy_name AS policy, version, head_digest, created_at, updated_at
  FROM ztate.threads
 WHERE ($1::text IS NULL OR policy_name = $1) AND ($2::text IS NULL OR thread_id > $2)
 ORDER BY thread_id
 LIMIT $3
"""

THREAD = """
SELECT thread_id, policy_name AS policy, version, head_digest, created_at, updated_at
  FROM ztate.threads WHERE thread_id = $1
"""

THREAD_WORK = """
SELECT node, wake_version, handled_version, holder, epoch, expires_at
  FROM ztate.node_work WHERE thread_id = $1 ORDER BY node
"""


P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_TIMEOUT_SECONDS = 10.0


def _bounded(
    method: Callable[Concatenate[LedgerQueries, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[LedgerQueries, P], Coroutine[Any, Any, R]]:
    """Every query runs under the pool's ``statement_timeout``: one it cancels (or a
    database operator's ``pg_cancel_backend``: the same SQLSTATE, 57014) leaves as
    ``QueryTooCostly``, not as the outage its driver class would say (asyncpg files
    ``QueryCanceledError`` under ``OperatorInterventionError``): asking again at once
    would cost as much again."""

    @functools.wraps(method)
    async def guarded(self: LedgerQueries, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(self, *args, **kwargs)
        except asyncpg.QueryCanceledError:
            raise errors.QueryTooCostly(
                f"the ledger query was cancelled after running for up to "
                f"{self.timeout_ms} ms (the ledger's limit): narrow it (a thread, a node, "
                f"a shorter time window) and ask again",
                limit=self.timeout_ms,
            ) from None

    return guarded


class LedgerQueries:
    """Queries over the ledger tables through the read-only role, each cancelled by
    the database once it runs longer than ``timeout_ms``."""

    def __init__(self, pool: asyncpg.Pool, timeout_ms: int) -> None:
        self._pool = pool
        self.timeout_ms = timeout_ms

    @property
    def pool(self) -> asyncpg.Pool:
        """The read-only role's pool (for the pool-saturation gauges)."""
        return self._pool

    @classmethod
    async def open(
        cls,
        dsn: str,
        *,
        role: str,
        pool_size: int = 4,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    ) -> LedgerQueries:
        timeout_ms = max(1, round(timeout_seconds * 1000))
        pool = await asyncpg.create_pool(
            dsn,
            min_size=1,
            max_size=pool_size,
            reset=keep_session,
            server_settings={
                "role": role,
                "application_name": "ztate-ledger",
                "default_transaction_read_only": "on",
                # plan each query for its arguments: a generic plan cannot tell a
                # key in every fourth record from one in every hundredth
                "plan_cache_mode": "force_custom_plan",
                # an operator's filter that no index serves (or a hostile one) scans
                # for at most this long, whatever the size of the ledger
                "statement_timeout": str(timeout_ms),
            },
        )
        return cls(pool, timeout_ms)

    async def close(self) -> None:
        await self._pool.close()

    @translated
    @_bounded
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

    @translated
    @_bounded
    async def transitions(
        self, where: TransitionFilter, *, limit: int, after: PageKey | None
    ) -> list[StoredEntry]:
        """Newest first; ``after`` continues strictly after a previous page's last entry."""
        sql, args = list_transitions_sql(where, after, limit)
        rows = await self._pool.fetch(sql, *args)
        return [_entry(row) for row in rows]

    @translated
    @_bounded
    async def detail(
        self, *, digest: str | None = None, thread_id: str | None = None, version: int = 0
    ) -> StoredDetail | None:
        """One committed record by digest, or by (thread_id, version); None if absent."""
        if digest is not None:
            row = await self._pool.fetchrow(DETAIL_BY_DIGEST, digest)
        else:
            row = await self._pool.fetchrow(DETAIL_BY_VERSION, thread_id, version)
        if row is None:
            return None
        return StoredDetail(
            entry=_entry(row),
            record=row["record"],
            state=row["state"],
            key_id=row["key_id"],
            signature=row["signature"],
            receipt=row["receipt"],
            receipt_signature=row["receipt_signature"],
            receipt_key_id=row["receipt_key_id"],
        )

    @translated
    @_bounded
    async def threads(
        self, *, policy: str | None, after: str | None, limit: int
    ) -> list[StoredThread]:
        """Threads in id order, after ``after`` (a previous page's last id)."""
        rows = await self._pool.fetch(LIST_THREADS, policy, after, limit)
        return [StoredThread(**dict(row.items())) for row in rows]

    @translated
    @_bounded
    async def thread(self, thread_id: str) -> tuple[StoredThread, list[StoredWork]] | None:
        """One thread's head and its nodes' work; None if no such thread."""
        head = await self._pool.fetchrow(THREAD, thread_id)
        if head is None:
            return None
        work = await self._pool.fetch(THREAD_WORK, thread_id)
        return StoredThread(**dict(head.items())), [StoredWork(**dict(row.items())) for row in work]

    @translated
    @_bounded
    async def key_history(
        self, thread_id: str, key: str, *, limit: int, after_version: int
    ) -> list[StoredKeyChange]:
        """The records of ``thread_id`` whose patch touches ``key``, oldest first."""
        rows = await self._pool.fetch(KEY_HISTORY, thread_id, key, after_version, limit)
        return [StoredKeyChange(**dict(row.items())) for row in rows]
