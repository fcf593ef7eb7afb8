"""The database itself enforces what the service promises: append-only history,
least privilege for the service role, idempotent numbered migrations."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg
import pytest
import pytest_asyncio

from tests.harness import Ledger, Pki, act, client, fresh_database, new_thread_id, with_database
from tests.integration.test_store_conformance import new_thread, pending, sealed
from tests.integration.test_watch_limits import eventually
from ztate.contract.canonical import sha256_hex
from ztate.contract.keyring import Keyring
from ztate.contract.record import GENESIS_PARENT
from ztate.services.runtime.config import Settings
from ztate.services.store import migrate as migrations
from ztate.services.store.interface import Commit, Creation, LeaseClaim, Park
from ztate.services.store.transitions import PostgresTransitionStore
from ztate.services.store.work import RELEASE, WorkStore
from ztate.transition_service.app import RunningService
from ztate.worker_sdk import StaleVersion

SERVICE_ROLE = "ztate_transition"


@pytest_asyncio.fixture
async def committed_thread(target: str, pki: Pki, ledger: Ledger) -> str:
    """A thread with two ledger records and one rejection."""
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, {"raw_text": "x"}, policy="pipeline")
    async with client(target, pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 0, {"requested_action": act("y")})
        with pytest.raises(StaleVersion):
            await parser.propose(thread_id, 0, {"requested_action": act("z")})
    assert len(await ledger.rejections(thread_id)) == 1
    return thread_id


@pytest_asyncio.fixture
async def superuser(database_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_dsn)
    yield conn
    await conn.close()


@pytest_asyncio.fixture
async def as_service_role(database_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A session with exactly the privileges the running service has."""
    conn = await asyncpg.connect(database_dsn, server_settings={"role": SERVICE_ROLE})
    assert await conn.fetchval("SELECT current_user") == SERVICE_ROLE
    yield conn
    await conn.close()


@pytest_asyncio.fixture
async def own_store(
    postgres_server_dsn: str, settings: Settings
) -> AsyncIterator[PostgresTransitionStore]:
    """A transition store on a database of its own: what a test parks there is no other
    test's services' work (their approval outboxes submit every parked proposal of
    their database)."""
    dsn = await fresh_database(postgres_server_dsn)
    admin = await asyncpg.connect(dsn)
    try:
        await migrations.migrate(admin, settings.db_role)
    finally:
        await admin.close()
    pool = await asyncpg.create_pool(
        dsn, min_size=1, max_size=3, server_settings={"role": settings.db_role}
    )
    try:
        yield PostgresTransitionStore(pool)
    finally:
        await pool.close()


REWRITES = [
    "UPDATE ztate.transitions SET node_id = 'spiffe://ztate.test/node/db-writer' "
    "WHERE thread_id = $1",
    "UPDATE ztate.transitions SET record = '\\x7b7d'::bytea WHERE thread_id = $1",
    "DELETE FROM ztate.transitions WHERE thread_id = $1",
    "UPDATE ztate.rejections SET reason = 'X' WHERE thread_id = $1",
    "DELETE FROM ztate.rejections WHERE thread_id = $1",
]


@pytest.mark.parametrize("statement", REWRITES)
async def test_service_role_cannot_rewrite_history(
    as_service_role: asyncpg.Connection, committed_thread: str, ledger: Ledger, statement: str
) -> None:
    before = (await ledger.rows(committed_thread), await ledger.rejections(committed_thread))
    with pytest.raises(asyncpg.InsufficientPrivilegeError) as caught:
        await as_service_role.execute(statement, committed_thread)
    assert "permission denied" in str(caught.value)
    assert (
        await ledger.rows(committed_thread),
        await ledger.rejections(committed_thread),
    ) == before
    assert await ledger.verify(committed_thread) == 2


@pytest.mark.parametrize("table", ["ztate.transitions", "ztate.rejections", "ztate.threads"])
async def test_service_role_cannot_truncate(
    as_service_role: asyncpg.Connection, table: str
) -> None:
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await as_service_role.execute(f"TRUNCATE {table}")


async def test_service_role_cannot_repoint_a_thread_policy(
    as_service_role: asyncpg.Connection, committed_thread: str
) -> None:
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await as_service_role.execute(
            "UPDATE ztate.threads SET policy_digest = 'forged' WHERE thread_id = $1",
            committed_thread,
        )


