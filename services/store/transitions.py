"""Postgres storage of thread heads, the transition ledger, parked proposals,
rejections and checkpoints: the implementation of ``ztate.services.store.interface``.

A commit is one statement: the compare-and-swap on the head and the ledger insert
run as a single ``WITH ... UPDATE ... INSERT`` so they commit together or not at
all, in one round trip. Zero rows back means the head was not at the expected
version (or digest): nothing was written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from ztate.contract.checkpoints import SignedCheckpoint
from ztate.contract.record import SealedRecord
from ztate.services.runtime.telemetry import NO_METRICS, Metrics
from ztate.services.store.boundary import translated
from ztate.services.store.group_commit import GRACE_SECONDS, CommitArgs, GroupCommitter
from ztate.services.store.group_commit import Outcome as CommitOutcome
from ztate.services.store.interface import (
    Commit,
    Creation,
    Genesis,
    HeadLookup,
    KeptState,
    LeaseClaim,
    Park,
    Parking,
    StaleRefusal,
    UnsignedHead,
)
from ztate.services.store.rows import (
    Backend,
    CheckpointRow,
    Evidence,
    Head,
    PendingTransition,
    Rejection,
    StoredTransition,
    VersionState,
)
from ztate.services.store.work import announce_work

log = logging.getLogger("ztate.store")
POOL_CLOSE_SECONDS = 10.0  # then the connections still held are terminated

COMMIT_CHANNEL = "ztate_commits"
# Commit statements in flight at once; the commits that arrive while all are busy leave
# together in the next free one (group_commit). Up to MAX_BATCH rows a statement.
COMMIT_SLOTS = 2
MAX_BATCH = 64
# On Citus, commits leave one row each (PostgresTransitionStore.open).
ON_CITUS = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'citus')"

# The commit (migrations 0016 and 0018): the compare-and-swap on the head, the ledger
# insert and the nodes the version wakes with the thread's wake mark, one call. NULL: the
# head was not at the expected version and digest (nothing written); otherwise whether
# some replica watches the thread (announce_commit). On Citus the function is
# distributed by its first argument: the call runs on the worker holding the thread, as
# one local transaction (docs/scale-out.md).
COMMIT = (
    "SELECT ztate.commit_transition($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, "
    "$15, $16)"
)
# ztate.commit_transition's answer (migration 0019): NULL head moved, -1 lease lost,
# else committed with these bits
WATCHED, RELEASED, MORE_WORK = 1, 2, 4


def commit_outcome(answer: int | None) -> CommitOutcome:
    """What ``COMMIT`` answered, decoded: the one reading of its bits."""
    if answer is None:
        return CommitOutcome(Commit.HEAD_MOVED, watched=False)
    if answer < 0:
        return CommitOutcome(Commit.LEASE_LOST, watched=False)
    return CommitOutcome(
        Commit.COMMITTED,
        watched=bool(answer & WATCHED),
        more=bool(answer & MORE_WORK) if answer & RELEASED else None,
    )


# A creation: the head, the genesis record, the nodes the genesis wakes and the thread's
# wake mark (migration 0018: every version is decided by the statement that commits it).
CREATE_THREAD = """
WITH head AS (
    INSERT INTO ztate.threads (thread_id, version, head_digest, state, policy_name,
                               policy_digest, created_at, updated_at)
    VALUES ($1, 0, $2, $3, $4, $5, $6, $6)
    ON CONFLICT (thread_id) DO NOTHING
    RETURNING thread_id
), woke AS (
    INSERT INTO ztate.node_work (thread_id, node, wake_version)
    SELECT h.thread_id, n, 0 FROM head h, unnest($12::text[]) AS n
    RETURNING 1
), marked AS (
    INSERT INTO ztate.wake_marks (thread_id, evaluated_version)
    SELECT thread_id, 0 FROM head
    RETURNING 1
)
INSERT INTO ztate.transitions (thread_id, version, digest, parent_digest, node_id, key_id,
                               signature, record, state, committed_at)
