"""The store's reads of one row keep their index probes whatever the statistics their
plan was made with (``record_at`` in ``ztate.services.store.transitions``).

Each read is a prepared statement of a pooled connection, and after five runs Postgres
keeps a generic plan for it, made with the statistics of that moment, until an ANALYZE
of its tables. On a fresh database (tables never analysed: autovacuum is off here, so
none replaces a plan behind the test's back) the reads below were planned to read all of
a thread's versions or parked proposals, all committed parked proposals, or all of a
node's rejections, to find one row; those plans stayed as the tables grew. Here each
read runs eight times while the tables hold a few rows, the tables grow to thousands of
rows of one thread and node, and each read runs again on the same connection:
Postgres's own counters (``pg_stat_user_tables``, ``pg_stat_user_indexes``) must show
index probes, one entry a read, and no sequential scan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

from tests.harness import fresh_database
from tests.integration.test_store_conformance import NODE, commit, new_thread, pending
from tests.integration.test_watch_limits import eventually
from ztate.approval_service.app import migrate_approvals
from ztate.approval_service.store import (
    APPROVED,
    EXPIRED,
    OPEN,
    REJECTED,
    STATUSES,
    Cursor,
    ReviewStore,
)
from ztate.contract.keyring import Keyring
from ztate.services.runtime.config import Settings
from ztate.services.store.approvals import ApprovalStore
from ztate.services.store.migrate import migrate
from ztate.services.store.rows import Evidence, Rejection
from ztate.services.store.transitions import PostgresTransitionStore, keep_session

TABLES = ("threads", "transitions", "pending_transitions", "rejections")
GROWN_TO = 2003  # the thread's head version once grown: 2,000 versions more
TINY_RUNS = 8  # more than the five after which Postgres keeps a generic plan
RUNS = 3
PARKED_AT_1000 = f"{1000 + 200000:064x}"  # the digest of the parked proposal of version 1000


@dataclass(frozen=True, slots=True)
class Reads:
    """What one table's counters say was read: scans of any kind, sequential scans,
    and rows (sequential) plus entries (of all its indexes) read."""

    scans: int
    seq_scans: int
    rows: int


async def reads(admin: asyncpg.Connection, table: str) -> Reads:
    """``table`` is ``relname`` in the schema ztate, or ``schema.relname``."""
    schema, _, name = table.rpartition(".")
    await admin.execute("SELECT pg_catalog.pg_stat_clear_snapshot()")
    row = await admin.fetchrow(
        "SELECT t.seq_scan + coalesce(t.idx_scan, 0) AS scans, t.seq_scan, "
        "       t.seq_tup_read + (SELECT coalesce(sum(i.idx_tup_read), 0) "
        "                           FROM pg_catalog.pg_stat_user_indexes i "
        "                          WHERE i.relid = t.relid) AS rows "
        "  FROM pg_catalog.pg_stat_user_tables t "
        " WHERE t.schemaname = $1 AND t.relname = $2",
        schema or "ztate",
        name,
    )
    assert row is not None
    return Reads(row["scans"], row["seq_scan"], int(row["rows"]))


@dataclass
class Outbox:
    admin: asyncpg.Connection
    pool: asyncpg.Pool


@dataclass
class Grown:
    admin: asyncpg.Connection
    pool: asyncpg.Pool
    store: PostgresTransitionStore
    approvals: ApprovalStore
    thread_id: str


@pytest_asyncio.fixture
async def grown(
    postgres_server_dsn: str, settings: Settings, keyring: Keyring
) -> AsyncIterator[tuple[Grown, Callable[[], Awaitable[None]]]]:
    """A fresh database, one pooled connection, one thread of a few versions; and the
    function that grows its tables (2,000 versions, committed parked proposals and
    rejections of that thread and node)."""
    dsn = await fresh_database(postgres_server_dsn)
    admin = await asyncpg.connect(dsn)
    await migrate(admin, settings.db_role)
    for table in TABLES:  # no ANALYZE may replace a plan behind the test's back
        await admin.execute(f"ALTER TABLE ztate.{table} SET (autovacuum_enabled = false)")
    pool = await asyncpg.create_pool(
        dsn,
        min_size=1,
        max_size=1,  # one connection: one plan cache, the one every read below uses
        reset=keep_session,
        server_settings={"role": settings.db_role},
    )
    store = PostgresTransitionStore(pool)
    thread_id, genesis = await new_thread(store, keyring)
    parent = genesis.digest
    for version in range(1, 4):
        _, record = await commit(store, keyring, thread_id, version, parent, f"k-{version}")
        parent = record.digest
    for method in ("ApplyDecision", "ProposeTransition"):
        await store.record_rejection(rejection(thread_id, method, 2, "NOT_THE_ONE"))

    async def grow() -> None:
        # versions 4 to 2003 of the thread, the head moved there, the last committed
        # under a receipt; every one's parked proposal committed, the head's parked
        # first (the status index lists it last); the node's rejections
        await admin.execute(
            "INSERT INTO ztate.transitions (thread_id, version, digest, parent_digest, "
            "node_id, key_id, signature, record, state, committed_at, idempotency_key, "
            "request_digest, receipt) "
            "SELECT $1, g, lpad(to_hex(g), 64, '0'), lpad(to_hex(g + 100000), 64, '0'), $2, "
            "'k', repeat('b', 64), convert_to('{\"patch\":{\"k\":1}}', 'UTF8'), '\\x7b7d', "
            "now(), 'k-' || g, 'r', CASE WHEN g = $3 THEN '\\x72'::bytea END "
            "FROM generate_series(4, $3::bigint) g",
            thread_id,
            NODE,
            GROWN_TO,
        )
        await admin.execute(
            "UPDATE ztate.threads SET version = $2, "
            "head_digest = lpad(to_hex($2::bigint), 64, '0') WHERE thread_id = $1",
            thread_id,
            GROWN_TO,
        )
        await admin.execute(
            "INSERT INTO ztate.pending_transitions (digest, thread_id, base_version, "
            "parent_digest, node_id, proposal, state, risk_rules, idempotency_key, "
            "request_digest, status, parked_at) "
            "SELECT lpad(to_hex(g + 200000), 64, '0'), $1, g - 1, repeat('c', 64), $2, "
            "'\\x7b7d', '\\x7b7d', ARRAY['rule-' || g], 'k-' || g, 'r', 'committed', "
            "now() - make_interval(secs => g) "
            "FROM generate_series(4, $3::bigint) g",
            thread_id,
            NODE,
            GROWN_TO,
        )
        await admin.execute(
            "INSERT INTO ztate.rejections (method, node_id, thread_id, base_version, reason, "
            "message) SELECT CASE WHEN g % 2 = 0 THEN 'ApplyDecision' "
            "ELSE 'ProposeTransition' END, $2, $1, g, 'OTHER', 'm' "
            "FROM generate_series(1, 2000) g",
            thread_id,
            NODE,
        )

    yield Grown(admin, pool, store, ApprovalStore(pool), thread_id), grow
    await pool.close()
    await admin.close()


def rejection(thread_id: str, method: str, base_version: int, reason: str) -> Rejection:
    return Rejection(
        method=method,
        node_id=NODE,
        thread_id=thread_id,
        base_version=base_version,
        reason=reason,
        keys=[],
        patch_digest=None,
        patch_bytes=None,
        message="refused",
    )


async def counted(
    db: Grown | Outbox, tables: tuple[str, ...], read: Callable[[], Awaitable[Any]]
) -> dict[str, Reads]:
    """What ``RUNS`` runs of ``read`` read of each of ``tables``, once the pooled
    connection has reported its counters (every run scans each table at least once)."""
    # a backend reports what it counted when it goes idle after a forced flush: the
    # pooled connection's earlier reads, and the test's own statements, are in before
    for conn in (db.pool, db.admin):
        await conn.execute("SELECT pg_catalog.pg_stat_force_next_flush()")
    before = {table: await reads(db.admin, table) for table in tables}
    for _ in range(RUNS):
        await read()
    await db.pool.execute("SELECT pg_catalog.pg_stat_force_next_flush()")
    after: dict[str, Reads] = {}

    async def reported() -> bool:
        for table in tables:
            after[table] = await reads(db.admin, table)
        return all(after[t].scans >= before[t].scans + RUNS for t in tables)

    await eventually(reported)
    return {
        t: Reads(
            after[t].scans - before[t].scans,
            after[t].seq_scans - before[t].seq_scans,
            after[t].rows - before[t].rows,
        )
        for t in tables
    }


async def test_reads_of_one_row_probe_by_index_whatever_size_their_plan_was_made_at(
    grown: tuple[Grown, Callable[[], Awaitable[None]]],
) -> None:
    db, grow = grown
    thread_id = db.thread_id
    parked = dataclasses.replace(pending(thread_id, "0" * 64, "k-p", "d" * 64), base_version=2)
    reads_of = {  # each read, with the tables it reads
        "transition_at": (("transitions",), lambda: db.store.transition_at(thread_id, 1)),
        "state_at": (("transitions",), lambda: db.store.state_at(thread_id, 1)),
        "base_of": (("transitions",), lambda: db.approvals.base_of(parked)),
        "head_transition": (
            ("threads", "transitions"),
            lambda: db.store.head_transition(thread_id),
        ),
        "genesis": (("threads", "transitions"), lambda: db.store.genesis(thread_id)),
        "refusal_at_commit": (("rejections",), lambda: db.store.refusal_at_commit(parked)),
        "find_pending": (
            ("pending_transitions",),
            lambda: db.store.find_pending(thread_id, NODE, "k-1000"),
        ),
        "decision_lookup": (
            ("pending_transitions", "threads"),
            lambda: db.approvals.decision_lookup(thread_id, PARKED_AT_1000, "nonce"),
        ),
    }
    for _, read in reads_of.values():  # the plans are made while the tables are tiny
        for _ in range(TINY_RUNS):
            await read()
    head = await db.store.head_transition(thread_id)
    assert head is not None
    for _ in range(TINY_RUNS):
        await db.store.evidence(head.digest)

    await grow()
    await db.store.record_rejection(rejection(thread_id, "ApplyDecision", 2, "THE_ONE"))

    found = {name: await counted(db, tables, read) for name, (tables, read) in reads_of.items()}
    head = await db.store.head_transition(thread_id)
    assert head is not None
    found["evidence"] = await counted(
        db, ("transitions", "pending_transitions"), lambda: db.store.evidence(head.digest)
    )
    # (sequential scans, rows and index entries read) a table, for RUNS runs of each
    assert {
        name: {table: (r.seq_scans, r.rows) for table, r in f.items()} for name, f in found.items()
    } == {name: {table: (0, RUNS) for table in f} for name, f in found.items()}
    # and the answers are the rows asked for
    at_one = await db.store.transition_at(thread_id, 1)
    assert at_one is not None
    assert (at_one.thread_id, at_one.version) == (thread_id, 1)
    assert head.version == GROWN_TO
    assert await db.store.transition_at(thread_id, GROWN_TO) == head
    assert await db.store.transition_at(thread_id, GROWN_TO + 1) is None
    genesis = await db.store.genesis(thread_id)
    assert genesis is not None
    assert genesis.record == await db.store.transition_at(thread_id, 0)
    assert genesis.policy_name == "pipeline"  # new_thread's
    assert await db.store.state_at(thread_id, GROWN_TO + 1) is None
    record, _ = await db.approvals.base_of(dataclasses.replace(parked, base_version=1))
    assert record == at_one.record
    assert await db.store.evidence(head.digest) == Evidence(b"r", None, None, [f"rule-{GROWN_TO}"])
    # a record committed under no receipt names no rules, though a committed parked
    # proposal has its key
    unreceipted = await db.store.transition_at(thread_id, 4)
    assert unreceipted is not None
    assert await db.store.evidence(unreceipted.digest) == Evidence(None, None, None, [])
    assert await db.store.refusal_at_commit(parked) == "THE_ONE"
    found_pending = await db.store.find_pending(thread_id, NODE, "k-1000")
    assert found_pending is not None
    assert (found_pending.digest, found_pending.risk_rules) == (PARKED_AT_1000, ["rule-1000"])
    assert await db.store.find_pending(thread_id, NODE, "k-absent") is None
    looked = await db.approvals.decision_lookup(thread_id, PARKED_AT_1000, "nonce")
    assert looked.pending is not None
    assert (looked.pending.digest, looked.pending.idempotency_key) == (PARKED_AT_1000, "k-1000")
    assert looked.head is not None
    assert (looked.head.version, looked.nonce_used) == (GROWN_TO, False)
    elsewhere = await db.approvals.decision_lookup("other-thread", PARKED_AT_1000, "nonce")
    assert (elsewhere.pending, elsewhere.head) == (None, None)


APPROVER = "ztate_approver"
SIGN_RECEIPTS = (
    "INSERT INTO ztate_approval.reviews (digest, thread_id, base_version, node_id, "
    "risk_rules, required_approvals, proposal, redacted_diff, status, expires_at) "
    "SELECT lpad(to_hex(g), 64, '0'), 't', 0, 'n', '{r}', 1, '\\x00', '\\x00', 'approved', "
    "now() FROM generate_series($1::bigint, $2) g; "
    "INSERT INTO ztate_approval.receipts (digest, receipt, signature, key_id, nonce, "
    "signed_at, delivered_at) "
    "SELECT lpad(to_hex(g), 64, '0'), '\\x00', 's', 'k', 'nonce-' || g, "
    "now() - make_interval(secs => g), CASE WHEN $3 THEN now() END "
    "FROM generate_series($1::bigint, $2) g"
)


async def sign_receipts(admin: asyncpg.Connection, first: int, last: int, delivered: bool) -> None:
    async with admin.transaction():
        for statement in SIGN_RECEIPTS.split("; "):
            arguments = (first, last, delivered) if "$3" in statement else (first, last)
            await admin.execute(statement, *arguments)


async def test_the_approval_outbox_reads_only_the_receipts_it_delivers(
    postgres_server_dsn: str,
) -> None:
    """The approval service's delivery loop polls for undelivered receipts (oldest first)
    and every receipt ever signed is kept: with no index for it, each poll read and
    sorted them all, whatever the statistics (approval migration 0003 adds one)."""
    dsn = await fresh_database(postgres_server_dsn)
    await migrate_approvals(dsn, APPROVER)
    admin = await asyncpg.connect(dsn)
    for table in ("reviews", "receipts"):
        await admin.execute(f"ALTER TABLE ztate_approval.{table} SET (autovacuum_enabled = false)")
    reviews = await ReviewStore.open(dsn, role=APPROVER, pool_size=1)
    try:
        await sign_receipts(admin, 1, 3, delivered=True)
        await sign_receipts(admin, 4, 4, delivered=False)
        for _ in range(TINY_RUNS):  # the plan is made while the outbox holds a few
            assert [e.digest for e in await reviews.undelivered(100)] == [f"{4:064x}"]
        await sign_receipts(admin, 5, 2004, delivered=True)
        await sign_receipts(admin, 2005, 2005, delivered=False)

        found = await counted(
            Outbox(admin, reviews.pool),
            ("ztate_approval.receipts",),
            lambda: reviews.undelivered(100),
        )

        # each poll reads the two entries it returns, and no receipt sequentially
        assert found == {"ztate_approval.receipts": Reads(RUNS, 0, 2 * RUNS)}
        # the oldest first
        assert [e.digest for e in await reviews.undelivered(100)] == [
            f"{2005:064x}",
            f"{4:064x}",
        ]
    finally:
        await reviews.close()
        await admin.close()


BASE = datetime(2026, 1, 1, tzinfo=UTC)
ADD_REVIEWS = (
    "INSERT INTO ztate_approval.reviews (digest, thread_id, base_version, node_id, "
    "risk_rules, required_approvals, proposal, redacted_diff, status, opened_at, expires_at) "
    "SELECT lpad(to_hex(g), 64, '0'), $3, 0, 'n', '{r}', 1, '\\x00', '\\x00', $4, "
    "$5::timestamptz + make_interval(secs => g), $6::timestamptz + make_interval(secs => g) "
    "FROM generate_series($1::bigint, $2) g"
)


async def add_reviews(
    admin: asyncpg.Connection, first: int, last: int, thread_id: str, status: str, days: int
) -> None:
    """Reviews ``first`` to ``last`` (their digests), review g opened g seconds after
    BASE and due ``days`` later."""
    await admin.execute(
        ADD_REVIEWS, first, last, thread_id, status, BASE, BASE + timedelta(days=days)
    )


async def close_approved(reviews: ReviewStore, number: int) -> None:
    """Close review ``number`` as approved, as a decision does."""
    async with reviews.locked(f"{number:064x}") as locked:
        assert locked is not None
        await locked.close(APPROVED, BASE)
        assert (await locked.reread()).status == APPROVED


async def test_the_reviews_reads_and_closes_read_only_the_reviews_they_touch(
    postgres_server_dsn: str,
) -> None:
    """Closing a decided review, the expiry pass and the pages of the review list ran
    plans that, made while the approval service's tables were tiny and never analysed,
    read every open review (the close, the expiry) or every review, sorting those of the
    status (a page: its status a parameter, no index with the thread; whatever the
    statistics). Approval migration 0004 and the statements' wording lead each to the
    reviews it touches."""
    dsn = await fresh_database(postgres_server_dsn)
    await migrate_approvals(dsn, APPROVER)
    admin = await asyncpg.connect(dsn)
    for table in ("reviews", "receipts", "decisions"):
        await admin.execute(f"ALTER TABLE ztate_approval.{table} SET (autovacuum_enabled = false)")
    reviews = await ReviewStore.open(dsn, role=APPROVER, pool_size=1)
    now = BASE + timedelta(days=10)
    after_1000 = Cursor(BASE + timedelta(seconds=1000), f"{1000:064x}")
    # (tables, read) of each read counted
    closing = iter(range(1500, 1500 + RUNS))
    reads_of: dict[str, tuple[tuple[str, ...], Callable[[], Awaitable[Any]]]] = {
        "close": (("ztate_approval.reviews",), lambda: close_approved(reviews, next(closing))),
        "expire_open": (("ztate_approval.reviews",), lambda: reviews.expire_open(now)),
        "open, oldest first": (
            ("ztate_approval.reviews", "ztate_approval.receipts"),
            lambda: reviews.page(OPEN, thread_id=None, limit=10, after=after_1000),
        ),
        "approved, of a thread": (
            ("ztate_approval.reviews", "ztate_approval.receipts"),
            lambda: reviews.page(APPROVED, thread_id="t", limit=10, after=None),
        ),
    }
    try:
        await add_reviews(admin, 1, 2, "t", OPEN, 30)
        await add_reviews(admin, 3, 3, "t", APPROVED, 30)
        await add_reviews(admin, 4, 4, "u", OPEN, 30)
        for _ in range(TINY_RUNS):  # the plans are made while the reviews are a few
            # review 2 is closed at each run: a close is of an open review, so it is
            # opened again before each
            await admin.execute(
                "UPDATE ztate_approval.reviews SET status = 'open', closed_at = NULL "
                "WHERE digest = $1",
                f"{2:064x}",
            )
            await close_approved(reviews, 2)
            assert await reviews.expire_open(now) == []
            for status in STATUSES:
                for thread_id in (None, "t"):
                    await reviews.page(status, thread_id=thread_id, limit=10, after=None)
        # 2,000 open reviews of the thread t, 2,000 approved of u, two overdue
        await add_reviews(admin, 5, 2004, "t", OPEN, 30)
        await add_reviews(admin, 2005, 4004, "u", APPROVED, 30)
        await add_reviews(admin, 4005, 4006, "u", OPEN, 1)

        found = {
            name: await counted(Outbox(admin, reviews.pool), tables, read)
            for name, (tables, read) in reads_of.items()
        }

        # (sequential scans, rows and index entries read) a table, for RUNS runs of each.
        # A close reads its review by key four times (the lock, the read, the close,
        # the read again, which finds the entries of both versions: 5); a page, the
        # reviews it returns (the thread t's approved: 2, 3 and the three just closed)
        expiry = found.pop("expire_open")["ztate_approval.reviews"]
        approved = found.pop("approved, of a thread")
        assert {
            name: {table: (r.seq_scans, r.rows) for table, r in f.items()}
            for name, f in found.items()
        } == {
            "close": {"ztate_approval.reviews": (0, 5 * RUNS)},
            "open, oldest first": {
                "ztate_approval.reviews": (0, 10 * RUNS),
                "ztate_approval.receipts": (0, 0),
            },
        }
        # the thread t's approved: 2, 3 and the three just closed; the first run may also
        # read the three closed reviews' entries of their open versions once, before
        # Postgres marks them dead (a CI run read 18): never any of the 4,000 others
        assert (
            approved["ztate_approval.receipts"].seq_scans,
            approved["ztate_approval.receipts"].rows,
        ) == (0, 0)
        assert approved["ztate_approval.reviews"].seq_scans == 0
        assert 5 * RUNS <= approved["ztate_approval.reviews"].rows <= 5 * RUNS + 3
        # the first expiry pass reads the two overdue reviews and expires them; the next
        # may read their index entries once more before Postgres marks them dead
        assert expiry.seq_scans == 0
        assert 2 <= expiry.rows <= 4
        # and the answers are unchanged: the page after review 1000, oldest first
        page = await reviews.page(OPEN, thread_id=None, limit=10, after=after_1000)
        assert [r.digest for r in page] == [f"{g:064x}" for g in range(1001, 1011)]
        # the decided ones newest first, of any thread or of one
        page = await reviews.page(APPROVED, thread_id=None, limit=3, after=None)
        assert [r.digest for r in page] == [f"{g:064x}" for g in (4004, 4003, 4002)]
        last = Cursor(page[-1].opened_at, page[-1].digest)
        page = await reviews.page(APPROVED, thread_id=None, limit=2, after=last)
        assert [r.digest for r in page] == [f"{g:064x}" for g in (4001, 4000)]
        page = await reviews.page(APPROVED, thread_id="t", limit=10, after=None)
        assert [r.digest for r in page] == [f"{g:064x}" for g in (1502, 1501, 1500, 3, 2)]
        closed = [r.closed_at for r in page]  # review 3 was added approved, with no date
        assert closed == [BASE, BASE, BASE, None, BASE]
        # a close changes an open review or nothing: a close that changed no row ends
        # the decision's transaction (no receipt could be signed for it)
        async with reviews.locked(f"{3:064x}") as locked:
            assert locked is not None
            with pytest.raises(RuntimeError, match=r"^review 0{16} was not closed \(UPDATE 0\)$"):
                await locked.close(REJECTED, BASE + timedelta(days=1))
        status = "SELECT status, closed_at FROM ztate_approval.reviews WHERE digest = $1"
        assert tuple(await admin.fetchrow(status, f"{3:064x}")) == (APPROVED, None)
        page = await reviews.page(OPEN, thread_id="u", limit=10, after=None)
        assert [r.digest for r in page] == [f"{4:064x}"]  # 4005 and 4006 expired
        page = await reviews.page(OPEN, thread_id="t", limit=2, after=None)
        assert [r.digest for r in page] == [f"{1:064x}", f"{5:064x}"]
        # the overdue reviews were expired once, at the first pass; none other since
        expired = await reviews.page(EXPIRED, thread_id=None, limit=10, after=None)
        assert [(r.digest, r.closed_at) for r in expired] == [
            (f"{4006:064x}", now),
            (f"{4005:064x}", now),
        ]
        # at its deadline a review is not yet overdue; a microsecond after, it is
        due = BASE + timedelta(days=30, seconds=1)
        assert await reviews.expire_open(due) == []
        assert [r.digest for r in await reviews.expire_open(due + timedelta(microseconds=1))] == [
            f"{1:064x}"
        ]
    finally:
        await reviews.close()
        await admin.close()
