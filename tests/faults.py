"""Machinery of the fault tests: the transition service as its own process, a
load that writes down what was acknowledged, and what must hold afterwards.

The process is ``ztate serve``, configured through the environment exactly as
a deployment would configure it, so that SIGKILL and SIGTERM are real. Its
health is read over the real gRPC health protocol (``grpc.health.v1``), so
tests wait on the status the service reports, never on a fixed delay.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.harness import (
    INITIAL,
    TRUST_DOMAIN,
    Pki,
    act,
    client,
    new_thread_id,
    secure_channel,
)
from ztate.worker_sdk import Transition, ZtateClient, ZtateError

ZTATE = Path(sys.executable).with_name("ztate")
LISTENING = b"transition service listening on port"
START_TIMEOUT_SECONDS = 60.0
THREADS = 4
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServedProcess:
    """``ztate serve`` on a loopback port, started and stopped by the test."""

    def __init__(
        self,
        *,
        home: Path,
        dsn: str,
        pki: Pki,
        policy: Path,
        keyring: Path,
        open_files: int | None = None,
        **settings: str,
    ) -> None:
        self.port = free_port()
        self.open_files = open_files  # RLIMIT_NOFILE, soft and hard, when set
        self.pki = pki
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
        self.env.update(
            DATABASE_URL=dsn,
            ZTATE_HOME=str(home),
            ZTATE_LISTEN=f"127.0.0.1:{self.port}",
            ZTATE_TRUST_DOMAIN=TRUST_DOMAIN,
            ZTATE_TLS_CERT=str(pki.certs / "service-transition.crt"),
            ZTATE_TLS_KEY=str(pki.certs / "service-transition.key"),
            ZTATE_TLS_CA=str(pki.certs / "ca.crt"),
            ZTATE_POLICY_PATH=str(policy),
            ZTATE_HMAC_KEYRING_FILE=str(keyring),
        )
        self.env.update({f"ZTATE_{k.upper()}": v for k, v in settings.items()})
        self.process: asyncio.subprocess.Process | None = None
        self.log: list[bytes] = []
        self._drain: asyncio.Task[None] | None = None
        self.abandoned: list[asyncio.subprocess.Process] = []  # killed by a failed start

    @property
    def target(self) -> str:
        return f"localhost:{self.port}"

    async def start(self, within: float = START_TIMEOUT_SECONDS) -> None:
        """Launch the service and return once it listens (it reports SERVING by then);
        if it does not within ``within`` s, or exits, it is killed before this raises."""
        limit = self.open_files

        def limit_open_files() -> None:  # in the child, before exec
            if limit is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        self.process = await asyncio.create_subprocess_exec(
            str(ZTATE),
            "serve",
            env=self.env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=limit_open_files if limit is not None else None,
        )
        stderr = self.process.stderr
        assert stderr is not None

        async def listening() -> None:
            while LISTENING not in (line := await stderr.readline()):
                assert line, b"".join(self.log).decode(errors="replace")
                self.log.append(line)

        try:
            await asyncio.wait_for(listening(), within)
        except BaseException:  # timed out, exited, cancelled: never leave it running
            await self._abandon()
            raise
        self._drain = asyncio.get_running_loop().create_task(self._keep_reading(stderr))

    async def _abandon(self) -> None:
        """Kill a process that did not start, and wait until it is gone."""
        process, self.process = self.process, None
        if process is not None and process.returncode is None:
            self.abandoned.append(process)
            process.kill()
            await asyncio.wait_for(process.wait(), 10)

    async def _keep_reading(self, stderr: asyncio.StreamReader) -> None:
        """Read the log to its end, so that logging never blocks on a full pipe."""
        while line := await stderr.readline():
            self.log.append(line)

    def logged(self, text: str) -> bool:
        return any(text.encode() in line for line in self.log)

    async def kill(self) -> None:
        """SIGKILL: no handler runs, nothing is flushed or finished."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        assert await asyncio.wait_for(self.process.wait(), 10) == -signal.SIGKILL
        await self._finish()

    async def terminate(self, within: float = 30.0) -> int:
        """SIGTERM, and the exit status once the process is gone."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return await self.exited(within)

    async def exited(self, within: float) -> int:
        """The exit status, once the process has ended by itself (within ``within`` s)."""
        assert self.process is not None
        code = await asyncio.wait_for(self.process.wait(), within)
        await self._finish()
        return code

    async def _finish(self) -> None:
        if self._drain is not None:
            await asyncio.wait_for(self._drain, 10)
            self._drain = None
        self.process = None

    async def ensure_stopped(self) -> None:
        if self.process is not None and self.process.returncode is None:
            await self.kill()
        elif self.process is not None:  # it ended by itself: finish reading its log
            await self._finish()

    @asynccontextmanager
    async def health(self) -> AsyncIterator[health_pb2_grpc.HealthStub]:
        async with secure_channel(self.target, self.pki.operator()) as channel:
            yield health_pb2_grpc.HealthStub(channel)


async def wait_for_status(
    health: health_pb2_grpc.HealthStub, status: int, *, service: str = "", within: float = 20.0
) -> None:
    """Follow the health Watch stream until ``service`` reports ``status``."""

    async def watch() -> None:
        async for update in health.Watch(health_pb2.HealthCheckRequest(service=service)):
            if update.status == status:
                return
        raise AssertionError("the health stream ended before the status was reported")

    await asyncio.wait_for(watch(), within)


# --- the load: proposers that write down what was acknowledged ----------------------------


@dataclass
class Request:
    """One proposal as sent, and what came back for it (if anything did)."""

    thread_id: str
    expected_version: int
    patch: dict[str, Any]
    key: str
    acked: Transition | None = None
    failure: str | None = None


@dataclass
class Load:
    """Proposers on several threads, one request at a time per thread."""

    target: str
    pki: Pki
    threads: list[str]
    retries: int
    requests: list[Request] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Condition = field(default_factory=asyncio.Condition)

    def acked(self) -> list[Request]:
        return [r for r in self.requests if r.acked is not None]

    def unacked(self) -> list[Request]:
        return [r for r in self.requests if r.acked is None]

    async def until(self, condition: Callable[[], bool], within: float = 30.0) -> None:
        """Wait until ``condition`` holds, re-checked at each proposer's progress."""

        async def holds() -> None:
            async with self.progress:
                await self.progress.wait_for(condition)

        await asyncio.wait_for(holds(), within)

    async def until_acked(self, count: int) -> None:
        """Wait until ``count`` proposals have been acknowledged in all."""
        await self.until(lambda: len(self.acked()) >= count)

    def acked_since(self, mark: int) -> set[str]:
        """The threads with a proposal sent after the ``mark``-th and acknowledged."""
        return {r.thread_id for r in self.requests[mark:] if r.acked is not None}

    def failed(self) -> set[str]:
        """The threads on which a request has failed (and was re-sent, if retrying)."""
        return {r.thread_id for r in self.requests if r.failure is not None}

    async def proposer(self, thread_id: str, *, keep_retrying: bool) -> None:
        """Propose on ``thread_id`` until told to stop. A failed request is re-sent with
        its own idempotency key while ``keep_retrying``, as a worker that must get its
        change in would; otherwise the proposer gives up at the first failure."""
        async with ZtateClient.from_files(
            self.target,
            cert=self.pki.node("input-parser").cert,
            key=self.pki.node("input-parser").key,
            ca=self.pki.node("input-parser").ca,
            timeout=5.0,
            retries=self.retries,
            backoff=0.05,
        ) as worker:
            version, n = 0, 0
            while not self.stop.is_set():
                request = Request(
                    thread_id,
                    version,
                    {"requested_action": act(f"o-{n}")},
                    uuid.uuid4().hex,
                )
                self.requests.append(request)
                while request.acked is None and not self.stop.is_set():
                    try:
                        request.acked = await worker.propose(
                            thread_id, version, request.patch, idempotency_key=request.key
                        )
                    except ZtateError as failure:
                        request.failure = failure.reason
                        async with self.progress:
                            self.progress.notify_all()
                        if not keep_retrying:
                            return
                if request.acked is None:
                    return
                async with self.progress:
                    self.progress.notify_all()
                version, n = request.acked.version, n + 1

    def run(self, *, keep_retrying: bool) -> list[asyncio.Task[None]]:
        return [
            asyncio.create_task(self.proposer(t, keep_retrying=keep_retrying)) for t in self.threads
        ]


