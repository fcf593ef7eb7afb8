"""Workers finding their work (SubscribeWork): dispatch latency, pipeline throughput,
and the database's idle cost per subscriber.

``python -m bench.work_dispatch`` starts an embedded Postgres (or uses
``DATABASE_URL``), a throw-away PKI and ``ztate serve`` in its own process, with the
shipped pipeline policy (input parser -> planner -> approval gate -> database
writer, each woken by the key the previous one writes). Each node is one worker
(``NodeRunner.for_node(...).serve()``, concurrency ``--concurrency``) in this
process. It measures:

1. **dispatch latency**: from a version's commit (the ledger's ``committed_at``) to
   the start of the next node's handler on it, p50 and p99, with ``--threads``
   threads created at once (all in flight together);
2. **throughput** of the 4-node pipeline: threads through all four nodes per second
   (from the first creation to the last commit);
3. **idle cost** (measured first, on a quiet database): database transactions per
   second (``pg_stat_database.xact_commit``) with 10 and with 1,000 idle
   SubscribeWork streams and as many idle WatchThread streams: the target is no
   more with 1,000 than with 10.

The figures are as measured on this machine; on a shared machine other load only
slows them down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg

from bench.end_to_end import health_check, sdk_client, service_environment
from bench.environment import (
    Credentials,
    Pki,
    bench_database,
    child_server,
    free_port,
    postgres_server,
    temporary_folder,
    wait_until_serving,
)
from bench.workload import TRUST_DOMAIN
from ztate.contract.keyring import generate_keyring_file
from ztate.services.cli import ca
from ztate.services.runtime.identity import Identity, Role
from ztate.worker_sdk import NodeRunner, View, ZtateClient

NODES = ("input-parser", "planner", "approval-gate", "db-writer")
USER = "123e4567-e89b-42d3-a456-426614174000"
INITIAL: dict[str, Any] = {
    "raw_text": "please refund order A-42 for 1.00",
    "authority": {"tenant": "acme"},
    "target_user_id": USER,
    "execution_permissions": ["refund"],
}
ACTION = {"action": "refund", "order_id": "A-42", "amount_cents": 100}
SETTLE_SECONDS = 25.0  # 2,000 streams open slowly on a loaded machine
PATCHES: dict[str, dict[str, Any]] = {
    "input-parser": {"requested_action": ACTION},
    "planner": {"pending_transition": ACTION},
    "approval-gate": {"approved_action": ACTION},
    "db-writer": {"result_ref": "db://orders/A-42/refund"},
}


def issue(ca_dir: Path, certs: Path, role: Role, name: str, *, server: bool = False) -> Credentials:
    paths = ca.issue(
        ca_dir,
        Identity(TRUST_DOMAIN, role, name),
        certs,
        dns_names=("localhost",) if server else (),
        ip_addresses=("127.0.0.1",) if server else (),
    )
    return Credentials(paths.cert, paths.key, paths.ca_cert)


async def pipeline(
    target: str, dsn: str, nodes: dict[str, Credentials], operator: Credentials, args: Any
) -> list[str]:
    """Run ``args.threads`` threads through the four nodes; the report's lines."""
    starts: dict[tuple[str, int], float] = {}  # (thread, version handled) -> wall clock
    stop = asyncio.Event()
    clients = [sdk_client(target, nodes[name]) for name in NODES]

    def handler_for(name: str) -> Any:
        def handle(view: View) -> dict[str, Any]:
            starts[(view.thread_id, view.version)] = time.time()
            return PATCHES[name]

        return handle

    runners = [
        asyncio.create_task(
            NodeRunner.for_node(
                client, handler_for(name), node_name=name, concurrency=args.concurrency
            ).serve(stop)
        )
        for name, client in zip(NODES, clients, strict=True)
    ]
    threads = [f"bench-{i:05d}-{time.time_ns() % 10**9}" for i in range(args.threads)]
    began = time.time()
    async with sdk_client(target, operator) as admin:
        for start in range(0, len(threads), 50):
            await asyncio.gather(
                *(admin.create_thread(t, INITIAL) for t in threads[start : start + 50])
            )
    created = time.time()
    conn = await asyncpg.connect(dsn)
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            done = await conn.fetchval(
                "SELECT count(*) FROM ztate.threads WHERE thread_id = ANY($1) AND version = 4",
                threads,
            )
            if done == len(threads) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)  # polling for the end, with a deadline
        finished = time.time()
        rows = await conn.fetch(
            "SELECT thread_id, version, committed_at FROM ztate.transitions "
            "WHERE thread_id = ANY($1) AND version < 4",
            threads,
        )
    finally:
        await conn.close()
    stop.set()
    await asyncio.gather(*runners, return_exceptions=True)
    for client in clients:
        await client.close()
    committed: dict[tuple[str, int], datetime] = {
        (r["thread_id"], r["version"]): r["committed_at"] for r in rows
    }
    # the next node's start on versions 1..3 (version 0 is the operator's creation)
    latencies = sorted(
        (starts[key] - at.timestamp()) * 1000
        for key, at in committed.items()
        if key[1] >= 1 and key in starts
    )
    creation_latencies = sorted(
        (starts[key] - at.timestamp()) * 1000
        for key, at in committed.items()
        if key[1] == 0 and key in starts
    )
    lines = [
        f"pipeline: {done}/{len(threads)} threads through 4 nodes in "
        f"{finished - began:.1f} s ({done / (finished - began):.1f} threads/s, "
        f"{4 * done / (finished - began):.1f} commits/s incl. creation); creation took "
        f"{created - began:.1f} s; concurrency {args.concurrency} per node",
    ]
    for label, values in (
        ("dispatch latency commit -> next node's handler", latencies),
        ("dispatch latency creation -> first node's handler", creation_latencies),
    ):
        if values:
            p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
            lines.append(
                f"{label}: p50 {statistics.median(values):.0f} ms, p99 {p99:.0f} ms "
                f"(n={len(values)})"
            )
    return lines