@pytest.mark.parametrize("statement", REWRITES)
async def test_trigger_refuses_even_a_superuser(
    superuser: asyncpg.Connection, committed_thread: str, ledger: Ledger, statement: str
) -> None:
    before = (await ledger.rows(committed_thread), await ledger.rejections(committed_thread))
    with pytest.raises(asyncpg.InsufficientPrivilegeError) as caught:
        await superuser.execute(statement, committed_thread)
    assert "append-only" in str(caught.value)
    assert (
        await ledger.rows(committed_thread),
        await ledger.rejections(committed_thread),
    ) == before


@pytest.mark.parametrize("table", ["ztate.transitions", "ztate.rejections"])
async def test_trigger_refuses_truncate_by_a_superuser(
    superuser: asyncpg.Connection, table: str
) -> None:
    with pytest.raises(asyncpg.InsufficientPrivilegeError) as caught:
        await superuser.execute(f"TRUNCATE {table} CASCADE")
    assert "append-only" in str(caught.value)


async def test_migrations_apply_once_and_refuse_edits(postgres_server_dsn: str) -> None:
    name = f"ztate_migrate_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(postgres_server_dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    conn = await asyncpg.connect(with_database(postgres_server_dsn, name))
    try:
        first = await migrations.migrate(conn, "ztate_migrate_role")
        assert first == [f"{m.number:04d}_{m.name}" for m in migrations.bundled_migrations()]
        assert await migrations.migrate(conn, "ztate_migrate_role") == []
        await conn.execute(
            "UPDATE public.ztate_schema_migrations SET checksum = 'edited' WHERE number = 1"
        )
        with pytest.raises(migrations.MigrationError, match="was changed after it was applied"):
            await migrations.migrate(conn, "ztate_migrate_role")
    finally:
        await conn.close()


async def test_a_ledger_row_of_a_few_kilobytes_is_stored_inline_and_uncompressed(
    service: RunningService, keyring: Keyring, superuser: asyncpg.Connection
) -> None:
    """A 3 KB transition (a 1.5 KB opaque value in its patch and in its state) is stored
    as it is, in the ledger's heap: no compression tried, nothing moved to the TOAST
    table, so neither the insert nor any reader of the record pays for either
    (migration 0021)."""
    thread_id, genesis = await new_thread(service.store, keyring)
    opaque = secrets.token_urlsafe(1125)  # 1,500 characters, as a receipt is
    record, state = sealed(keyring, thread_id, 1, genesis.digest, {"raw_text": opaque})
    assert len(record.record_bytes) + len(state) > 3000  # over the default 2 KB threshold
    toast = await superuser.fetchval(
        "SELECT reltoastrelid::regclass::text FROM pg_catalog.pg_class "
        "WHERE oid = 'ztate.transitions'::regclass"
    )
    chunks = f"SELECT count(*) FROM {toast}"  # noqa: S608 - a relation name from the catalog
    before = await superuser.fetchval(chunks)

    result = await service.store.commit(
        record,
        state,
        expected_version=0,
        committed_at=datetime.now(UTC),
        idempotency_key="inline-1",
        request_digest=sha256_hex(b"inline-1"),
    )

    assert result is Commit.COMMITTED
    stored = await superuser.fetchrow(
        "SELECT record, state, pg_catalog.pg_column_compression(record) AS record_compression, "
        "pg_catalog.pg_column_compression(state) AS state_compression "
        "FROM ztate.transitions WHERE thread_id = $1 AND version = 1",
        thread_id,
    )
    assert (stored["record"], stored["state"]) == (record.record_bytes, state)
    assert (stored["record_compression"], stored["state_compression"]) == (None, None)
    assert await superuser.fetchval(chunks) == before  # nothing moved out of line


