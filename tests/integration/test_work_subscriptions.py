"""Workers find their work (SubscribeWork, leases): real `ztate serve` replicas, real
worker processes, real Postgres and mTLS.

Two replicas share one database; worker processes of two nodes serve all of their
node's work through ``NodeRunner.serve``. Each handler run is logged by the worker
(tests/integration/workers/work_node.py), and the ledger says what committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import sys
import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

from tests.harness import INITIAL, Pki, authors, client, new_thread_id, with_database
from tests.integration.test_scale_out import (
    Replica,
    replica_env,
    start_replica,
    stop_replica,
    wait_serving,
)
from ztate.worker_sdk import (
    LeaseLost,
    NodeRunner,
    PermissionDenied,
    SyncZtateClient,
    View,
    WorkItem,
    ZtateClient,
)

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("workers") / "work_node.py"
LEASE_SECONDS = 2.0
THREADS = 200
BILLING = """\
format: 1
name: billing
keys:
  invoice_total_cents: {layer: working, type: integer, minimum: 0, maximum: 100000000}
  invoice_note: {layer: working, type: string, max_length: 200}
nodes:
  invoicer:
    layer: working
    read: [invoice_total_cents, invoice_note]
    write: [invoice_total_cents]
    wake: {keys: [invoice_note]}
"""


@dataclass
class Setup:
    dsn: str
    env: dict[str, str]
    pki: Pki
    replicas: list[Replica]
    logs: Path


@pytest_asyncio.fixture(scope="module")
async def setup(
    postgres_server_dsn: str, pki: Pki, keyring_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Setup]:
    name = f"ztate_work_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres_server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = with_database(postgres_server_dsn, name)
    policies = tmp_path_factory.mktemp("work-policies")
    shutil.copyfile(REPO / "services" / "defaults" / "policy.yaml", policies / "pipeline.yaml")
    (policies / "billing.yaml").write_text(BILLING)
    env = replica_env(dsn, pki, keyring_file, policies, tmp_path_factory.mktemp("work-home"))
    env.update(ZTATE_WORK_LEASE_SECONDS=str(LEASE_SECONDS), ZTATE_WORK_POLL_SECONDS="0.5")
    replicas = [await start_replica(env) for _ in range(2)]
    try:
        await asyncio.gather(*(wait_serving(r, pki) for r in replicas))
        yield Setup(dsn, env, pki, replicas, tmp_path_factory.mktemp("work-logs"))
    finally:
        await asyncio.gather(*(stop_replica(r) for r in replicas))


@contextlib.asynccontextmanager
async def workers(
    setup: Setup, specs: list[tuple[str, Replica]], log: Path, *extra: str
) -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Worker processes (node, replica it talks to), stopped with SIGTERM afterwards."""
    processes = []
    for node, replica in specs:
        creds = setup.pki.node(node)
        processes.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                str(WORKER),
                replica.target,
                str(creds.cert),
                str(creds.key),
                str(creds.ca),
                node,
                str(log),
                *extra,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
        )
    try:
        yield processes
    finally:
        for process in processes:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            await asyncio.wait_for(process.wait(), 30)


async def create_threads(target: str, pki: Pki, n: int, policy: str = "pipeline") -> list[str]:
    state: dict[str, Any] = INITIAL if policy == "pipeline" else {"invoice_note": "due"}
    async with client(target, pki.operator()) as operator:
        ids = [new_thread_id() for _ in range(n)]
        for start in range(0, n, 25):
            await asyncio.gather(
                *(operator.create_thread(t, state, policy=policy) for t in ids[start : start + 25])
            )
    return ids


async def heads(dsn: str, thread_ids: list[str]) -> dict[str, int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT thread_id, version FROM ztate.threads WHERE thread_id = ANY($1)", thread_ids
        )
    finally:
        await conn.close()
    return {r["thread_id"]: r["version"] for r in rows}


