"""The optional Citus layout, checked on real (plain) Postgres.

What is checked here needs no Citus: that the layout names every table the
migrations create, that every distributed table is keyed by thread_id once
citus_prepare.sql ran (the rule Citus enforces on primary keys, unique constraints
and foreign keys), that the transition service still commits, parks and indexes on
the prepared schema, and that `ztate db citus` refuses a database without the
extension and changes nothing. The layout on a real cluster is the citus lane's
(tests/citus/, `make test-citus`).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
import pytest_asyncio

from tests.harness import INITIAL, Pki, act, client, new_thread_id, with_database
from ztate.services.runtime.config import Settings
from ztate.services.store.migrate import bundled_migrations, migrate
from ztate.services.store.optional import (
    COORDINATOR_LOCAL,
    DISTRIBUTED,
    REFERENCE,
    CitusError,
    apply_citus_layout,
    layout_sql,
    prepare_for_citus,
)
from ztate.services.store.transitions import COMMIT
from ztate.transition_service.app import start
from ztate.worker_sdk import AwaitingApproval


async def fresh_database(server_dsn: str) -> str:
    name = f"ztate_citus_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = with_database(server_dsn, name)
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn, "ztate_transition")
    finally:
        await conn.close()
    return dsn


@pytest_asyncio.fixture(scope="module")
async def prepared(postgres_server_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A migrated database after citus_prepare.sql (applied twice: it is idempotent)."""
    conn = await asyncpg.connect(await fresh_database(postgres_server_dsn))
    await prepare_for_citus(conn)
    await prepare_for_citus(conn)
    yield conn
    await conn.close()


async def keys_of(conn: asyncpg.Connection, table: str, kinds: str) -> list[tuple[str, list[str]]]:
    """(constraint or index name, its columns) of ztate.<table>'s unique keys."""
    rows = await conn.fetch(
        """SELECT c.relname AS name,
                  array_agg(a.attname ORDER BY k.ord) AS columns
             FROM pg_index i
             JOIN pg_class c ON c.oid = i.indexrelid
             JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord) ON true
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
            WHERE i.indrelid = ('ztate.' || $1)::regclass
              AND (i.indisunique OR i.indisprimary)
              AND ($2 = 'unique' OR i.indisprimary)
            GROUP BY c.relname""",
        table,
        kinds,
    )
    return [(r["name"], list(r["columns"])) for r in rows]


async def test_the_layout_places_every_table_of_the_schema(postgres_server_dsn: str) -> None:
    conn = await asyncpg.connect(await fresh_database(postgres_server_dsn))
    try:
        tables = {
            r["tablename"]
            for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'ztate'")
        }
    finally:
        await conn.close()
    placed = [*DISTRIBUTED, *REFERENCE, *COORDINATOR_LOCAL]
    assert len(placed) == len(set(placed))
    assert tables == set(placed)


async def test_every_distributed_table_is_keyed_by_thread_id(
    prepared: asyncpg.Connection,
) -> None:
    for table in DISTRIBUTED:
        nullable = await prepared.fetchval(
            "SELECT is_nullable FROM information_schema.columns "
            "WHERE table_schema = 'ztate' AND table_name = $1 AND column_name = 'thread_id'",
            table,
        )
        assert nullable == "NO", table
        for name, columns in await keys_of(prepared, table, "unique"):
            assert "thread_id" in columns, f"{table}: unique key {name} {columns}"


async def test_foreign_keys_stay_inside_one_thread(prepared: asyncpg.Connection) -> None:
    """Between distributed tables only on thread_id (co-located); none from a reference
    or coordinator table to a distributed one (Citus refuses those)."""
    rows = await prepared.fetch(
        """SELECT src.relname AS source, dst.relname AS target,
                  (SELECT array_agg(a.attname) FROM pg_attribute a
                    WHERE a.attrelid = c.conrelid AND a.attnum = ANY (c.conkey)) AS columns
             FROM pg_constraint c
             JOIN pg_class src ON src.oid = c.conrelid
             JOIN pg_class dst ON dst.oid = c.confrelid
             JOIN pg_namespace n ON n.oid = src.relnamespace
            WHERE c.contype = 'f' AND n.nspname = 'ztate'"""
    )
    assert rows, "the schema has foreign keys to check"
    for row in rows:
        assert row["source"] in DISTRIBUTED, dict(row)
        assert row["target"] in DISTRIBUTED, dict(row)
        assert row["columns"] == ["thread_id"], dict(row)


