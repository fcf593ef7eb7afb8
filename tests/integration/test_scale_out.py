"""Scale-out: three `ztate serve` replicas, one database, concurrent workers.

The transition service keeps no state a replica must share: the head cache is a
private optimisation, and the compare-and-swap on (version, parent digest) in
Postgres decides every commit. These tests run three real replica processes
(started together, so they also race on the migrations) on one fresh database,
with the same keyring, policy and certificates, and prove:

- a replica building on a stale cached head does not fork: its commit is
  refused with ABORTED / STALE_VERSION and nothing is written;
- workers proposing on the same threads through different replicas get exactly
  one winner per version; the losers see STALE_VERSION, re-read and retry;
- every acknowledged commit is in the ledger at its version, versions are
  contiguous, each parent digest is the previous digest, a retry through another
  replica replays the original outcome, and `ztate verify` exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import grpc
import pytest
import pytest_asyncio

from tests.harness import INITIAL, TRUST_DOMAIN, Pki, act, client, new_thread_id, with_database
from tests.integration.test_run_command import free_port
from ztate.approval_service.app import start as start_approval
from ztate.contract.keyring import generate_signing_key
from ztate.services.cli import ca
from ztate.services.cli.health_probe import APPROVAL_SERVICE, TRANSITION_SERVICE, Probe, check
from ztate.services.runtime.config import ApprovalSettings
from ztate.services.runtime.identity import Identity, Role
from ztate.services.store.migrate import bundled_migrations
from ztate.worker_sdk import StaleVersion, Transition, ZtateClient

REPLICAS = 3
THREADS = 3
WORKERS_PER_THREAD = 3
COMMITS_PER_WORKER = 4
START_TIMEOUT_SECONDS = 60.0
ZTATE = Path(sys.executable).with_name("ztate")
GENESIS_PARENT = "0" * 64


@dataclass
class Replica:
    port: int
    process: asyncio.subprocess.Process
    log: bytearray = field(default_factory=bytearray)

    @property
    def target(self) -> str:
        return f"localhost:{self.port}"


@dataclass(frozen=True)
class Cluster:
    dsn: str
    env: dict[str, str]
    replicas: list[Replica]


def replica_env(
    dsn: str, pki: Pki, keyring_file: Path, policy_dir: Path, home: Path
) -> dict[str, str]:
    """What every replica is given: the same database, keys, policy and identity."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    env.update(
        DATABASE_URL=dsn,
        ZTATE_HOME=str(home),
        ZTATE_TRUST_DOMAIN=TRUST_DOMAIN,
        ZTATE_TLS_CERT=str(pki.certs / "service-transition.crt"),
        ZTATE_TLS_KEY=str(pki.certs / "service-transition.key"),
        ZTATE_TLS_CA=str(pki.certs / "ca.crt"),
        ZTATE_POLICY_PATH=str(policy_dir),
        ZTATE_HMAC_KEYRING_FILE=str(keyring_file),
        ZTATE_DB_POOL_SIZE="4",
    )
    return env


async def start_replica(env: dict[str, str]) -> Replica:
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        str(ZTATE),
        "serve",
        env=dict(env, ZTATE_LISTEN=f"127.0.0.1:{port}"),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    replica = Replica(port, process)

    async def drain() -> None:  # keep reading, so logging never blocks on a full pipe
        assert process.stderr is not None
        while line := await process.stderr.readline():
            replica.log += line

    asyncio.get_running_loop().create_task(drain())
    return replica


