"""Scale-out on Citus: three `ztate serve` replicas on a coordinator and two workers.

The scenarios of tests/integration/test_scale_out.py run here unchanged (imported,
with ``cluster`` given by a Citus database), and one more: a replica killed with
SIGKILL while workers race through all three. Workers that lose a call in flight
retry it, with the same idempotency key, through another replica. Afterwards no
thread forked or skipped a version, every acknowledged commit is in the ledger (and
nothing else is), and `ztate verify` exits 0.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from tests.harness import Pki, act
from tests.integration.test_scale_out import (
    Cluster,
    assert_one_chain,
    create_thread,
    head,
    ledger_rows,
    replicas_on,
    run_ztate,
    start_replica,
    stop_replica,
    wait_serving,
)
from tests.integration.test_scale_out import (
    test_a_stale_cached_head_on_one_replica_cannot_fork as test_a_stale_cached_head_on_one_replica_cannot_fork,  # noqa: E501
)
from tests.integration.test_scale_out import (
    test_concurrent_workers_across_replicas_keep_one_chain as test_concurrent_workers_across_replicas_keep_one_chain,  # noqa: E501
)
from ztate.worker_sdk import StaleVersion, Transition, Unavailable, ZtateClient

THREADS = 4
WORKERS_PER_THREAD = 3
COMMITS_PER_WORKER = 6
KILL_AFTER = THREADS * WORKERS_PER_THREAD * COMMITS_PER_WORKER // 3  # acknowledged commits


@pytest_asyncio.fixture(scope="module")
async def cluster(
    citus_dsn: str,
    pki: Pki,
    keyring_file: Path,
    policy_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Cluster]:
    home = tmp_path_factory.mktemp("citus-scale-home")
    async with replicas_on(citus_dsn, pki, keyring_file, policy_dir, home) as running:
        yield running


@dataclass
class Race:
    """What the racing workers saw: every acknowledgement, and the calls lost."""

    victim: asyncio.subprocess.Process
    # per thread: (the version acknowledged, the idempotency key of the request)
    acknowledged: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    lost_in_transport: int = 0
    killed_at: int | None = None

    def acknowledge(self, thread_id: str, committed: Transition, key: str) -> None:
        self.acknowledged.setdefault(thread_id, []).append((committed.version, key))
        total = sum(len(v) for v in self.acknowledged.values())
        if total == KILL_AFTER:  # mid-race: others' calls are in flight on every replica
            self.victim.send_signal(signal.SIGKILL)
            self.killed_at = total


async def requests_in_ledger(dsn: str, thread_id: str) -> list[tuple[int, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT version, idempotency_key FROM ztate.transitions "
            "WHERE thread_id = $1 AND version > 0",
            thread_id,
        )
    finally:
        await conn.close()
    return [(r["version"], r["idempotency_key"]) for r in rows]


def named_head(stale: StaleVersion) -> int:
    """The head a STALE_VERSION refusal names (the service always names it)."""
    assert stale.current_version is not None, stale
    return stale.current_version


async def racing_worker(
    thread_id: str, clients: list[ZtateClient], tag: str, barrier: asyncio.Barrier, race: Race
) -> None:
    """Commit COMMITS_PER_WORKER patches, each call through the next replica. A call
    lost in transport (its outcome unknown) is repeated as is, with its idempotency
    key, through the next replica; a stale one is a new request on the named head."""
    replicas = itertools.cycle(clients)
    expected = 0
    await barrier.wait()
    for n in range(COMMITS_PER_WORKER):
        patch = {"requested_action": act(f"{tag}-{n}")}
        key = uuid.uuid4().hex
        while True:
            try:
                committed = await next(replicas).propose(
                    thread_id, expected, patch, idempotency_key=key
                )
            except Unavailable:
                race.lost_in_transport += 1
                continue
            except StaleVersion as stale:
                expected, key = named_head(stale), uuid.uuid4().hex
                continue
            race.acknowledge(thread_id, committed, key)
            expected = committed.version
            break


async def test_a_replica_killed_mid_race_loses_no_acknowledged_commit(
    cluster: Cluster, pki: Pki
) -> None:
    victim = await start_replica(cluster.env)
    await wait_serving(victim, pki)
    replicas = [cluster.replicas[0], cluster.replicas[1], victim]
    threads = [await create_thread(cluster, pki) for _ in range(THREADS)]
    creds = pki.node("input-parser")
    clients = [
        [
            ZtateClient.from_files(
                r.target, cert=creds.cert, key=creds.key, ca=creds.ca, timeout=10, retries=0
            )
            for r in replicas
        ]
        for _ in range(THREADS * WORKERS_PER_THREAD)
    ]
    race = Race(victim.process)
    barrier = asyncio.Barrier(THREADS * WORKERS_PER_THREAD)
    try:
        await asyncio.wait_for(
            asyncio.gather(
                *(
                    racing_worker(
                        thread_id,
                        clients[i][w % 3 :] + clients[i][: w % 3],
                        f"{thread_id[-4:]}-k{w}",
                        barrier,
                        race,
                    )
                    for i, (thread_id, w) in enumerate(
                        itertools.product(threads, range(WORKERS_PER_THREAD))
                    )
                )
            ),
            120,
        )
    finally:
        for per_worker in clients:
            for c in per_worker:
                await c.close()
        code = await stop_replica(victim)
    assert race.killed_at == KILL_AFTER
    assert code == -signal.SIGKILL
    assert race.lost_in_transport > 0  # calls did go to the dead replica

    for thread_id in threads:
        rows = await ledger_rows(cluster.dsn, thread_id)
        assert_one_chain(rows)  # no fork, no gap
        acknowledged = race.acknowledged[thread_id]
        assert len(acknowledged) == WORKERS_PER_THREAD * COMMITS_PER_WORKER
        # the ledger holds exactly the acknowledged requests, each at the version its
        # acknowledgement named (a replayed one names the original's)
        assert sorted(acknowledged) == sorted(await requests_in_ledger(cluster.dsn, thread_id))
        assert await head(cluster.dsn, thread_id) == (rows[-1]["version"], rows[-1]["digest"])

    code, stdout, stderr = await run_ztate("verify", env=cluster.env)
    assert code == 0, stdout + stderr
