"""``ztate db citus`` on a database it laid out before: again after ``citus_add_node``,
and after an upgrade across migrations 0018 and 0019, which replace the commit function
(new arguments: the nodes a version wakes; the lease grant it fences and releases) that
``ztate db citus`` distributed.

The cluster is laid out as the version before it left it (migrations up to 0017, the
commit function of 13 arguments distributed by its thread id), then upgraded as
docs/scale-out.md says: ``ztate db migrate`` (the service also migrates at start-up),
then ``ztate db citus`` again. The migration must apply on the distributed schema, and
afterwards the commit must again be one command to the worker holding the thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg

from tests.citus.cluster import (
    PATCH_KEYS_LANGUAGE_ON_WORKERS,
    STORAGE_PARAMETERS,
    CitusCluster,
    shard_hex_checks,
    shard_storage_parameters,
)
from ztate.services.store.migrate import (
    TRANSITION_MIGRATIONS,
    Migration,
    MigrationSet,
    apply_migrations,
    migrate,
)
from ztate.services.store.optional import apply_citus_layout, layout_sql, prepare_for_citus
from ztate.services.store.transitions import COMMIT

SERVICE_ROLE = "ztate_transition"
OLD_COMMIT = (
    "ztate.commit_transition(text, bigint, bigint, text, bytea, text, text, text, text, "
    "timestamptz, bytea, text, text)"
)
COMMIT_0018 = OLD_COMMIT.removesuffix(")") + ", text[])"
NEW_COMMIT = COMMIT_0018.removesuffix(")") + ", text, bigint)"  # migration 0019
# the end of the park's layout line since migration 0024 (its lease grant), and the park
PARK_LAYOUT_0024 = (
    "text, timestamptz, text[], integer, text,\n                               bigint)"
)
NEW_PARK = (
    "ztate.park_transition(text, text, bigint, text, text, bytea, bytea, text[], text, text, "
    "timestamptz, text[], integer, text, bigint)"
)


@dataclass(frozen=True)
class UpTo(MigrationSet):
    """The transition service's migrations as a release that ended at ``last`` shipped them."""

    last: int = 0

    def bundled(self) -> list[Migration]:
        return [m for m in super().bundled() if m.number <= self.last]


# the argument a function is distributed by (0: the thread id), if it is distributed
DISTRIBUTED_BY = (
    "SELECT distribution_argument_index FROM pg_dist_object "
    "WHERE classid = 'pg_proc'::regclass AND objid = to_regprocedure($1)::oid"
)


