"""The layout of ``ztate db citus`` on a real cluster: what is distributed, where the
shards are, and that the commit path is routed to one shard."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import cast

import asyncpg

from tests.citus.cluster import (
    PATCH_KEYS_LANGUAGE_ON_WORKERS,
    STORAGE_PARAMETERS,
    CitusCluster,
    shard_storage_parameters,
)
from tests.harness import INITIAL, Pki, act, client, new_thread_id
from ztate.services.store.optional import COORDINATOR_LOCAL, DISTRIBUTED, REFERENCE
from ztate.services.store.transitions import (
    COMMIT,
    HEAD_FOR_REQUEST,
    PARK,
    RELEASED,
    PostgresTransitionStore,
)

THREADS = 24


async def test_every_table_has_its_place(citus_dsn: str) -> None:
    conn = await asyncpg.connect(citus_dsn)
    try:
        rows = await conn.fetch(
            "SELECT logicalrelid::text AS name, partmethod::text, colocationid, repmodel::text "
            "FROM pg_dist_partition WHERE logicalrelid::text LIKE 'ztate.%'"
        )
    finally:
        await conn.close()
    by_name = {r["name"].removeprefix("ztate."): r for r in rows}
    assert {n for n, r in by_name.items() if r["partmethod"] == "h"} == set(DISTRIBUTED)
    assert len({by_name[n]["colocationid"] for n in DISTRIBUTED}) == 1  # one shard group
    assert {n for n, r in by_name.items() if r["partmethod"] == "n" and r["repmodel"] == "t"} == (
        set(REFERENCE)
    )
    assert {n for n, r in by_name.items() if r["partmethod"] == "n" and r["repmodel"] != "t"} == (
        set(COORDINATOR_LOCAL)
    )


async def test_threads_spread_over_both_workers(
    citus_cluster: CitusCluster, citus_dsn: str, citus_target: str, pki: Pki
) -> None:
    """Threads created through the service land on both workers, each thread's head,
    ledger and key index together on one."""
    threads = [new_thread_id() for _ in range(THREADS)]
    async with client(citus_target, pki.operator()) as operator:
        for thread_id in threads:
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(citus_target, pki.node("input-parser")) as parser:
        for thread_id in threads:
            await parser.propose(thread_id, 0, {"requested_action": act(thread_id)})
    conn = await asyncpg.connect(citus_dsn)
    try:
        placed = await conn.fetch(
            """SELECT t.table_name::text AS name, s.nodeport AS port
                 FROM unnest($1::text[]) AS x(thread_id)
                 CROSS JOIN unnest(ARRAY['ztate.threads', 'ztate.transitions',
                                         'ztate.transition_keys']::regclass[]) AS t(table_name)
                 JOIN pg_dist_shard_placement s
                   ON s.shardid = get_shard_id_for_distribution_column(t.table_name, x.thread_id)
                WHERE x.thread_id IS NOT NULL""",
            threads,
        )
        per_thread = await conn.fetch(
            """SELECT x.thread_id, array_agg(DISTINCT s.nodeport) AS ports
                 FROM unnest($1::text[]) AS x(thread_id)
                 CROSS JOIN unnest(ARRAY['ztate.threads', 'ztate.transitions',
                                         'ztate.transition_keys']::regclass[]) AS t(table_name)
                 JOIN pg_dist_shard_placement s
                   ON s.shardid = get_shard_id_for_distribution_column(t.table_name, x.thread_id)
                GROUP BY x.thread_id""",
            threads,
        )
        keys = await conn.fetchval(
            "SELECT count(DISTINCT thread_id) FROM ztate.transition_keys WHERE thread_id = ANY($1)",
            threads,
        )
    finally:
        await conn.close()
    workers = {w.port for w in citus_cluster.worker_nodes}
    assert {r["port"] for r in placed} == workers  # both workers hold threads
    assert all(len(r["ports"]) == 1 for r in per_thread)  # each thread on one worker
    assert keys == THREADS  # the key index trigger ran on the workers


async def test_the_commit_is_one_round_trip_to_one_worker(
    citus_cluster: CitusCluster, citus_dsn: str
) -> None:
    """The hot path on Citus: the commit, as the service runs it (parameters bound, the
    statement prepared and run again, as asyncpg's cache does), is one command sent to
    the one worker holding the thread, and commits there without a two-phase commit or
    intermediate results (citus.log_remote_commands on the coordinator)."""
    conn = await asyncpg.connect(citus_dsn)
    remote: list[str] = []  # each remote command, and the server it went to (its detail)
    conn.add_log_listener(
        lambda _conn, message: remote.append(f"{message.message} | {message.detail}")
    )
    try:
        thread_id = "t-routing"
        await conn.execute(
            "INSERT INTO ztate.threads (thread_id, version, head_digest, state, policy_name, "
            "policy_digest) VALUES ($1, 0, $2, '\\x7b7d', 'p', $3)",
            thread_id,
            "0" * 64,
            "ab" * 32,
        )
        holder = await conn.fetchval(
            "SELECT nodeport FROM pg_dist_shard_placement "
            "WHERE shardid = get_shard_id_for_distribution_column('ztate.threads', $1::text)",
            thread_id,
        )
        await conn.execute(
            "INSERT INTO ztate.wake_marks (thread_id, evaluated_version) VALUES ($1, 0)",
            thread_id,
        )
        await conn.execute(  # a lease of node 'lessee' on the thread, grant 1
            "INSERT INTO ztate.node_work (thread_id, node, wake_version, epoch, holder, "
            "expires_at) VALUES ($1, 'lessee', 0, 1, 'h', now() + interval '1 hour')",
            thread_id,
        )
        await conn.execute("SET citus.log_remote_commands = on; SET client_min_messages = log")
        per_commit: list[list[str]] = []
        parent = "0" * 64
        for version in range(1, 8):  # past the 5 custom plans of a prepared statement
            remote.clear()
            digest = f"{version:064d}"
            # the first under a lease it fences and releases (migration 0019)
            lease = ("lessee", 1) if version == 1 else (None, None)
            answer = await conn.fetchval(
                COMMIT, thread_id, version - 1, version, digest, b"{}", parent, "n", "k",
                "a" * 64, datetime.now(UTC), b"{}", f"i-{version}", "r", ["planner"], *lease,
            )  # fmt: skip
            # committed, and no replica watches the thread; the lease released, no more work
            assert answer == (RELEASED if version == 1 else 0)
            parent = digest
            per_commit.append(list(remote))
        head = await conn.fetchval(
            "SELECT version FROM ztate.threads WHERE thread_id = $1", thread_id
        )
        await conn.execute("SET citus.log_remote_commands = off")
        work = await conn.fetch(
            "SELECT node, wake_version, handled_version, holder FROM ztate.node_work "
            "WHERE thread_id = $1 ORDER BY node",
            thread_id,
        )
        mark = await conn.fetchval(
            "SELECT evaluated_version FROM ztate.wake_marks WHERE thread_id = $1", thread_id
        )
    finally:
        await conn.close()
    assert head == 7
    # the nodes each version woke and the wake mark, written by the same call (0018); the
    # lease released by the first, handled up to the version it built on (0019)
    assert [tuple(r) for r in work] == [("lessee", 0, 0, None), ("planner", 7, -1, None)]
    assert mark == 7
    for sent in per_commit:
        assert len(sent) == 1, sent  # one command: the call itself
        assert "ztate.commit_transition(" in sent[0], sent
        assert f":{holder} " in sent[0], sent  # to the worker holding the thread
        assert not [m for m in sent if "PREPARE TRANSACTION" in m or "COPY" in m], sent
        assert not [m for m in sent if "intermediate" in m], sent


async def test_a_commit_that_loses_its_race_writes_nothing_on_the_cluster(
    citus_dsn: str,
) -> None:
    """The delegated call keeps the statement's outcomes: a stale compare-and-swap
    answers NULL and leaves head and ledger as they were."""
    conn = await asyncpg.connect(citus_dsn)
    try:
        thread_id = "t-routing-stale"
        await conn.execute(
            "INSERT INTO ztate.threads (thread_id, version, head_digest, state, policy_name, "
            "policy_digest) VALUES ($1, 0, $2, '\\x7b7d', 'p', $3)",
            thread_id,
            "0" * 64,
            "ab" * 32,
        )
        lost = await conn.fetchval(
            COMMIT, thread_id, 3, 4, "4" * 64, b"{}", "0" * 64, "n", "k",
            "a" * 64, datetime.now(UTC), b"{}", "i-lost", "r", ["planner"], None, None,
        )  # fmt: skip
        head = await conn.fetchval(
            "SELECT version FROM ztate.threads WHERE thread_id = $1", thread_id
        )
        ledger = await conn.fetchval(
            "SELECT count(*) FROM ztate.transitions WHERE thread_id = $1", thread_id
        )
        work = await conn.fetchval(
            "SELECT count(*) FROM ztate.node_work WHERE thread_id = $1", thread_id
        )
    finally:
        await conn.close()
    assert lost is None
    assert (head, ledger, work) == (0, 0, 0)  # nor the node it would have woken


async def remote_commands(
    citus_dsn: str, thread_id: str, statement: str, *args: object
) -> tuple[int, object, list[str]]:
    """On a new thread ``thread_id`` at version 0: the port of the worker holding it,
    ``statement``'s first value, and the remote commands (each with the server it went
    to) that ``statement`` sends, prepared and run as asyncpg does."""
    conn = await asyncpg.connect(citus_dsn)
    remote: list[str] = []
    conn.add_log_listener(
        lambda _conn, message: remote.append(f"{message.message} | {message.detail}")
    )
    try:
        holder: int = await conn.fetchval(
            "SELECT nodeport FROM pg_dist_shard_placement "
            "WHERE shardid = get_shard_id_for_distribution_column('ztate.threads', $1::text)",
            thread_id,
        )
        await conn.execute(
            "INSERT INTO ztate.threads (thread_id, version, head_digest, state, policy_name, "
            "policy_digest) VALUES ($1, 0, $2, '\\x7b7d', 'pipeline', $3)",
            thread_id,
            "0" * 64,
            "ab" * 32,
        )
        await conn.execute("SET citus.log_remote_commands = on; SET client_min_messages = log")
        answer = await conn.fetchval(statement, *args)
    finally:
        await conn.close()
    return holder, answer, remote


async def test_parking_is_one_command_to_the_worker_holding_the_thread(citus_dsn: str) -> None:
    thread_id = "t-routing-park"
    holder, parked, sent = await remote_commands(
        citus_dsn, thread_id, PARK, thread_id, "d" * 64, 0, "0" * 64, "n", b"{}", b"{}",
        ["rule"], "i-park", "r", datetime.now(UTC), ["k"], 1, None, None,
    )  # fmt: skip
    assert parked is True
    assert len(sent) == 1, sent
    assert "ztate.park_transition(" in sent[0], sent
    assert f":{holder} " in sent[0], sent


async def test_the_head_for_a_stale_request_is_one_read_on_the_worker_holding_the_thread(
    citus_dsn: str,
) -> None:
    """head_for_request writes a stale request's refusal to the coordinator's rejections
    table, so it runs on the coordinator; its reads are one router query to the worker
    holding the thread, which only reads: no two-phase commit, no intermediate results."""
    thread_id = "t-routing-head"
    holder, head, sent = await remote_commands(
        citus_dsn, thread_id, HEAD_FOR_REQUEST, thread_id, "n", "i-head", "Propose", "n",
        thread_id, 5, "STALE_VERSION", ["k"], "p" * 64, 2, "expected 5, head at %s",
        "pipeline",
    )  # fmt: skip
    assert head == thread_id  # its first column: the head's thread id
    issued = [m for m in sent if m.startswith("issuing ")]
    assert len(issued) == 1, sent  # the one remote command: the read
    assert "SELECT th.*" in issued[0], sent
    assert f":{holder} " in issued[0], sent
    # the refusal, on the coordinator itself
    assert [m for m in sent if not m.startswith("issuing ")] == [
        m
        for m in sent
        if m.startswith("executing the command locally: INSERT INTO ztate.rejections")
    ], sent
    conn = await asyncpg.connect(citus_dsn)
    try:
        refusals = await conn.fetch(
            "SELECT base_version, message FROM ztate.rejections WHERE thread_id = $1", thread_id
        )
    finally:
        await conn.close()
    assert [tuple(r) for r in refusals] == [(5, "expected 5, head at 0")]


async def test_replays_and_head_reads_are_one_command_to_the_worker_holding_the_thread(
    citus_dsn: str,
) -> None:
    """The store's idempotent replays (a committed or a parked request) and its head
    read, as the service calls them: each one router query to the one worker."""
    thread_id = "t-routing-replay"
    holder, _, _ = await remote_commands(citus_dsn, thread_id, "SELECT 1")
    conn = await asyncpg.connect(citus_dsn)
    remote: list[str] = []
    conn.add_log_listener(
        lambda _conn, message: remote.append(f"{message.message} | {message.detail}")
    )
    await conn.execute("SET citus.log_remote_commands = on; SET client_min_messages = log")
    # the store's statements on one connection (a pool drops log listeners on release)
    store = PostgresTransitionStore(cast(asyncpg.Pool, conn))
    try:
        calls = {
            "find_by_idempotency_key": store.find_by_idempotency_key,
            "find_pending": store.find_pending,
        }
        for name, call in calls.items():
            remote.clear()
            await call(thread_id, "n", "k")
            await conn.fetchval("SELECT 1")  # the listener's messages have all arrived
            issued = [m for m in remote if m.startswith("issuing ")]
            assert len(issued) == 1, (name, remote)
            assert f":{holder} " in issued[0], (name, remote)
        remote.clear()
        await store.read_head(thread_id)
        await conn.fetchval("SELECT 1")
        issued = [m for m in remote if m.startswith("issuing ")]
        assert len(issued) == 1, remote
        assert f":{holder} " in issued[0], remote
    finally:
        await conn.close()


async def test_the_shards_keep_the_storage_parameters_of_their_tables(citus_dsn: str) -> None:
    """Migrations 0021 and 0022 set storage parameters before `ztate db citus` distributes
    the tables: every shard, where the rows are, carries them."""
    conn = await asyncpg.connect(citus_dsn)
    try:
        for table, parameter in STORAGE_PARAMETERS.items():
            assert await shard_storage_parameters(conn, table) == {parameter}
    finally:
        await conn.close()


async def test_the_changed_keys_of_a_record_are_planned_once_a_connection(citus_dsn: str) -> None:
    """The key-index trigger computes each ledger row's changed keys with ztate.patch_keys,
    a new query at every row. Postgres before 18 plans the body of an SQL-language
    function it cannot inline at every such call (33 µs of the 80 it cost a row, on this
    cluster's Postgres 15); a PL/pgSQL function keeps its plan for the connection
    (migration 0023). Postgres reports each planning it does (log_planner_stats), with
    the function it happened in: of sixteen calls, those after the first six (the plans
    Postgres makes before it settles on a kept one) report none in patch_keys. Every node
    has the same function: the workers, where the shards' triggers run, as well."""
    record = b'{"patch":{"zeta":1,"alpha":{"nested":true},"mid":[1,2]},"version":1}'
    conn = await asyncpg.connect(citus_dsn)
    planned: list[str] = []

    def count_planning(_conn: object, message: asyncpg.PostgresLogMessage) -> None:
        if message.message == "PLANNER STATISTICS" and "patch_keys" in (message.context or ""):
            planned.append(message.context or "")

    try:
        await conn.execute("SET log_planner_stats = on; SET client_min_messages = log")
        conn.add_log_listener(count_planning)
        for _ in range(6):
            assert await conn.fetchval("SELECT ztate.patch_keys($1)", record) == [
                "alpha",
                "mid",
                "zeta",
            ]
        await conn.fetchval("SELECT 1")  # the listener's messages have all arrived
        assert planned, "Postgres reported no planning of patch_keys: the probe does not work"
        planned.clear()
        for _ in range(10):
            assert await conn.fetchval("SELECT ztate.patch_keys($1)", record) == [
                "alpha",
                "mid",
                "zeta",
            ]
        await conn.fetchval("SELECT 1")
        conn.remove_log_listener(count_planning)
        await conn.execute("SET client_min_messages = notice; RESET log_planner_stats")
        assert planned == []
        languages = await conn.fetch(PATCH_KEYS_LANGUAGE_ON_WORKERS)
    finally:
        await conn.close()
    assert languages == [(True, "plpgsql")] * 2