SELECT thread_id, 0, $2, $7, $8, $9, $10, $11, $3, $6 FROM head
RETURNING version
"""

TRANSITION_COLUMNS = (
    "thread_id, version, digest, parent_digest, node_id, key_id, signature, record, "
    "committed_at, idempotency_key, request_digest"
)

PENDING_COLUMNS = (
    "digest, thread_id, base_version, parent_digest, node_id, proposal, risk_rules, "
    "idempotency_key, request_digest, status, parked_at, sensitive_keys, required_approvals"
)


HEAD_COLUMNS = "thread_id, version, digest, state_bytes, policy_name, policy_digest"


# Reads whose plan is kept. Postgres keeps a generic plan for a prepared statement after
# five runs (asyncpg prepares each once per pooled connection), made with the statistics
# of that moment and kept until an ANALYZE of its tables. On tables never analysed
# (a fresh database, or autovacuum not yet come) the planner takes a table for ten pages
# and a thread for a row or two, so it costs "thread_id = $1 AND version = $2" through
# the thread-time index (every version of the thread read to find one) the same as
# through the primary key, and chose the former; the thread's versions then grew under a
# plan that reads them all. Each lookup of one row by its unique key is therefore written
# as a range of one value (the same row: the collations are deterministic), in that key's
# order, LIMIT 1: an order only the key's index gives, so any other index adds a sort and
# the probe is the cheapest index plan whatever the statistics say of the thread
# (tests/integration/test_read_plans.py). (Tables analysed while they held a page or two
# get a sequential scan instead, for these as for every statement of the store, until
# their next ANALYZE: no wording of a statement changes that.)
def record_at(columns: str) -> str:
    """The statement reading ``columns`` of the record ($1 thread, $2 version)."""
    return (
        f"SELECT {columns} FROM ztate.transitions "  # noqa: S608 - constant columns
        "WHERE thread_id = $1 AND version BETWEEN $2 AND $2 ORDER BY version LIMIT 1"
    )


TRANSITION_AT = record_at(TRANSITION_COLUMNS)
STATE_AT = record_at("state")


# A record of the thread with its head row: the head, then the record at ``version`` (an
# expression of the head row, or a constant) by the primary key, written as record_at is.
# A join on "t.version = h.version" was planned as the thread's versions read by the
# key's prefix, filtered by the head's version.
def record_with_head(version: str, head_columns: str = "") -> str:
    """The statement reading the record at ``version`` of thread $1 (and
    ``head_columns`` of its head row, each with a leading comma)."""
    return f"""
SELECT {", ".join("t." + c for c in TRANSITION_COLUMNS.split(", "))}{head_columns}
  FROM ztate.threads h
 CROSS JOIN LATERAL (SELECT {TRANSITION_COLUMNS} FROM ztate.transitions x
                      WHERE x.thread_id = $1 AND x.version BETWEEN {version} AND {version}
                      ORDER BY x.version LIMIT 1) t
 WHERE h.thread_id = $1
"""  # noqa: S608 - constant column lists and versions


HEAD_TRANSITION = record_with_head("h.version")
# the genesis and the policy the thread was created under (CreateThread's replay check)
GENESIS = record_with_head("0", ", h.policy_name")

# A record's receipt and the risk rules of the parked proposal it committed: the record
# by its digest, the proposal by its unique (thread, node, idempotency key), written as
# record_at is. An equality join was planned as every committed parked proposal read by
# the status index and filtered.
EVIDENCE = """
SELECT t.receipt, t.receipt_signature, t.receipt_key_id,
       coalesce(p.risk_rules, '{}') AS risk_rules
  FROM ztate.transitions t
  LEFT JOIN LATERAL (SELECT x.risk_rules FROM ztate.pending_transitions x
                      WHERE t.receipt IS NOT NULL AND x.thread_id = t.thread_id
                        AND x.node_id = t.node_id
                        AND x.idempotency_key BETWEEN t.idempotency_key AND t.idempotency_key
                        AND x.status = 'committed'
                      ORDER BY x.idempotency_key LIMIT 1) p ON true
 WHERE t.digest = $1