async def test_a_head_update_stays_on_its_page_while_old_versions_cannot_be_pruned(
    database_dsn: str, service: RunningService, keyring: Keyring, superuser: asyncpg.Connection
) -> None:
    """Each commit rewrites its thread's head row. Under load the dead versions of a page
    cannot be pruned at once (another transaction still sees them, or holds the page),
    and an update finding no room on its page went to another one: a new entry in the
    heads' index and a head table that grew by the megabyte. The heads are stored with
    room for their next versions (migration 0022): twelve 1.7 KB heads, each updated once
    while a repeatable-read snapshot keeps every old version, all stay on their pages.
    Their only index is on thread_id, which no commit changes: an update that stays on
    its page is a heap-only tuple (HOT), with no index entry added."""
    heads: dict[str, str] = {}
    for _ in range(12):  # heads of 1.7 KB, as their next versions
        thread_id = new_thread_id()
        state = {"raw_text": secrets.token_urlsafe(1200)}
        genesis, state_bytes = sealed(keyring, thread_id, 0, GENESIS_PARENT, state)
        created = await service.store.create_thread(
            genesis, state_bytes, policy_name="pipeline", committed_at=datetime.now(UTC)
        )
        assert created is Creation.CREATED
        heads[thread_id] = genesis.digest
    pages = (
        "SELECT thread_id, (ctid::text::point)[0]::bigint AS page FROM ztate.threads "
        "WHERE thread_id = ANY($1)"
    )
    before = {r["thread_id"]: r["page"] for r in await superuser.fetch(pages, list(heads))}
    keeper = await asyncpg.connect(database_dsn)
    try:
        async with keeper.transaction(isolation="repeatable_read"):
            await keeper.fetchval("SELECT count(*) FROM ztate.threads")  # the snapshot
            for thread_id, parent in heads.items():
                opaque = secrets.token_urlsafe(1200)
                record, state_bytes = sealed(keyring, thread_id, 1, parent, {"raw_text": opaque})
                committed = await service.store.commit(
                    record,
                    state_bytes,
                    expected_version=0,
                    committed_at=datetime.now(UTC),
                    idempotency_key=f"room-{thread_id}",
                    request_digest=sha256_hex(thread_id.encode()),
                )
                assert committed is Commit.COMMITTED
            after = {r["thread_id"]: r["page"] for r in await superuser.fetch(pages, list(heads))}
    finally:
        await keeper.close()
    assert after == before


async def test_a_park_under_a_lease_holds_the_lease_until_the_parked_row_commits(
    own_store: PostgresTransitionStore, keyring: Keyring
) -> None:
    """The park fences its lease in its own transaction (migration 0024): it locks the
    grant's row FOR SHARE, so that no release (and no new grant) can change the lease
    between the fence and the parked row's commit, which would leave a stale holder's
    proposal parked. While a park's transaction is open, a release of that grant waits
    for it (here: refused by a 200 ms lock_timeout); once it has committed, the release
    goes through."""
    store = own_store
    work = WorkStore(store.pool)
    thread_id = new_thread_id()
    genesis, state = sealed(keyring, thread_id, 0, GENESIS_PARENT, {"raw_text": "v0"})
    created = await store.create_thread(
        genesis, state, policy_name="pipeline", committed_at=datetime.now(UTC), woken=["n"]
    )
    assert created is Creation.CREATED
    lease = await work.acquire(thread_id, "n", "holder", 30.0)
    assert lease is not None
    async with store.pool.acquire() as parking_conn, store.pool.acquire() as other:
        open_park = parking_conn.transaction()
        await open_park.start()
        try:
            # the store's park, on a connection whose transaction stays open
            in_transaction = PostgresTransitionStore(parking_conn)  # type: ignore[arg-type]
            parking = await in_transaction.park(
                pending(thread_id, genesis.digest, "held-1", "d4" * 32),
                b"{}",
                LeaseClaim("n", lease.epoch),
            )
            assert parking.outcome is Park.PARKED
            async with other.transaction():
                await other.execute("SET LOCAL lock_timeout = '200ms'")
                with pytest.raises(asyncpg.LockNotAvailableError):
                    await other.fetchrow(RELEASE, thread_id, "n", lease.epoch, -1)
        except BaseException:
            await open_park.rollback()
            raise
        await open_park.commit()
    assert await work.holds(thread_id, "n", lease.epoch)  # the park left it held
    assert await work.release(thread_id, "n", lease.epoch, -1) is not None


