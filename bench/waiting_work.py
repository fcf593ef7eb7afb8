"""What a dispatch round's query for waiting work costs: ``python -m bench.waiting_work``.

A fresh migrated database is filled with ``--threads`` threads of one policy and a row of
work for one node on each, of which ``--waiting`` wait (the others handled), and a
tenth of them on threads of another policy (rows a renamed policy leaves behind); then
the dispatcher's statement (``services/store/work.py``, ``WAITING``: one node, a limit
of 64; rows of another policy are the dispatcher's to retire once granted) runs as the
service runs it, a prepared statement past the five runs after which
Postgres keeps a generic plan, and the best of its runs is printed with the index that
led it. With ``--without-order-index`` the index of migration 0030 is dropped first:
the query then reads and sorts every waiting row (docs/work.md, "Delivery").
Not part of ``make bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import asyncpg

from bench.environment import bench_database, postgres_server, temporary_folder
from ztate.services.store.work import WAITING

DB_ROLE = "ztate_transition"
LIMIT = 64
RUNS = 12


def _index_names(plan: dict[str, object]) -> list[str]:
    found = [str(plan["Index Name"])] if "Index Name" in plan else []
    for child in plan.get("Plans", ()):  # type: ignore[attr-defined]
        found += _index_names(child)
    return found


async def fill(conn: asyncpg.Connection, threads: int, waiting: int) -> None:
    await conn.execute("SET session_replication_role = replica")  # no triggers: bare rows
    await conn.execute(
        """INSERT INTO ztate.threads (thread_id, version, head_digest, state, policy_name,
                                      policy_digest)
           SELECT 't-' || i, 0, repeat('a', 64), '\\x7b7d'::bytea,
                  CASE WHEN i % 10 = 0 THEN 'renamed' ELSE 'pipeline' END, repeat('b', 64)
             FROM pg_catalog.generate_series(1, $1) AS i""",
        threads,
    )
    await conn.execute(
        """INSERT INTO ztate.node_work (thread_id, node, wake_version, handled_version)
           SELECT 't-' || i, 'planner', 1, CASE WHEN i <= $2 THEN -1 ELSE 1 END
             FROM pg_catalog.generate_series(1, $1) AS i""",
        threads,
        waiting,
    )
    await conn.execute("RESET session_replication_role")
    await conn.execute("ANALYZE ztate.threads, ztate.node_work")


async def measure(threads: int, waiting: int, without_order_index: bool) -> None:
    with temporary_folder() as root, postgres_server(root) as (server_dsn, pid):
        async with bench_database(server_dsn, pid, DB_ROLE) as database:
            conn = await asyncpg.connect(database.dsn)
            try:
                await fill(conn, threads, waiting)
                if without_order_index:
                    await conn.execute("DROP INDEX ztate.node_work_waiting_in_order")
                statement = await conn.prepare(WAITING)
                best = float("inf")
                for _ in range(RUNS):
                    began = time.perf_counter()
                    rows = await statement.fetch("planner", LIMIT)
                    best = min(best, time.perf_counter() - began)
                explained = await conn.fetchval(
                    "EXPLAIN (FORMAT JSON) " + WAITING, "planner", LIMIT
                )
                indexes = _index_names(json.loads(explained)[0]["Plan"])
            finally:
                await conn.close()
    print(
        f"{threads:,} threads, {waiting:,} rows waiting for one node (a tenth on threads of "
        f"another policy): {best * 1000:.2f} ms a round for {len(rows)} rows "
        f"(best of {RUNS}), led by {', '.join(dict.fromkeys(indexes)) or 'no index'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.waiting_work", description=__doc__)
    parser.add_argument("--threads", type=int, default=200_000)
    parser.add_argument("--waiting", type=int, default=200_000)
    parser.add_argument("--without-order-index", action="store_true")
    args = parser.parse_args()
    asyncio.run(measure(args.threads, min(args.waiting, args.threads), args.without_order_index))


if __name__ == "__main__":
    main()