"""

# A parked proposal by its unique (thread, node, idempotency key), written as record_at
# is: "idempotency_key = $3" was planned as the thread's parked proposals read by
# pending_by_thread and filtered.
FIND_PENDING = f"""
SELECT {PENDING_COLUMNS} FROM ztate.pending_transitions
 WHERE thread_id = $1 AND node_id = $2 AND idempotency_key BETWEEN $3 AND $3
 ORDER BY idempotency_key LIMIT 1
"""  # noqa: S608 - constant column list

# Why an approved transition was refused at commit: the newest such rejection, by the
# index migration 0025 adds for exactly this (it walks it backwards, LIMIT 1). Without
# it every plan read all the rejections of the node or of the thread.
REFUSAL_AT_COMMIT = """
SELECT reason FROM ztate.rejections
 WHERE method = 'ApplyDecision' AND thread_id = $1 AND node_id = $2 AND base_version = $3
 ORDER BY id DESC LIMIT 1
"""


def _fields(alias: str, columns: str, renamed: dict[str, str] | None = None) -> str:
    """``columns`` of the composite ``f.<alias>``, named ``<alias>_<column>``."""
    renamed = renamed or {}
    return ", ".join(f"(f.{alias}).{renamed.get(c, c)} AS {alias}_{c}" for c in columns.split(", "))


# One round trip for a proposal whose base is not the cached head (migration 0016): the
# head, what the request's idempotency key already names, and the stale refusal's
# rejection row when the proposal is stale. On Citus its reads are one router query to
# the worker holding the thread.
HEAD_FOR_REQUEST = f"""
SELECT {_fields("h", HEAD_COLUMNS, {"digest": "head_digest", "state_bytes": "state"})},
       {_fields("e", TRANSITION_COLUMNS)}, {_fields("p", PENDING_COLUMNS)}, f.refused
  FROM ztate.head_for_request($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) AS f
"""  # noqa: S608 - constant column lists


def _part(row: asyncpg.Record, alias: str, columns: str) -> dict[str, Any] | None:
    """The columns of one joined part of a row, or None where the join found nothing."""
    names = columns.split(", ")
    if row[f"{alias}_{names[0]}"] is None:
        return None
    return {name: row[f"{alias}_{name}"] for name in names}


# Parking a proposal (migrations 0016, 0024): true when parked now, NULL when the lease
# it was proposed under ($14, $15) is lost (nothing parked). Distributed like COMMIT.
PARK = (
    "SELECT ztate.park_transition($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)"
)


async def session_backend(conn: asyncpg.Connection) -> Backend:
    """The identity of ``conn``'s own session (migration 0009)."""
    row = await conn.fetchrow("SELECT pid, backend_start FROM ztate.session_backend()")
    assert row is not None
    return Backend(row["pid"], row["backend_start"])


async def sweep_watched_threads(conn: asyncpg.Connection) -> int:
    """Remove the watched threads of replicas whose LISTEN session is gone."""
    swept: int = await conn.fetchval("SELECT ztate.sweep_watched_threads()")
    return swept


async def announce_commit(conn: asyncpg.Pool | PoolConnectionProxy[Any], thread_id: str) -> None:
    """Wake the watchers of ``thread_id`` on every replica (migration 0013).

    Sent by the session that committed, after (or, in a transaction, with) the
    commit: on Citus that is a coordinator session, where every replica LISTENs,
    whereas a NOTIFY on the worker holding the thread's shard would reach no one."""
    await conn.execute("SELECT pg_notify($1, $2)", COMMIT_CHANNEL, thread_id)


async def keep_session(_conn: asyncpg.Connection) -> None:
    """Pool release hook: our statements leave no session state to reset.

    asyncpg still rolls back any open transaction before calling this; skipping
    its default ``RESET ALL`` round trip roughly doubles pooled throughput.
    """


UNSIGNED_HEADS = """
SELECT t.thread_id, t.version, t.head_digest
  FROM ztate.threads t
 WHERE NOT EXISTS (SELECT 1 FROM ztate.checkpoints c
                    WHERE c.thread_id = t.thread_id AND c.version = t.version)
   AND t.thread_id > $2
 ORDER BY t.thread_id
 LIMIT $1
"""