async def test_the_park_of_the_release_before_still_parks_during_a_rolling_upgrade(
    own_store: PostgresTransitionStore, keyring: Keyring
) -> None:
    """Migration 0024 adds the park with a lease fence as a new function: the 13-argument
    one that replicas of the release before call stays, so that during a rolling upgrade
    their risky proposals still park instead of failing on a missing function."""
    thread_id, genesis = await new_thread(own_store, keyring)
    old = pending(thread_id, genesis.digest, "old-release", "e5" * 32)
    parked = await own_store.pool.fetchval(
        "SELECT ztate.park_transition($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
        old.thread_id,
        old.digest,
        old.base_version,
        old.parent_digest,
        old.node_id,
        old.proposal,
        b"{}",
        old.risk_rules,
        old.idempotency_key,
        old.request_digest,
        old.parked_at,
        old.sensitive_keys,
        old.required_approvals,
    )
    assert parked is True
    found = await own_store.pending_by_digest(old.digest)
    assert found is not None
    assert (found.thread_id, found.idempotency_key) == (thread_id, "old-release")


@dataclass(frozen=True)
class MigrationsUpTo(migrations.MigrationSet):
    """The transition service's migrations as a release that ended at ``last`` shipped."""

    last: int = 0

    def bundled(self) -> list[migrations.Migration]:
        return [m for m in super().bundled() if m.number <= self.last]


async def test_an_index_left_invalid_by_a_failed_concurrent_build_fails_its_migration(
    postgres_server_dsn: str,
) -> None:
    """Operators are told to build migration 0025's index with CREATE INDEX CONCURRENTLY
    beforehand on a large rejections table. A concurrent build that failed leaves an
    invalid index of that name, which the planner never uses and CREATE INDEX IF NOT
    EXISTS would take for done: the migration fails naming it, and is not recorded."""
    conn = await asyncpg.connect(await fresh_database(postgres_server_dsn))
    roles = {
        ":service_role": "ztate_invalid_role",
        ":reader_role": "ztate_reader",
        ":pruner_role": migrations.PRUNER_ROLE,
    }
    every = migrations.TRANSITION_MIGRATIONS
    try:
        before = MigrationsUpTo(every.package, every.table, every.lock, last=24)
        await migrations.apply_migrations(conn, before, roles)
        await conn.execute(
            "CREATE INDEX rejections_at_commit ON ztate.rejections "
            "(thread_id, node_id, base_version, id) WHERE method = 'ApplyDecision'; "
            "UPDATE pg_catalog.pg_index SET indisvalid = false "  # as a failed build leaves it
            "WHERE indexrelid = 'ztate.rejections_at_commit'::regclass"
        )
        with pytest.raises(
            asyncpg.RaiseError,
            match=r"^the index ztate.rejections_at_commit exists but is not valid \(a "
            r"CREATE INDEX CONCURRENTLY that failed\?\): drop it, then migrate again$",
        ):
            await migrations.apply_migrations(conn, every, roles)
        assert await conn.fetchval("SELECT max(number) FROM public.ztate_schema_migrations") == 24
        await conn.execute("DROP INDEX ztate.rejections_at_commit")
        assert await migrations.apply_migrations(conn, every, roles) == [
            f"{m.number:04d}_{m.name}" for m in every.bundled() if m.number > 24
        ]
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("last", "index", "definition"),
    [
        pytest.param(
            2,
            "receipts_undelivered",
            "ON ztate_approval.receipts (signed_at, digest) WHERE delivered_at IS NULL",
            id="0003",
        ),
        pytest.param(
            3,
            "reviews_by_thread",
            "ON ztate_approval.reviews (thread_id, status, opened_at, digest)",
            id="0004",
        ),
    ],
)
async def test_an_invalid_index_of_the_approval_outbox_fails_its_migration(
    postgres_server_dsn: str, last: int, index: str, definition: str
) -> None:
    """The approval service's migrations 0003 (the outbox's receipts_undelivered) and
    0004 (the reviews' indexes, one of three names here) likewise refuse an invalid
    index of a name they build (a failed concurrent build), are not recorded, and apply
    once it is dropped."""
    from ztate.approval_service.app import APPROVAL_MIGRATIONS

    conn = await asyncpg.connect(await fresh_database(postgres_server_dsn))
    roles = {":approval_role": "ztate_invalid_approver"}
    every = APPROVAL_MIGRATIONS
    try:
        before = MigrationsUpTo(every.package, every.table, every.lock, last=last)
        await migrations.apply_migrations(conn, before, roles)
        await conn.execute(
            f"CREATE INDEX {index} {definition}; "  # noqa: S608 - the test's constants
            "UPDATE pg_catalog.pg_index SET indisvalid = false "  # as a failed build leaves it
            f"WHERE indexrelid = 'ztate_approval.{index}'::regclass"
        )
        with pytest.raises(
            asyncpg.RaiseError,
            match=rf"^the index ztate_approval.{index} exists but is not valid "
            r"\(a CREATE INDEX CONCURRENTLY that failed\?\): drop it, then migrate again$",
        ):
            await migrations.apply_migrations(conn, every, roles)
        recorded = f"SELECT max(number) FROM public.{every.table}"  # noqa: S608 - a constant
        assert await conn.fetchval(recorded) == last
        await conn.execute(f"DROP INDEX ztate_approval.{index}")
        assert await migrations.apply_migrations(conn, every, roles) == [
            f"{m.number:04d}_{m.name}" for m in every.bundled() if m.number > last
        ]
    finally:
        await conn.close()