async def all_at(dsn: str, thread_ids: list[str], version: int, within: float) -> dict[str, int]:
    """Wait until every thread's head is at ``version`` (or fail with what is not)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        found = await heads(dsn, thread_ids)
        if all(found.get(t) == version for t in thread_ids):
            return found
        if loop.time() > deadline:
            behind = {t: v for t, v in found.items() if v != version}
            some = list(behind.items())[:5]
            pytest.fail(f"{len(behind)} threads not at version {version}: {some}")
        await asyncio.sleep(0.2)  # polling the ledger, with a deadline


def runs(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


async def test_five_processes_of_two_nodes_share_200_threads_over_two_replicas(
    setup: Setup,
) -> None:
    log = setup.logs / "share.jsonl"
    one, two = setup.replicas
    specs = [("input-parser", one), ("input-parser", two), ("input-parser", one)]
    specs += [("planner", two), ("planner", one)]
    async with workers(setup, specs, log) as processes:
        threads = await create_threads(one.target, setup.pki, THREADS)
        billing = await create_threads(two.target, setup.pki, 5, policy="billing")
        await all_at(setup.dsn, threads, 2, within=90)
        # nothing more is due: nobody wakes again (own commits never wake a node)
        await asyncio.sleep(LEASE_SECONDS)  # a window in which extra runs would show
        handled = runs(log)
    # every thread: input-parser made version 1, the planner version 2, once each
    made = await authors(setup.dsn, threads)
    assert Counter(made.values()) == {"input-parser": THREADS, "planner": THREADS}
    assert all(made[(t, 1)] == "input-parser" and made[(t, 2)] == "planner" for t in threads)
    # each triggering version handled exactly once per node
    per = Counter((r["node"], r["thread"], r["version"]) for r in handled)
    assert set(per.values()) == {1}
    assert {(n, v) for n, _, v in per} == {("input-parser", 0), ("planner", 1)}
    assert len(per) == 2 * THREADS
    # never two holders at once: the runs on one thread of one node never overlap
    by_key: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for r in handled:
        by_key[(r["node"], r["thread"])].append((r["start"], r["end"]))
    for spans in by_key.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    # none starved: every process of each node did some of the work
    pids = {p.pid for p in processes}
    assert {r["pid"] for r in handled} == pids
    # a node never sees a thread of another policy, nor a key it may not read
    assert not {r["thread"] for r in handled} & set(billing)
    assert all(set(r["keys"]) <= {"raw_text"} for r in handled if r["node"] == "input-parser")


async def test_a_killed_workers_threads_are_taken_over_within_the_lease(setup: Setup) -> None:
    log = setup.logs / "kill.jsonl"
    one, two = setup.replicas
    async with workers(setup, [("input-parser", one)], log, "--hang", "--concurrency", "8") as (
        hanging,
    ):
        threads = await create_threads(two.target, setup.pki, 8)
        conn = await asyncpg.connect(setup.dsn)
        try:
            # the hanging worker holds every lease
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while await conn.fetchval(
                "SELECT count(*) FROM ztate.node_work WHERE thread_id = ANY($1) "
                "AND node = 'input-parser' AND holder IS NOT NULL",
                threads,
            ) < len(threads):
                assert loop.time() < deadline, "the worker never took the leases"
                await asyncio.sleep(0.1)  # polling, with a deadline
        finally:
            await conn.close()
        hanging.kill()  # kill -9: no release
        await hanging.wait()
        killed_at = asyncio.get_running_loop().time()
        async with workers(setup, [("input-parser", two)], log):
            await all_at(setup.dsn, threads, 1, within=LEASE_SECONDS + 15)
            taken_after = asyncio.get_running_loop().time() - killed_at
    made = await authors(setup.dsn, threads)
    assert set(made.values()) == {"input-parser"}
    assert len(made) == len(threads)
    assert taken_after < LEASE_SECONDS + 10


async def test_a_service_restart_loses_no_work(setup: Setup) -> None:
    log = setup.logs / "restart.jsonl"
    extra = await start_replica(setup.env)
    await wait_serving(extra, setup.pki)
    threads = await create_threads(extra.target, setup.pki, 30)
    extra.process.kill()  # kill -9 right after the commits: wakes may be undecided
    await extra.process.wait()
    one = setup.replicas[0]
    async with workers(setup, [("input-parser", one)], log):
        await all_at(setup.dsn, threads, 1, within=30)
    made = await authors(setup.dsn, threads)
    assert Counter(made.values()) == {"input-parser": 30}


async def test_lease_calls_and_fencing_reveal_no_thread(setup: Setup) -> None:
    one = setup.replicas[0]
    (billing,) = await create_threads(one.target, setup.pki, 1, policy="billing")
    (pipeline,) = await create_threads(one.target, setup.pki, 1)
    missing = new_thread_id()
    creds = setup.pki.node("planner")
    answers = []
    async with ZtateClient.from_files(
        one.target, cert=creds.cert, key=creds.key, ca=creds.ca
    ) as planner:
        for thread_id in (billing, pipeline, missing):
            for call in (
                planner.renew_lease(thread_id, 1),
                planner.release_lease(thread_id, 1, 0),
                planner.propose(
                    thread_id,
                    0,
                    {"pending_transition": {"action": "lookup", "order_id": "A"}},
                    lease_epoch=7,
                ),
            ):
                with pytest.raises(LeaseLost) as refused:
                    await call
                answers.append((refused.value.reason, str(refused.value)))
                assert thread_id not in str(refused.value)
    # the same answer for a thread of another policy, one of its own, and none at all
    assert len(set(answers[0::3])) == 1
    assert len(set(answers[1::3])) == 1
    assert len(set(answers[2::3])) == 1
    assert {a for a, _ in answers} == {"LEASE_LOST"}
    # nothing was committed by the fenced proposals
    assert await heads(setup.dsn, [billing, pipeline]) == {billing: 0, pipeline: 0}
    operator = setup.pki.operator()
    async with ZtateClient.from_files(
        one.target, cert=operator.cert, key=operator.key, ca=operator.ca
    ) as admin:
        stream = admin.subscribe_work()
        with pytest.raises(PermissionDenied, match="nodes subscribe"):
            await anext(stream)


async def test_the_blocking_client_serves_a_nodes_work_and_stops_cleanly(setup: Setup) -> None:
    one = setup.replicas[1]
    threads = await create_threads(one.target, setup.pki, 6, policy="billing")
    creds = setup.pki.node("invoicer")
    stop = threading.Event()
    seen: list[tuple[str, dict[str, Any]]] = []

    def handler(view: View) -> dict[str, Any]:
        seen.append((view.thread_id, view.state))
        return {"invoice_total_cents": 7}

    with SyncZtateClient.from_files(
        one.target, cert=creds.cert, key=creds.key, ca=creds.ca
    ) as invoicer:
        serving = asyncio.create_task(
            asyncio.to_thread(
                invoicer.serve, handler, node_name="invoicer", concurrency=3, stop=stop
            )
        )
        try:
            await all_at(setup.dsn, threads, 1, within=30)
        finally:
            stop.set()
        steps = await asyncio.wait_for(serving, 30)
    mine = [s for s in steps if s.transition is not None and s.transition.thread_id in threads]
    assert sorted(s.transition.thread_id for s in mine if s.transition) == sorted(threads)
    assert all(s.status == "committed" for s in mine)
    assert {t for t, _ in seen} >= set(threads)
    assert all(state == {"invoice_note": "due"} for t, state in seen if t in threads)


async def next_item_on(stream: Any, thread_id: str, within: float = 20.0) -> WorkItem:
    """The first item of ``stream`` on ``thread_id`` (others are left to lapse)."""
    async with asyncio.timeout(within):
        while True:
            item: WorkItem = await anext(stream)
            if item.thread_id == thread_id:
                return item


async def test_a_stale_holder_is_fenced_off(setup: Setup) -> None:
    one, two = setup.replicas
    (thread_id,) = await create_threads(one.target, setup.pki, 1)
    creds = setup.pki.node("input-parser")
    patch = {"requested_action": {"action": "lookup", "order_id": "A-1"}}
    first = ZtateClient.from_files(one.target, cert=creds.cert, key=creds.key, ca=creds.ca)
    second = ZtateClient.from_files(two.target, cert=creds.cert, key=creds.key, ca=creds.ca)
    async with first, second:
        stale = await next_item_on(first.subscribe_work(max_in_flight=64), thread_id)
        # never renewed: the lease lapses and the other replica grants it again
        fresh = await next_item_on(second.subscribe_work(max_in_flight=64), thread_id)
        assert fresh.lease_epoch > stale.lease_epoch
        with pytest.raises(LeaseLost):
            await first.propose(thread_id, stale.version, patch, lease_epoch=stale.lease_epoch)
        assert await heads(setup.dsn, [thread_id]) == {thread_id: 0}  # nothing committed
        committed = await second.propose(
            thread_id, fresh.version, patch, lease_epoch=fresh.lease_epoch
        )
        assert committed.version == 1
        # the proposal released the lease: renewing it now is refused
        with pytest.raises(LeaseLost):
            await second.renew_lease(thread_id, fresh.lease_epoch)


async def test_a_handler_that_raises_is_logged_and_its_work_comes_back_after_the_lease(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler that raises is said in the worker's log (the exception's type, never
    its message, which may hold state values), nothing is proposed, and the thread is
    handed out again once the lease lapses: the second try commits. (The failure was
    lost: an unretrieved task exception, no log line.)"""
    one = setup.replicas[1]
    [thread_id] = await create_threads(one.target, setup.pki, 1, policy="billing")
    creds = setup.pki.node("invoicer")
    calls: list[str] = []

    def handler(view: View) -> dict[str, Any]:
        calls.append(view.thread_id)
        if view.thread_id == thread_id and calls.count(thread_id) == 1:
            raise RuntimeError("a value of the state: 4111-1111")
        return {"invoice_total_cents": 7}

    caplog.set_level("WARNING", logger="ztate.worker_sdk.runner")
    async with ZtateClient.from_files(
        one.target, cert=creds.cert, key=creds.key, ca=creds.ca
    ) as invoicer:
        runner = NodeRunner.for_node(invoicer, handler, node_name="invoicer", concurrency=2)
        stop = asyncio.Event()
        serving = asyncio.create_task(runner.serve(stop))
        try:
            await all_at(setup.dsn, [thread_id], 1, within=30)
        finally:
            stop.set()
        await asyncio.wait_for(serving, 30)
    assert calls.count(thread_id) == 2
    said = [r.getMessage() for r in caplog.records if r.name == "ztate.worker_sdk.runner"]
    assert (
        f"invoicer: handling thread {thread_id} failed (RuntimeError); it is handed out "
        "again once its lease lapses" in said
    )
    assert not any("4111" in r.getMessage() for r in caplog.records)
    conn = await asyncpg.connect(setup.dsn)
    try:
        rows = await conn.fetch(
            "SELECT version FROM ztate.transitions WHERE thread_id = $1 ORDER BY version",
            thread_id,
        )
    finally:
        await conn.close()
    assert [r["version"] for r in rows] == [0, 1]  # one commit: the failed try wrote nothing