SAVE_CHECKPOINT = """
INSERT INTO ztate.checkpoints (thread_id, version, head_digest, checkpoint, signature, key_id,
                               signed_at)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT DO NOTHING
"""


class PostgresTransitionStore:
    """The transition store on Postgres (or Citus), through a least-privilege role."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        metrics: Metrics = NO_METRICS,
        *,
        commit_slots: int = COMMIT_SLOTS,
        max_batch: int = MAX_BATCH,
        commit_grace: float = GRACE_SECONDS,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._committer = GroupCommitter(
            pool,
            self._commit_alone,
            max_in_flight=commit_slots,
            max_batch=max_batch,
            grace=commit_grace,
        )

    @classmethod
    async def open(
        cls, dsn: str, *, role: str, pool_size: int, metrics: Metrics = NO_METRICS
    ) -> PostgresTransitionStore:
        pool = await asyncpg.create_pool(
            dsn,
            min_size=min(2, pool_size),
            max_size=pool_size,
            reset=keep_session,
            server_settings={"role": role, "application_name": "ztate-transition"},
        )
        if await pool.fetchval(ON_CITUS):
            # a group commit spans several threads' shards: a distributed statement with
            # a two-phase commit, where one-row calls each run on one worker (measured in
            # docs/scale-out.md): every pooled connection carries a commit of its own
            return cls(pool, metrics, commit_slots=pool_size, max_batch=1)
        return cls(pool, metrics)

    @property
    def pool(self) -> asyncpg.Pool:
        """The pool, for what runs beside the store on the same database role (the
        approval outbox's store, health probes, pool metrics)."""
        return self._pool

    async def close(self) -> None:
        """Close the pool gracefully; connections still held after POOL_CLOSE_SECONDS
        are terminated (a shutdown must not hang on a stuck connection)."""
        try:
            async with asyncio.timeout(POOL_CLOSE_SECONDS):
                await self._pool.close()
        except TimeoutError:
            log.warning("pool close took over %.0f s: terminated", POOL_CLOSE_SECONDS)
            self._pool.terminate()

    @translated
    async def ping(self) -> None:
        await self._pool.fetchval("SELECT 1")

    @translated
    async def create_thread(
        self,
        sealed: SealedRecord,
        state_bytes: bytes,
        *,
        policy_name: str,
        committed_at: datetime,
        woken: Sequence[str] = (),
    ) -> Creation:
        record = sealed.record
        version = await self._pool.fetchval(
            CREATE_THREAD,
            record["thread_id"],
            sealed.digest,
            state_bytes,
            policy_name,
            record["policy_digest"],
            committed_at,
            record["parent_digest"],
            record["node_id"],
            sealed.key_id,
            sealed.signature,
            sealed.record_bytes,
            list(woken),
        )
        if version is None:
            return Creation.ID_TAKEN
        await self._announce(None, woken)
        return Creation.CREATED

    @translated
    async def read_head(self, thread_id: str) -> Head | None:
        row = await self._pool.fetchrow(
            "SELECT thread_id, version, head_digest AS digest, state AS state_bytes, policy_name, "
            "policy_digest FROM ztate.threads WHERE thread_id = $1",
            thread_id,
        )
        return Head(**dict(row.items())) if row else None

    @translated
    async def head_version(self, thread_id: str) -> int | None:
        version: int | None = await self._pool.fetchval(
            "SELECT version FROM ztate.threads WHERE thread_id = $1", thread_id
        )
        return version

    @translated
    async def head_for_request(
        self, thread_id: str, node_id: str, idempotency_key: str, stale: StaleRefusal
    ) -> HeadLookup:
        rejection = storable_rejection(stale.rejection)
        row = await self._pool.fetchrow(
            HEAD_FOR_REQUEST,
            thread_id,
            node_id,
            idempotency_key,
            rejection.method,
            rejection.node_id,
            rejection.thread_id,
            rejection.base_version,
            rejection.reason,
            list(rejection.keys),
            rejection.patch_digest,
            rejection.patch_bytes,
            rejection.message,
            stale.policy_name,
        )
        assert row is not None  # (SELECT 1) LEFT JOIN ...: always one row
        head = _part(row, "h", HEAD_COLUMNS)
        earlier = _part(row, "e", TRANSITION_COLUMNS)
        parked = _part(row, "p", PENDING_COLUMNS)
        return HeadLookup(
            head=None if head is None else Head(**head),
            earlier=None if earlier is None else StoredTransition(**earlier),
            parked=None if parked is None else PendingTransition(**parked),
            refused=row["refused"],
        )

    @translated
    async def head_versions(self, thread_ids: Sequence[str]) -> dict[str, int]:
        rows = await self._pool.fetch(
            "SELECT thread_id, version FROM ztate.threads WHERE thread_id = ANY($1::text[])",
            list(thread_ids),
        )
        return {r["thread_id"]: r["version"] for r in rows}

    @translated
    async def commit(
        self,
        sealed: SealedRecord,
        state_bytes: bytes,
        *,
        expected_version: int,
        committed_at: datetime,
        idempotency_key: str,
        request_digest: str,
        woken: Sequence[str] = (),
        lease: LeaseClaim | None = None,
    ) -> Commit:
        """In one statement: the compare-and-swap, the ledger insert and the nodes the
        version wakes (under a ``lease``, its fence and release too); with the commits
        that arrive meanwhile, when the store is under load (``group_commit``; a leased
        commit alone). The woken nodes are announced once it committed."""
        record: dict[str, Any] = sealed.record
        started = time.perf_counter()
        outcome = await self._committer.commit(
            (
                record["thread_id"],
                expected_version,
                record["version"],
                sealed.digest,
                state_bytes,
                record["parent_digest"],
                record["node_id"],
                sealed.key_id,
                sealed.signature,
                committed_at,
                sealed.record_bytes,
                idempotency_key,
                request_digest,
                list(woken),
                None if lease is None else lease.node,
                None if lease is None else lease.epoch,
            )
        )
        self._metrics.commit_duration.record(time.perf_counter() - started)
        if lease is not None and outcome.commit is Commit.COMMITTED:
            lease.settled, lease.more = True, outcome.more
        if outcome.commit is Commit.COMMITTED:
            await self._announce(record["thread_id"] if outcome.watched else None, woken)
        return outcome.commit

    async def _announce(self, watched_thread: str | None, woken: Sequence[str]) -> None:
        """Tell the replicas about a commit that is durable already: best effort. A
        failure here must not answer the commit as failed (the caller would count a
        committed proposal as refused, and its retry replays without announcing
        anything); the work dispatchers poll, and a watcher re-reads on its next
        wake-up."""
        try:
            if watched_thread is not None:
                await announce_commit(self._pool, watched_thread)
            if woken:
                await announce_work(self._pool, woken)
        except Exception as failure:  # logged: the commit stands
            log.warning("announcing a commit failed: %s", type(failure).__name__)

    async def _commit_alone(self, args: CommitArgs) -> CommitOutcome:
        """The one-row statement (``COMMIT``)."""
        try:
            answer: int | None = await self._pool.fetchval(COMMIT, *args)
        except asyncpg.UniqueViolationError:
            # the whole call, head update included, rolled back
            return CommitOutcome(Commit.KEY_TAKEN, watched=False)
        return commit_outcome(answer)

    @translated
    async def find_by_idempotency_key(
        self, thread_id: str, node_id: str, idempotency_key: str
    ) -> StoredTransition | None:
        row = await self._pool.fetchrow(
            f"SELECT {TRANSITION_COLUMNS} FROM ztate.transitions "  # noqa: S608 - constant columns
            "WHERE thread_id = $1 AND node_id = $2 AND idempotency_key = $3",
            thread_id,
            node_id,
            idempotency_key,
        )
        return StoredTransition.from_row(row) if row else None

    @translated
    async def transition_by_digest(self, digest: str) -> StoredTransition | None:
        row = await self._pool.fetchrow(
            f"SELECT {TRANSITION_COLUMNS} FROM ztate.transitions WHERE digest = $1",  # noqa: S608
            digest,
        )
        return StoredTransition.from_row(row) if row else None

    @translated
    async def transition_at(self, thread_id: str, version: int) -> StoredTransition | None:
        row = await self._pool.fetchrow(TRANSITION_AT, thread_id, version)
        return StoredTransition.from_row(row) if row else None

    @translated
    async def head_transition(self, thread_id: str) -> StoredTransition | None:
        row = await self._pool.fetchrow(HEAD_TRANSITION, thread_id)
        return StoredTransition.from_row(row) if row else None

    @translated
    async def genesis(self, thread_id: str) -> Genesis | None:
        row = await self._pool.fetchrow(GENESIS, thread_id)
        if row is None:
            return None
        fields = dict(row.items())
        policy_name = fields.pop("policy_name")
        return Genesis(StoredTransition(**fields), policy_name)

    @translated
    async def evidence(self, digest: str) -> Evidence:
        """The receipt a record was committed under and the rules its proposal matched."""
        row = await self._pool.fetchrow(EVIDENCE, digest)
        if row is None:
            return Evidence(None, None, None, [])
        return Evidence(
            row["receipt"], row["receipt_signature"], row["receipt_key_id"], row["risk_rules"]
        )

    @translated
    async def versions_after(self, thread_id: str, version: int, limit: int) -> list[VersionState]:
        """Up to ``limit`` versions newer than ``version``, oldest first."""
        rows = await self._pool.fetch(
            "SELECT version, digest, state FROM ztate.transitions "
            "WHERE thread_id = $1 AND version > $2 ORDER BY version LIMIT $3",
            thread_id,
            version,
            limit,
        )
        return [VersionState(r["version"], r["digest"], r["state"]) for r in rows]

    @translated
    async def watch_thread(self, thread_id: str, backend: Backend) -> None:
        """Have commits of ``thread_id`` announced (migration 0008): the replica whose
        LISTEN connection is ``backend`` watches it (migration 0009)."""
        await self._pool.execute(
            "INSERT INTO ztate.watched_threads (thread_id, backend_pid, backend_start) "
            "VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
            thread_id,
            backend.pid,
            backend.started,
        )

    @translated
    async def unwatch_thread(self, thread_id: str, backend: Backend) -> None:
        await self._pool.execute(
            "DELETE FROM ztate.watched_threads "
            "WHERE thread_id = $1 AND backend_pid = $2 AND backend_start = $3",
            thread_id,
            backend.pid,
            backend.started,
        )

    @translated
    async def latest_checkpoint(self, thread_id: str) -> CheckpointRow | None:
        row = await self._pool.fetchrow(
            "SELECT checkpoint, signature, key_id FROM ztate.checkpoints "
            "WHERE thread_id = $1 ORDER BY version DESC LIMIT 1",
            thread_id,
        )
        return CheckpointRow(row["checkpoint"], row["signature"], row["key_id"]) if row else None

    @translated
    async def records_after(
        self, thread_id: str, version: int, limit: int
    ) -> list[StoredTransition]:
        rows = await self._pool.fetch(
            f"SELECT {TRANSITION_COLUMNS} FROM ztate.transitions "  # noqa: S608 - constant columns
            "WHERE thread_id = $1 AND version > $2 ORDER BY version LIMIT $3",
            thread_id,
            version,
            limit,
        )
        return [StoredTransition.from_row(row) for row in rows]

    @translated
    async def state_at(self, thread_id: str, version: int) -> KeptState | None:
        row = await self._pool.fetchrow(STATE_AT, thread_id, version)
        return None if row is None else KeptState(row["state"])

    @translated
    async def unsigned_heads(self, limit: int, after: str = "") -> list[UnsignedHead]:
        rows = await self._pool.fetch(UNSIGNED_HEADS, limit, after)
        return [UnsignedHead(r["thread_id"], r["version"], r["head_digest"]) for r in rows]

    @translated
    async def save_checkpoints(
        self, checkpoints: Sequence[tuple[UnsignedHead, SignedCheckpoint, datetime]]
    ) -> None:
        if checkpoints:
            await self._pool.executemany(
                SAVE_CHECKPOINT,
                [
                    (
                        head.thread_id,
                        head.version,
                        head.head_digest,
                        signed.checkpoint,
                        signed.signature,
                        signed.key_id,
                        signed_at,
                    )
                    for head, signed, signed_at in checkpoints
                ],
            )

    @translated
    async def park(
        self, pending: PendingTransition, state_bytes: bytes, lease: LeaseClaim | None = None
    ) -> Parking:
        parked: bool | None = await self._pool.fetchval(
            PARK,
            pending.thread_id,
            pending.digest,
            pending.base_version,
            pending.parent_digest,
            pending.node_id,
            pending.proposal,
            state_bytes,
            pending.risk_rules,
            pending.idempotency_key,
            pending.request_digest,
            pending.parked_at,
            pending.sensitive_keys,
            pending.required_approvals,
            None if lease is None else lease.node,
            None if lease is None else lease.epoch,
        )
        if parked is None:
            return Parking(Park.LEASE_LOST, None)
        if parked:
            return Parking(Park.PARKED, replace(pending, status="pending"))
        existing = await self.find_pending(
            pending.thread_id, pending.node_id, pending.idempotency_key
        ) or await self.pending_by_digest(pending.digest)
        if existing is None:
            return Parking(Park.KEY_TAKEN, None)
        return Parking(Park.ALREADY_PARKED, existing)

    @translated
    async def find_pending(
        self, thread_id: str, node_id: str, idempotency_key: str
    ) -> PendingTransition | None:
        row = await self._pool.fetchrow(FIND_PENDING, thread_id, node_id, idempotency_key)
        return PendingTransition.from_row(row) if row else None

    @translated
    async def pending_by_digest(self, digest: str) -> PendingTransition | None:
        row = await self._pool.fetchrow(
            f"SELECT {PENDING_COLUMNS} FROM ztate.pending_transitions WHERE digest = $1",  # noqa: S608
            digest,
        )
        return PendingTransition.from_row(row) if row else None

    @translated
    async def refusal_at_commit(self, pending: PendingTransition) -> str | None:
        """The reason an approved transition was refused when it came to commit."""
        reason: str | None = await self._pool.fetchval(
            REFUSAL_AT_COMMIT,
            pending.thread_id,
            pending.node_id,
            pending.base_version,
        )
        return reason

    @translated
    async def pending_summary(self) -> tuple[int, datetime | None]:
        row = await self._pool.fetchrow(
            "SELECT count(*), min(parked_at) FROM ztate.pending_transitions "
            "WHERE status = 'pending'"
        )
        assert row is not None  # an aggregate always returns its row
        return row[0], row[1]

    @translated
    async def record_rejection(self, rejection: Rejection) -> None:
        # the refused request may carry what PostgreSQL's text refuses (U+0000)
        rejection = storable_rejection(rejection)
        await self._pool.execute(
            "INSERT INTO ztate.rejections (method, node_id, thread_id, base_version, reason, keys, "
            "patch_digest, patch_bytes, message) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            rejection.method,
            rejection.node_id,
            rejection.thread_id,
            rejection.base_version,
            rejection.reason,
            list(rejection.keys),
            rejection.patch_digest,
            rejection.patch_bytes,
            rejection.message,
        )


MAX_REJECTION_TEXT = 1024


def storable_text(text: str, limit: int = MAX_REJECTION_TEXT) -> str:
    """``text`` as PostgreSQL's text can hold it: U+0000 written as the six characters
    ``\\u0000`` (so it stays visible to an auditor), cut to ``limit`` characters."""
    return text.replace("\x00", "\\u0000")[:limit]


def storable_rejection(rejection: Rejection) -> Rejection:
    return replace(
        rejection,
        method=storable_text(rejection.method),
        node_id=storable_text(rejection.node_id),
        thread_id=None if rejection.thread_id is None else storable_text(rejection.thread_id),
        keys=[storable_text(key) for key in rejection.keys],
        patch_digest=(
            None if rejection.patch_digest is None else storable_text(rejection.patch_digest)
        ),
        message=storable_text(rejection.message),
    )