async def create_threads(target: str, pki: Pki, count: int) -> list[str]:
    threads = [new_thread_id() for _ in range(count)]
    async with client(target, pki.operator()) as operator:
        for thread_id in threads:
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    return threads


# --- what must hold after any fault ---------------------------------------------------------


async def ledger_rows(dsn: str, thread_id: str) -> tuple[asyncpg.Record, list[asyncpg.Record]]:
    conn = await asyncpg.connect(dsn)
    try:
        head = await conn.fetchrow(
            "SELECT version, head_digest FROM ztate.threads WHERE thread_id = $1", thread_id
        )
        rows = await conn.fetch(
            "SELECT version, digest, idempotency_key, node_id FROM ztate.transitions "
            "WHERE thread_id = $1 ORDER BY version",
            thread_id,
        )
    finally:
        await conn.close()
    return head, rows


async def assert_ledger_whole(dsn: str, load: Load) -> dict[str, asyncpg.Record]:
    """No torn transition, no fork, nothing acknowledged missing; returns the rows by key."""
    by_key: dict[str, asyncpg.Record] = {}
    for thread_id in load.threads:
        head, rows = await ledger_rows(dsn, thread_id)
        assert [r["version"] for r in rows] == list(range(len(rows)))  # no gap, no fork
        # the head is exactly the last record: never one without the other
        assert (head["version"], head["head_digest"]) == (rows[-1]["version"], rows[-1]["digest"])
        keys = [r["idempotency_key"] for r in rows[1:]]
        assert len(keys) == len(set(keys))  # no request committed twice
        by_key.update((r["idempotency_key"], r) for r in rows[1:])
    for request in load.acked():
        assert request.acked is not None
        row = by_key[request.key]  # every acknowledged commit is in the ledger ...
        # (the node was told the version, not the digest: docs/api.md)
        assert (row["version"], row["node_id"]) == (request.acked.version, request.acked.node_id)
    return by_key


async def run_ztate(*args: str, env: dict[str, str], within: float = 60.0) -> tuple[int, str]:
    """Run one ``ztate`` command; its exit status and its combined output."""
    process = await asyncio.create_subprocess_exec(
        str(ZTATE),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), within)
    assert process.returncode is not None
    return process.returncode, output.decode(errors="replace")