async def test_two_databases_migrating_at_once_share_the_roles_one_creates(
    postgres_server_dsn: str,
) -> None:
    """Roles are the cluster's: a second deployment's migration on another database may
    create the service's role while this one's CREATE waits on the catalog. This
    migration then uses that role and applies every migration, instead of failing with a
    unique violation (seen as two test workers on one server)."""
    role = f"ztate_race_{uuid.uuid4().hex[:12]}"
    roles = {":service_role": role, ":reader_role": role, ":pruner_role": role}
    other = await asyncpg.connect(await fresh_database(postgres_server_dsn))
    conn = await asyncpg.connect(await fresh_database(postgres_server_dsn))
    watcher = await asyncpg.connect(postgres_server_dsn)
    migrating: asyncio.Task[list[str]] | None = None
    try:
        creator = other.transaction()
        await creator.start()
        await other.execute(f'CREATE ROLE "{role}" NOLOGIN')  # not committed yet
        pid = conn.get_server_pid()
        migrating = asyncio.create_task(
            migrations.apply_migrations(conn, migrations.TRANSITION_MIGRATIONS, roles)
        )

        async def waits_on_the_role() -> bool:
            # from outside the creator's transaction, whose statistics snapshot is fixed
            return bool(
                await watcher.fetchval(
                    "SELECT wait_event_type = 'Lock' AND query LIKE 'CREATE ROLE%' "
                    "FROM pg_stat_activity WHERE pid = $1",
                    pid,
                )
            )

        await eventually(waits_on_the_role)
        await creator.commit()
        applied = await migrating
        assert applied == [
            f"{m.number:04d}_{m.name}" for m in migrations.TRANSITION_MIGRATIONS.bundled()
        ]
        assert await conn.fetchval("SELECT count(*) FROM pg_roles WHERE rolname = $1", role) == 1
        assert await conn.fetchval(
            "SELECT has_table_privilege($1, 'ztate.transitions', 'SELECT')", role
        )
    finally:
        if migrating is not None and not migrating.done():
            migrating.cancel()
        await other.close()
        await conn.close()
        await watcher.close()


ROLES = {
    ":service_role": "ztate_upgrade_role",
    ":reader_role": "ztate_reader",
    ":pruner_role": migrations.PRUNER_ROLE,
}
# a head and two ledger rows written as a release before migration 0026 wrote them
OLD_ROWS = """
INSERT INTO ztate.threads (thread_id, version, head_digest, state, policy_name, policy_digest)
VALUES ('t-old', 1, repeat('b', 64), '\\x7b7d', 'p', repeat('c', 64));
INSERT INTO ztate.transitions (thread_id, version, digest, parent_digest, node_id, key_id,
                               signature, record, state, committed_at)
VALUES ('t-old', 0, repeat('a', 64), repeat('0', 64), 'n', 'k', repeat('d', 64),
        convert_to('{"patch":{"first":1}}', 'UTF8'), '\\x7b7d', now()),
       ('t-old', 1, repeat('b', 64), repeat('a', 64), 'n', 'k', repeat('e', 64),
        convert_to('{"patch":{"second":2}}', 'UTF8'), '\\x7b7d', now());
"""
VALIDATED = (
    "SELECT conname, convalidated FROM pg_catalog.pg_constraint "
    "WHERE connamespace = 'ztate'::regnamespace AND contype = 'c' "
    "AND pg_get_constraintdef(oid) LIKE '%0-9a-f%' ORDER BY conname"
)