async def wait_serving(replica: Replica, pki: Pki) -> None:
    """Poll the replica's gRPC health (over mTLS) until SERVING, or fail at the deadline."""
    probe = Probe(
        target=replica.target,
        service=TRANSITION_SERVICE,
        cert=pki.certs / "service-transition.crt",
        key=pki.certs / "service-transition.key",
        ca=pki.certs / "ca.crt",
        timeout=1.0,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_TIMEOUT_SECONDS
    while True:
        assert replica.process.returncode is None, (
            f"replica on port {replica.port} exited: {replica.log.decode(errors='replace')}"
        )
        try:
            if await check(probe) == "SERVING":
                return
        except grpc.RpcError:
            pass  # not listening yet
        assert loop.time() < deadline, f"replica on port {replica.port} never served"
        await asyncio.sleep(0.1)  # the polling interval of a deadline-bounded wait


async def stop_replica(replica: Replica) -> int:
    if replica.process.returncode is None:
        replica.process.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(replica.process.wait(), 30)
    except TimeoutError:
        replica.process.kill()
        log = replica.log.decode(errors="replace")[-4000:]
        raise AssertionError(f"replica on port {replica.port} ignored SIGTERM:\n{log}") from None


@pytest_asyncio.fixture(scope="module")
async def cluster(
    postgres_server_dsn: str,
    pki: Pki,
    keyring_file: Path,
    policy_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Cluster]:
    """Three replicas on a database of their own, so `ztate verify` checks only theirs."""
    name = f"ztate_scale_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres_server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = with_database(postgres_server_dsn, name)
    home = tmp_path_factory.mktemp("scale-home")
    async with replicas_on(dsn, pki, keyring_file, policy_dir, home) as cluster:
        yield cluster


@contextlib.asynccontextmanager
async def replicas_on(
    dsn: str, pki: Pki, keyring_file: Path, policy_dir: Path, home: Path
) -> AsyncIterator[Cluster]:
    """REPLICAS `ztate serve` processes on ``dsn``, started together and serving; each
    must stop cleanly (exit 0) on SIGTERM afterwards."""
    env = replica_env(dsn, pki, keyring_file, policy_dir, home)
    replicas = [await start_replica(env) for _ in range(REPLICAS)]
    try:
        await asyncio.gather(*(wait_serving(r, pki) for r in replicas))
        yield Cluster(dsn, env, replicas)
    finally:
        codes = await asyncio.gather(*(stop_replica(r) for r in replicas))
    assert codes == [0] * REPLICAS


async def ledger_rows(dsn: str, thread_id: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(
            "SELECT version, digest, parent_digest, node_id FROM ztate.transitions "
            "WHERE thread_id = $1 ORDER BY version",
            thread_id,
        )
    finally:
        await conn.close()


async def head(dsn: str, thread_id: str) -> tuple[int, str]:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT version, head_digest FROM ztate.threads WHERE thread_id = $1", thread_id
        )
    finally:
        await conn.close()
    assert row is not None
    return row["version"], row["head_digest"]


def assert_one_chain(rows: list[asyncpg.Record]) -> None:
    """Versions 0..n without gaps, each record's parent the previous record: no fork."""
    assert [r["version"] for r in rows] == list(range(len(rows)))
    parents = [GENESIS_PARENT] + [r["digest"] for r in rows[:-1]]
    assert [r["parent_digest"] for r in rows] == parents


async def create_thread(cluster: Cluster, pki: Pki) -> str:
    thread_id = new_thread_id()
    async with client(cluster.replicas[0].target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    return thread_id


async def test_a_stale_cached_head_on_one_replica_cannot_fork(cluster: Cluster, pki: Pki) -> None:
    a, b = cluster.replicas[0], cluster.replicas[1]
    thread_id = await create_thread(cluster, pki)
    async with client(a.target, pki.node("input-parser")) as via_a:
        first = await via_a.propose(thread_id, 0, {"requested_action": act("first")})
    # replica A now caches the head at version 1; B moves the thread to version 2
    async with client(b.target, pki.node("input-parser")) as via_b:
        second = await via_b.propose(thread_id, 1, {"requested_action": act("second")})
    assert (first.version, second.version) == (1, 2)
    before = await ledger_rows(cluster.dsn, thread_id)

    # A's cached head matches the expected version 1, so A builds version 2 on it;
    # the compare-and-swap in Postgres refuses it
    async with client(a.target, pki.node("input-parser")) as via_a:
        with pytest.raises(StaleVersion) as refused:
            await via_a.propose(thread_id, 1, {"requested_action": act("forked")})
    assert refused.value.code is grpc.StatusCode.ABORTED
    assert refused.value.reason == "STALE_VERSION"
    assert refused.value.current_version == 2
    assert await ledger_rows(cluster.dsn, thread_id) == before  # nothing written
    assert await head(cluster.dsn, thread_id) == (2, before[-1]["digest"])
    assert_one_chain(before)

    # with the version the refusal named, A commits on the real head
    async with client(a.target, pki.node("input-parser")) as via_a:
        third = await via_a.propose(thread_id, 2, {"requested_action": act("third")})
    assert (third.version, third.parent_digest) == (3, second.digest)


@dataclass
class Tally:
    acknowledged: list[Transition] = field(default_factory=list)
    # (status code, reason, the head the refusal named, the version proposed on)
    stale: list[tuple[grpc.StatusCode, str, int | None, int]] = field(default_factory=list)


async def worker(
    thread_id: str,
    clients: list[ZtateClient],
    tag: str,
    start_together: asyncio.Barrier,
    tally: Tally,
) -> None:
    """Commit COMMITS_PER_WORKER patches, each through the next replica, retrying on
    STALE_VERSION with the version the refusal names."""
    replicas = itertools.cycle(clients)
    view = await next(replicas).get_view(thread_id)
    expected = view.version
    await start_together.wait()  # the first proposals all race for the same version
    for n in range(COMMITS_PER_WORKER):
        patch = {"requested_action": act(f"{tag}-{n}")}
        while True:
            try:
                committed = await next(replicas).propose(thread_id, expected, patch)
            except StaleVersion as stale:
                tally.stale.append((stale.code, stale.reason, stale.current_version, expected))
                # re-read only if the refusal did not name the head (asserted afterwards)
                expected = (
                    stale.current_version or (await next(replicas).get_view(thread_id)).version
                )
                continue
            tally.acknowledged.append(committed)
            expected = committed.version
            break


async def test_concurrent_workers_across_replicas_keep_one_chain(
    cluster: Cluster, pki: Pki
) -> None:
    threads = [await create_thread(cluster, pki) for _ in range(THREADS)]
    # one channel per worker per replica, as separate worker processes would have
    clients = [
        [client(r.target, pki.node("input-parser")) for r in cluster.replicas]
        for _ in range(THREADS * WORKERS_PER_THREAD)
    ]
    tallies = {t: Tally() for t in threads}
    barrier = asyncio.Barrier(THREADS * WORKERS_PER_THREAD)
    try:
        await asyncio.wait_for(
            asyncio.gather(
                *(
                    worker(
                        thread_id,
                        # each worker starts on a different replica
                        clients[i][w % REPLICAS :] + clients[i][: w % REPLICAS],
                        f"{thread_id[-4:]}-w{w}",
                        barrier,
                        tallies[thread_id],
                    )
                    for i, (thread_id, w) in enumerate(
                        itertools.product(threads, range(WORKERS_PER_THREAD))
                    )
                )
            ),
            60,
        )
        for thread_id in threads:
            tally = tallies[thread_id]
            rows = await ledger_rows(cluster.dsn, thread_id)
            assert_one_chain(rows)
            # every commit was acknowledged once and every acknowledgement is in the ledger
            assert len(tally.acknowledged) == WORKERS_PER_THREAD * COMMITS_PER_WORKER
            assert len(rows) == 1 + len(tally.acknowledged)
            at = {r["version"]: r["node_id"] for r in rows}
            assert sorted(t.version for t in tally.acknowledged) == sorted(at)[1:]
            assert all(at[t.version] == t.node_id for t in tally.acknowledged)
            assert await head(cluster.dsn, thread_id) == (rows[-1]["version"], rows[-1]["digest"])
            # all workers of a thread first proposed on one version: one won, the rest retried
            assert len(tally.stale) >= WORKERS_PER_THREAD - 1
            for code, reason, named, proposed_on in tally.stale:
                assert (code, reason) == (grpc.StatusCode.ABORTED, "STALE_VERSION")
                assert named is not None
                assert named > proposed_on

        # a retry through another replica returns the original outcome, writes nothing
        thread_id = threads[0]
        original = tallies[thread_id].acknowledged[0]
        retry_key = uuid.uuid4().hex
        once = {"requested_action": act("once")}
        async with client(cluster.replicas[0].target, pki.node("input-parser")) as first:
            view = await first.get_view(thread_id)
            done = await first.propose(thread_id, view.version, once, idempotency_key=retry_key)
        count = len(await ledger_rows(cluster.dsn, thread_id))
        async with client(cluster.replicas[2].target, pki.node("input-parser")) as again:
            replayed = await again.propose(thread_id, view.version, once, idempotency_key=retry_key)
        assert replayed.replayed
        assert (replayed.committed_at, replayed.version) == (done.committed_at, done.version)
        assert len(await ledger_rows(cluster.dsn, thread_id)) == count
        assert original.version != done.version
    finally:
        for per_worker in clients:
            for c in per_worker:
                await c.close()

    verify = await asyncio.create_subprocess_exec(
        str(ZTATE),
        "verify",
        env=cluster.env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(verify.communicate(), 60)
    assert verify.returncode == 0, (stdout + stderr).decode()


async def test_health_command_reports_each_replica(cluster: Cluster, pki: Pki) -> None:
    """`ztate health`, the containers' probe, from the replica's own configuration."""
    for replica in cluster.replicas:
        probe = await asyncio.create_subprocess_exec(
            str(ZTATE),
            "health",
            env=dict(cluster.env, ZTATE_LISTEN=f"127.0.0.1:{replica.port}"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(probe.communicate(), 30)
        assert probe.returncode == 0, stderr.decode()
        assert stdout.decode().strip() == f"{TRANSITION_SERVICE}: SERVING"

    # a service name the server does not know: answered, not serving
    unknown = await asyncio.create_subprocess_exec(
        str(ZTATE),
        "health",
        "--target",
        cluster.replicas[0].target,
        "--service",
        "ztate.v1.NoSuchService",
        env=cluster.env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(unknown.communicate(), 30)
    assert unknown.returncode == 1
    assert b"SERVICE_UNKNOWN" in stderr
    # ... which is alive all the same: liveness asks only whether the server answers
    code, _, stderr_text = await run_ztate(
        "health", "--live", "--target", cluster.replicas[0].target,
        "--service", "ztate.v1.NoSuchService", env=cluster.env,
    )  # fmt: skip
    assert code == 0, stderr_text
    assert "SERVICE_UNKNOWN" in stderr_text

    # nothing listening: could not ask
    closed = await asyncio.create_subprocess_exec(
        str(ZTATE),
        "health",
        "--target",
        f"localhost:{free_port()}",
        "--timeout",
        "1",
        env=cluster.env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(closed.communicate(), 30)
    assert closed.returncode == 4  # unreachable
    assert b"UNAVAILABLE" in stderr or b"DEADLINE_EXCEEDED" in stderr
    # ... and not alive either
    code, _, stderr_text = await run_ztate(
        "health", "--live", "--target", f"localhost:{free_port()}", "--timeout", "1",
        env=cluster.env,
    )  # fmt: skip
    assert code == 4
    assert "UNAVAILABLE" in stderr_text or "DEADLINE_EXCEEDED" in stderr_text


async def run_ztate(*argv: str, env: dict[str, str]) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        str(ZTATE),
        *argv,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_the_migration_job_applies_both_schemas_once(postgres_server_dsn: str) -> None:
    """`ztate db migrate`, the deployment's job that runs before the replicas start."""
    name = f"ztate_job_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres_server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = with_database(postgres_server_dsn, name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}

    without = {k: v for k, v in env.items() if k != "DATABASE_URL"}
    code, _, stderr = await run_ztate("db", "migrate", env=without)
    assert code == 2
    assert "DATABASE_URL is not set" in stderr

    code, stdout, stderr = await run_ztate("db", "migrate", env=dict(env, DATABASE_URL=dsn))
    assert code == 0, stderr
    lines = stdout.splitlines()
    shipped = bundled_migrations()
    names = ", ".join(f"{m.number:04d}_{m.name}" for m in shipped)
    assert lines[0] == f"transition service: {names}"
    assert lines[1] == (
        "approval service: 0001_reviews, 0002_delivery_outcome, 0003_undelivered_receipts, "
        "0004_review_reads, 0005_hex_check_without_counted_regex, "
        "0006_decisions_name_their_certificate"
    )
    assert dsn not in stdout + stderr
    conn = await asyncpg.connect(dsn)
    try:
        applied = await conn.fetchval("SELECT count(*) FROM public.ztate_schema_migrations")
        tables = {
            f"{r['schemaname']}.{r['tablename']}"
            for r in await conn.fetch(
                "SELECT schemaname, tablename FROM pg_tables "
                "WHERE schemaname IN ('ztate', 'ztate_approval')"
            )
        }
    finally:
        await conn.close()
    assert applied == len(shipped)
    assert {
        "ztate.threads",
        "ztate.transitions",
        "ztate.rejections",
        "ztate.pending_transitions",
        "ztate_approval.reviews",
        "ztate_approval.receipts",
    } <= tables

    code, stdout, _ = await run_ztate("db", "migrate", env=dict(env, DATABASE_URL=dsn))
    assert code == 0
    assert stdout.splitlines() == ["transition service: up to date", "approval service: up to date"]

    # the optional Citus layout refuses a database without the extension
    code, _, stderr = await run_ztate("db", "citus", env=dict(env, DATABASE_URL=dsn))
    assert code == 2
    assert "citus extension is not installed" in stderr


async def test_health_command_probes_the_approval_service_by_its_certificate_name(
    cluster: Cluster, pki: Pki, tmp_path: Path
) -> None:
    """As in Kubernetes: the approval service's certificate names its Service
    (ztate-approval), not localhost, so the probe passes --server-name."""
    issued = ca.issue(
        pki.ca_dir,
        Identity(TRUST_DOMAIN, Role.SERVICE, "approval"),
        tmp_path / "certs",
        dns_names=("ztate-approval",),
    )
    generate_signing_key(tmp_path / "signing.pem", tmp_path / "public.json", "approval-k1")
    settings = ApprovalSettings(
        ZTATE_HOME=tmp_path,
        ZTATE_TRUST_DOMAIN=TRUST_DOMAIN,
        listen="127.0.0.1:0",
        tls_cert=issued.cert,
        tls_key=issued.key,
        tls_ca=issued.ca_cert,
        signing_key_file=tmp_path / "signing.pem",
        transition_target=cluster.replicas[0].target,
        transition_server_name="localhost",
        db_pool_size=2,
    )
    running = await start_approval(settings, dsn=cluster.dsn)
    try:
        env = dict(
            cluster.env,
            ZTATE_APPROVAL_LISTEN=f"127.0.0.1:{running.port}",
            ZTATE_APPROVAL_TLS_CERT=str(issued.cert),
            ZTATE_APPROVAL_TLS_KEY=str(issued.key),
            ZTATE_APPROVAL_TLS_CA=str(issued.ca_cert),
        )
        code, stdout, stderr = await run_ztate(
            "health", "--approval", "--server-name", "ztate-approval", env=env
        )
        assert code == 0, stderr
        assert stdout.strip() == f"{APPROVAL_SERVICE}: SERVING"
        # localhost is not a name in this certificate: the handshake fails, nothing is asked
        code, _, stderr = await run_ztate("health", "--approval", "--timeout", "2", env=env)
        assert code == 4
        assert "UNAVAILABLE" in stderr or "DEADLINE_EXCEEDED" in stderr
    finally:
        await running.stop(grace=1.0)


LOGINS_SQL = Path(__file__).resolve().parents[2] / "deploy" / "logins.sql"
# the Debian Postgres client every CI machine has (Debian puts it on PATH too)
PSQL = shutil.which("psql") or "/usr/lib/postgresql/15/bin/psql"


def as_login(dsn: str, login: str, password: str) -> str:
    parts = urlsplit(dsn)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(
        (parts.scheme, f"{login}:{password}@{host}", parts.path, parts.query, parts.fragment)
    )


async def test_a_replica_runs_with_a_login_that_owns_nothing(
    postgres_server_dsn: str, pki: Pki, keyring_file: Path, policy_dir: Path, tmp_path: Path
) -> None:
    """The deployment's split (deploy/README.md): the migration job as the owner, each
    service as a login that is only a member of that service's roles."""
    name = f"ztate_least_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres_server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    owner_dsn = with_database(postgres_server_dsn, name)
    base = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    # a replica that must not migrate refuses a database the job has not migrated yet ...
    unmigrated = dict(
        replica_env(owner_dsn, pki, keyring_file, policy_dir, tmp_path),
        ZTATE_MIGRATE_ON_START="false",
        ZTATE_LISTEN=f"127.0.0.1:{free_port()}",
    )
    code, _, stderr = await run_ztate("serve", env=unmigrated)
    assert code != 0
    assert "public.ztate_schema_migrations is missing): run `ztate db migrate`" in stderr
    owner = await asyncpg.connect(owner_dsn)
    try:  # ... and changes nothing
        assert await owner.fetchval("SELECT to_regclass('public.ztate_schema_migrations')") is None
        assert await owner.fetchval("SELECT to_regnamespace('ztate')") is None
    finally:
        await owner.close()

    code, _, stderr = await run_ztate("db", "migrate", env=dict(base, DATABASE_URL=owner_dsn))
    assert code == 0, stderr

    # both services' logins, made by the file compose's `logins` service runs (psql)
    login, password = f"ztate_svc_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    approver, approver_password = f"ztate_appr_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    variables = {
        "transition_login": login,
        "transition_password": password,
        "approval_login": approver,
        "approval_password": approver_password,
    }
    for _ in range(2):  # run again, it creates nothing new and fails on nothing
        made = await asyncio.to_thread(
            subprocess.run,
            [PSQL, owner_dsn, "-q", "-v", "ON_ERROR_STOP=1", "-f", str(LOGINS_SQL)]
            + [arg for name, value in variables.items() for arg in ("-v", f"{name}={value}")],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert made.returncode == 0, made.stderr
    service_dsn = as_login(owner_dsn, login, password)
    env = dict(
        replica_env(service_dsn, pki, keyring_file, policy_dir, tmp_path),
        ZTATE_MIGRATE_ON_START="false",  # the job migrated; the login may create nothing
    )
    replica = await start_replica(env)
    try:
        await wait_serving(replica, pki)
        thread_id = await create_thread(Cluster(service_dsn, env, [replica]), pki)
        async with client(replica.target, pki.node("input-parser")) as parser:
            committed = await parser.propose(thread_id, 0, {"requested_action": act("least")})
        assert committed.version == 1
    finally:
        assert await stop_replica(replica) == 0
    assert password.encode() not in replica.log

    conn = await asyncpg.connect(service_dsn)
    try:
        owners = await conn.fetch(
            "SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = 'ztate'"
        )
        assert login not in {r["tableowner"] for r in owners}
        assert not await conn.fetchval("SELECT has_schema_privilege('public', 'CREATE')")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("DELETE FROM ztate.threads WHERE thread_id = $1", thread_id)
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("ALTER TABLE ztate.transitions DISABLE TRIGGER ALL")
    finally:
        await conn.close()
    assert [r["version"] for r in await ledger_rows(owner_dsn, thread_id)] == [0, 1]

    # the approval service, with its own login that owns nothing, starts and serves
    generate_signing_key(tmp_path / "signing.pem", tmp_path / "public.json", "approval-k1")
    issued = ca.issue(
        pki.ca_dir,
        Identity(TRUST_DOMAIN, Role.SERVICE, "approval"),
        tmp_path / "approval-certs",
        dns_names=("localhost",),
    )
    approval = await start_approval(
        ApprovalSettings(
            ZTATE_HOME=tmp_path,
            ZTATE_TRUST_DOMAIN=TRUST_DOMAIN,
            listen="127.0.0.1:0",
            tls_cert=issued.cert,
            tls_key=issued.key,
            tls_ca=issued.ca_cert,
            signing_key_file=tmp_path / "signing.pem",
            db_pool_size=2,
            migrate_on_start=False,
        ),
        dsn=as_login(owner_dsn, approver, approver_password),
    )
    try:
        reviewer = pki.identity(Role.REVIEWER, "alice")
        code, stdout, stderr = await run_ztate(
            "approvals",
            "list",
            "--target",
            f"localhost:{approval.port}",
            "--cert",
            str(reviewer.cert),
            "--key",
            str(reviewer.key),
            "--ca",
            str(reviewer.ca),
            env=base,
        )
        assert code == 0, stderr
        assert stdout == ""  # an empty list: nothing on stdout, and stderr says so
        assert stderr.strip() == "no open reviews"
    finally:
        await approval.stop(grace=1.0)