async def test_the_commit_stays_on_one_worker_across_the_upgrades_to_0018_and_0019(
    citus_cluster: CitusCluster,
) -> None:
    dsn = await citus_cluster.database()
    conn = await asyncpg.connect(dsn)
    remote: list[str] = []
    conn.add_log_listener(
        lambda _conn, message: remote.append(f"{message.message} | {message.detail}")
    )
    try:
        before = UpTo(TRANSITION_MIGRATIONS.package, TRANSITION_MIGRATIONS.table,
                      TRANSITION_MIGRATIONS.lock, last=17)  # fmt: skip
        roles = {
            ":service_role": SERVICE_ROLE,
            ":reader_role": "ztate_reader",
            ":pruner_role": "ztate_pruner",
        }
        await apply_migrations(conn, before, roles)
        # the layout as that release's `ztate db citus` applied it: its commit function
        await prepare_for_citus(conn)
        await conn.execute(
            layout_sql("citus_distribute")
            .replace(
                "timestamptz, bytea, text, text, text[], text,\n"
                "                                 bigint)",
                "timestamptz, bytea, text, text)",
            )
            .replace(PARK_LAYOUT_0024, "text, timestamptz, text[], integer)")
        )
        assert await conn.fetchval(DISTRIBUTED_BY, OLD_COMMIT) == 0
        # a head the release before wrote: 0026 adds the heads' new check NOT VALID
        await conn.execute(
            "INSERT INTO ztate.threads (thread_id, version, head_digest, state, policy_name, "
            "policy_digest) VALUES ('t-before', 0, $1, '\\x7b7d', 'p', $1)",
            "e" * 64,
        )

        applied = await migrate(conn, SERVICE_ROLE)  # `ztate db migrate`
        # 0020 adds the batch commit's function, which Citus does not use (one row a
        # commit); 0021 and 0022 set storage parameters of the (distributed) ledger and
        # heads; 0023 replaces the key-index trigger's function, on every node; 0024
        # the park; 0025 indexes the refusals at commit (the rejections stay on the
        # coordinator); 0026 rewrites the hex digests' checks, on every shard; 0027
        # replaces the key functions on every node and leaves the shards' row trigger;
        # 0028 replaces the commit and the park (a lapsed lease is lost), on every node;
        # 0029 indexes the rejections' pages (on the coordinator)
        assert applied == [
            "0018_wakes_in_the_commit",
            "0019_leases_in_the_commit",
            "0020_batch_commit_plan",
            "0021_ledger_rows_inline",
            "0022_room_for_heads",
            "0023_patch_keys_planned_once",
            "0024_lease_fence_in_the_park",
            "0025_refusals_at_commit",
            "0026_hex_checks_without_counted_regex",
            "0027_key_index_by_statement",
            "0028_lapsed_leases_are_lost",
            "0029_rejection_pages",
            "0030_waiting_work_in_order",
        ]
        assert await conn.fetchval("SELECT to_regprocedure($1)", OLD_COMMIT) is None
        assert await conn.fetchval("SELECT to_regprocedure($1)", COMMIT_0018) is None
        # 0021's and 0022's storage parameters reach the shards, where the rows are
        for table, parameter in STORAGE_PARAMETERS.items():
            assert await shard_storage_parameters(conn, table) == {parameter}

        # 0026's checks reach the shards, where the rows are written (of the heads, which
        # held a row, NOT VALID: not read under the lock; the check replaced held)
        def hex_check(column: str, suffix: str = "") -> str:
            return f"CHECK (((length({column}) = 64) AND ({column} !~ '[^0-9a-f]'::text))){suffix}"

        assert await shard_hex_checks(conn, "ztate.transitions") == {
            " | ".join(hex_check(c) for c in ("digest", "parent_digest", "signature"))
        }
        assert await shard_hex_checks(conn, "ztate.threads") == {
            hex_check("head_digest", " NOT VALID")
        }
        assert await shard_hex_checks(conn, "ztate.pending_transitions") == {
            " | ".join(hex_check(c) for c in ("digest", "parent_digest"))
        }
        assert await shard_hex_checks(conn, "ztate.checkpoints") == {hex_check("head_digest")}
        assert await shard_hex_checks(conn, "ztate.receipts") == {hex_check("receipt_digest")}
        # 0023's function reaches the workers, where the shards' key-index triggers run
        assert await conn.fetch(PATCH_KEYS_LANGUAGE_ON_WORKERS) == [(True, "plpgsql")] * 2
        # and 0027's, which patch_keys now reads from, is a distributed object: a worker
        # added later (citus_add_node) gets it too
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM pg_dist_object WHERE classid = 'pg_proc'::regclass "
                "AND objid IN (to_regprocedure('ztate.patch_keys(bytea)'), "
                "              to_regprocedure('ztate.patch_key_set(bytea)'))"
            )
            == 2
        )
        await apply_citus_layout(conn)  # `ztate db citus`, again
        assert await conn.fetchval(DISTRIBUTED_BY, NEW_COMMIT) == 0
        assert await conn.fetchval(DISTRIBUTED_BY, NEW_PARK) == 0

        thread_id = "t-upgraded"
        holder = await conn.fetchval(
            "SELECT nodeport FROM pg_dist_shard_placement "
            "WHERE shardid = get_shard_id_for_distribution_column('ztate.threads', $1::text)",
            thread_id,
        )
        await conn.execute(
            "INSERT INTO ztate.threads (thread_id, version, head_digest, state, policy_name, "
            "policy_digest) VALUES ($1, 0, $2, '\\x7b7d', 'p', $3)",
            thread_id,
            "0" * 64,
            "ab" * 32,
        )
        await conn.execute("SET citus.log_remote_commands = on; SET client_min_messages = log")
        answer = await conn.fetchval(
            COMMIT, thread_id, 0, 1, "1" * 64, b"{}", "0" * 64, "n", "k",
            "a" * 64, datetime.now(UTC), b'{"patch":{"plan":1}}', "i-1", "r", ["planner"],
            None, None,
        )  # fmt: skip
        await conn.execute("SET citus.log_remote_commands = off")
        work = await conn.fetch(
            "SELECT node, wake_version FROM ztate.node_work WHERE thread_id = $1", thread_id
        )
        # the shard's key-index trigger (a row trigger on Citus, 0027 left it) ran on its
        # worker, through 0027's key functions there
        keys = await conn.fetch(
            "SELECT key, thread_id FROM ztate.transition_keys WHERE thread_id = $1", thread_id
        )
    finally:
        await conn.close()
    assert answer == 0  # committed, unwatched, under no lease
    assert [(r["node"], r["wake_version"]) for r in work] == [("planner", 1)]
    assert [tuple(r) for r in keys] == [("plan", thread_id)]
    sent = [m for m in remote if "ztate.commit_transition(" in m]
    assert len(sent) == 1, remote  # one command: the call itself
    assert f":{holder} " in sent[0], sent  # to the worker holding the thread
    assert not [m for m in remote if "PREPARE TRANSACTION" in m], remote


async def test_db_citus_runs_again_on_a_distributed_database(citus_dsn: str) -> None:
    """docs/scale-out.md has operators run ``ztate db citus`` again after each
    ``citus_add_node``: on a database it laid out already, it succeeds and changes
    nothing. (It failed: the transition_keys back-fill updated a distribution column,
    which Citus refuses to plan, and the whole file sent at once reached the workers as
    several commands in one prepared statement.)"""
    conn = await asyncpg.connect(citus_dsn)
    try:
        layout = "SELECT logicalrelid::text, partmethod FROM pg_dist_partition ORDER BY 1"
        before = [tuple(r) for r in await conn.fetch(layout)]
        await apply_citus_layout(conn)
        await apply_citus_layout(conn)
        after = [tuple(r) for r in await conn.fetch(layout)]
        distributed = await conn.fetchval(DISTRIBUTED_BY, NEW_COMMIT)
    finally:
        await conn.close()
    assert after == before
    assert len(before) == 11  # 8 distributed, 1 reference, 2 on the coordinator
    assert distributed == 0