async def transactions(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        count: int = await conn.fetchval(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        return count
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def idle_streams(
    target: str, credentials: Credentials, n: int, thread_id: str
) -> AsyncIterator[None]:
    """``n`` idle SubscribeWork and ``n`` idle WatchThread streams (200 per channel)."""
    clients: list[ZtateClient] = []
    tasks: list[asyncio.Task[Any]] = []
    streams: list[Any] = []
    for i in range(n):
        if i % 100 == 0:
            clients.append(sdk_client(target, credentials))
        client = clients[-1]
        for stream in (client.subscribe_work(), client.watch(thread_id, 10**9)):
            streams.append(stream)
            tasks.append(asyncio.create_task(anext(stream)))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            with contextlib.suppress(Exception):
                await stream.aclose()
        for client in clients:
            await client.close()


async def idle_cost(
    target: str, dsn: str, credentials: Credentials, operator: Credentials, window: float
) -> list[str]:
    thread_id = f"bench-idle-{time.time_ns() % 10**9}"
    async with sdk_client(target, operator) as admin:
        await admin.create_thread(thread_id, INITIAL)
    lines = []
    for n in (10, 1000):
        async with idle_streams(target, credentials, n, thread_id):
            # opening the streams queries; Postgres flushes an idle backend's counters
            # up to 10 s late: settle first
            await asyncio.sleep(SETTLE_SECONDS)
            before = await transactions(dsn)
            await asyncio.sleep(window)  # the measured window
            after = await transactions(dsn)
        lines.append(
            f"idle cost with {n:>5} SubscribeWork + {n:>5} WatchThread streams: "
            f"{(after - before) / window:.1f} database transactions/s"
        )
    return lines


async def run(args: Any) -> list[str]:
    with temporary_folder() as root, postgres_server(root) as (server_dsn, pid):
        async with bench_database(server_dsn, pid, "ztate_transition") as database:
            ca_dir, certs = root / "ca", root / "certs"
            ca.init_ca(ca_dir, TRUST_DOMAIN)
            server = issue(ca_dir, certs, Role.SERVICE, "transition", server=True)
            operator = issue(ca_dir, certs, Role.OPERATOR, "bench")
            nodes = {name: issue(ca_dir, certs, Role.NODE, name) for name in NODES}
            keyring = root / "keys" / "hmac-keyring.json"
            generate_keyring_file(keyring, "bench-k1")
            port = free_port()
            env = service_environment(
                dsn=database.dsn,
                port=port,
                home=root / "home",
                pki=Pki(server=server, operator=operator, worker=nodes["planner"]),
                keyring_file=keyring,
            ) | {
                "ZTATE_WATCH_MAX_STREAMS": "5000",
                "ZTATE_WATCH_MAX_STREAMS_PER_IDENTITY": "5000",
                "ZTATE_DB_POOL_SIZE": "16",
            }
            with child_server(
                "ztate serve",
                ["-m", "ztate.services.cli.main", "serve"],
                port=port,
                log=root / "serve.log",
                env=env,
            ) as child:
                await wait_until_serving(child, lambda: health_check(child.target, server))
                # idle first, on a quiet database; then the pipeline
                lines = await idle_cost(
                    child.target, database.dsn, nodes["db-writer"], operator, args.window
                )
                lines += await pipeline(child.target, database.dsn, nodes, operator, args)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64, help="handlers per node")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--window", type=float, default=10.0, help="idle window, seconds")
    for line in asyncio.run(run(parser.parse_args())):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