async def test_migration_0026_replaces_the_checks_of_tables_with_rows_without_reading_them(
    postgres_server_dsn: str,
) -> None:
    """On a ledger that holds rows, 0026 adds each new check NOT VALID (no read of the
    table under the ACCESS EXCLUSIVE lock; the check replaced, the same rule, held for
    every row); empty tables get validated checks. New rows are checked all the same,
    and an operator's VALIDATE CONSTRAINT (online) marks them validated."""
    conn = await asyncpg.connect(await fresh_database(postgres_server_dsn))
    every = migrations.TRANSITION_MIGRATIONS
    try:
        await migrations.apply_migrations(
            conn, MigrationsUpTo(every.package, every.table, every.lock, last=25), ROLES
        )
        await conn.execute(OLD_ROWS)

        applied = await migrations.apply_migrations(conn, every, ROLES)

        assert applied[0] == "0026_hex_checks_without_counted_regex"
        assert dict(await conn.fetch(VALIDATED)) == {
            "threads_head_digest_check": False,
            "transitions_digest_check": False,
            "transitions_parent_digest_check": False,
            "transitions_signature_check": False,
            "pending_transitions_digest_check": True,
            "pending_transitions_parent_digest_check": True,
            "checkpoints_head_digest_check": True,
            "policies_policy_digest_check": True,
            "receipts_receipt_digest_check": True,
        }
        with pytest.raises(asyncpg.CheckViolationError) as refused:
            await conn.execute("UPDATE ztate.threads SET head_digest = upper(head_digest)")
        assert refused.value.constraint_name == "threads_head_digest_check"
        assert await conn.fetchval("SELECT head_digest FROM ztate.threads") == "b" * 64
        for name in (
            "transitions_digest_check",
            "transitions_parent_digest_check",
            "transitions_signature_check",
        ):
            await conn.execute(f"ALTER TABLE ztate.transitions VALIDATE CONSTRAINT {name}")
        await conn.execute(
            "ALTER TABLE ztate.threads VALIDATE CONSTRAINT threads_head_digest_check"
        )
        assert set(dict(await conn.fetch(VALIDATED)).values()) == {True}
    finally:
        await conn.close()


async def test_migration_0027_keeps_the_row_trigger_of_a_database_laid_out_for_citus(
    postgres_server_dsn: str,
) -> None:
    """A database that `ztate db citus` prepared (its key index gained thread_id) keeps
    the row trigger that writes it, distributed or not (a distribution that failed after
    the preparation leaves it so): 0027's statement trigger would fail every commit
    there on the NOT NULL thread_id. A plain database gets the statement trigger."""
    from ztate.services.store.optional import prepare_for_citus

    every = migrations.TRANSITION_MIGRATIONS
    trigger = (
        "SELECT p.proname, (t.tgtype & 1) = 1 AS per_row FROM pg_catalog.pg_trigger t "
        "JOIN pg_catalog.pg_proc p ON p.oid = t.tgfoid "
        "WHERE t.tgrelid = 'ztate.transitions'::regclass AND t.tgname = 'transitions_index_keys'"
    )
    for laid_out in (True, False):
        conn = await asyncpg.connect(await fresh_database(postgres_server_dsn))
        try:
            await migrations.apply_migrations(
                conn, MigrationsUpTo(every.package, every.table, every.lock, last=26), ROLES
            )
            if laid_out:
                await prepare_for_citus(conn)

            await migrations.apply_migrations(conn, every, ROLES)
            await conn.execute(OLD_ROWS)

            found = tuple(await conn.fetchrow(trigger))
            keys = [tuple(r) for r in await conn.fetch(
                "SELECT key, digest FROM ztate.transition_keys ORDER BY key"
            )]  # fmt: skip
            if laid_out:
                assert found == ("index_transition_keys", True)
                assert await conn.fetchval(
                    "SELECT array_agg(DISTINCT thread_id) FROM ztate.transition_keys"
                ) == ["t-old"]
            else:
                assert found == ("index_transition_keys_of_statement", False)
            assert keys == [("first", "a" * 64), ("second", "b" * 64)]
        finally:
            await conn.close()