async def test_the_keys_citus_needs_replace_the_global_ones(prepared: asyncpg.Connection) -> None:
    transitions = dict(await keys_of(prepared, "transitions", "unique"))
    assert transitions["transitions_thread_digest_key"] == ["thread_id", "digest"]
    assert "transitions_digest_key" not in transitions
    assert transitions["transitions_thread_id_parent_digest_key"] == [
        "thread_id",
        "parent_digest",
    ]  # the fork guard is kept as it was
    assert dict(await keys_of(prepared, "pending_transitions", "primary")) == {
        "pending_transitions_pkey": ["thread_id", "digest"]
    }
    assert dict(await keys_of(prepared, "transition_keys", "primary")) == {
        "transition_keys_pkey": ["key", "committed_at", "digest", "thread_id"]
    }
    # a nonce still authorises once, ever: receipts keep their global unique nonce
    assert ["nonce"] in [c for _, c in await keys_of(prepared, "receipts", "unique")]


def test_the_commit_names_its_thread_in_every_table_it_touches() -> None:
    """Single-shard: the hot-path statement is a call of ztate.commit_transition with the
    thread id first (the argument `ztate db citus` distributes it by), and each table the
    function touches is a distributed one, reached by that thread id (the insert writes
    it itself). tests/citus/test_layout.py checks the remote commands on a real cluster."""
    assert re.fullmatch(r"SELECT ztate\.commit_transition\(\$1, .*\$16\)", COMMIT)
    # the newest definition of the function (migration 0019: with the lease it fences)
    create = "CREATE OR REPLACE FUNCTION ztate.commit_transition("
    defining = [m.sql for m in bundled_migrations() if create in m.sql]
    body = defining[-1].split(create, 1)[1].split("$$;", 1)[0]
    assert set(re.findall(r"ztate\.(\w+)", body)) <= set(DISTRIBUTED)
    assert re.search(r"WHERE t\.thread_id = p_thread_id AND t\.version = p_expected", body)
    assert re.search(r"p\.thread_id = p_thread_id", body)
    assert re.search(r"w\.thread_id = p_thread_id", body)
    assert re.search(r"VALUES \(p_thread_id, ", body)
    assert re.search(r"SELECT p_thread_id, n, p_version FROM unnest\(p_woken\)", body)
    assert re.search(r"m\.thread_id = p_thread_id AND m\.evaluated_version >= p_expected", body)
    # the lease's fence and release: its row on the same thread
    assert len(re.findall(r"l\.thread_id = p_thread_id AND l\.node = p_lease_node", body)) == 2
    distribute = layout_sql("citus_distribute")
    assert "create_distributed_function(call, '$1'" in distribute
    assert "colocate_with => 'ztate.threads'" in distribute


async def test_the_service_commits_parks_and_indexes_on_the_prepared_schema(
    postgres_server_dsn: str, settings: Settings, pki: Pki
) -> None:
    dsn = await fresh_database(postgres_server_dsn)
    conn = await asyncpg.connect(dsn)
    try:
        await prepare_for_citus(conn)
        running = await start(settings, dsn=dsn)
        try:
            target = f"localhost:{running.port}"
            thread_id = new_thread_id()
            async with client(target, pki.operator()) as operator:
                await operator.create_thread(thread_id, INITIAL, policy="pipeline")
            async with client(target, pki.node("input-parser")) as parser:
                committed = await parser.propose(thread_id, 0, {"requested_action": act("c")})
            async with client(target, pki.node("planner")) as planner:
                with pytest.raises(AwaitingApproval):
                    await planner.propose(thread_id, 1, {"target_user_id": str(uuid.uuid4())})
        finally:
            await running.stop(grace=1.0)
        digest = await conn.fetchval(
            "SELECT digest FROM ztate.transitions WHERE thread_id = $1 AND version = $2",
            thread_id,
            committed.version,
        )
        indexed = await conn.fetch(
            "SELECT key, thread_id FROM ztate.transition_keys WHERE digest = $1", digest
        )
        assert [(r["key"], r["thread_id"]) for r in indexed] == [("requested_action", thread_id)]
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM ztate.pending_transitions WHERE thread_id = $1", thread_id
            )
            == 1
        )
    finally:
        await conn.close()


async def test_ztate_db_citus_refuses_without_the_extension_and_changes_nothing(
    postgres_server_dsn: str,
) -> None:
    conn = await asyncpg.connect(await fresh_database(postgres_server_dsn))
    try:
        before = await keys_of(conn, "transitions", "unique")
        with pytest.raises(CitusError, match="citus extension is not installed"):
            await apply_citus_layout(conn)
        assert await keys_of(conn, "transitions", "unique") == before
        assert "transitions_digest_key" in dict(before)
    finally:
        await conn.close()
