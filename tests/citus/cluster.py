"""A real Citus cluster on this machine: a coordinator and workers on 127.0.0.1.

Each node is a PostgreSQL 15 server with ``shared_preload_libraries = 'citus'``,
started with ``pg_ctl`` as the ``postgres`` system user when run as root (Postgres
refuses root), its data under one ``mkdtemp`` folder that user owns, on ports picked
free. Local connections are trusted: the cluster lives only as long as the test
session. ``database`` makes a database on every node with the extension, names the
coordinator, adds the workers, and returns the coordinator's DSN; the Citus layout
itself is applied by the commands an operator runs (``ztate db migrate``, ``ztate db
citus``: ``tests/citus/conftest.py``).

Citus is built into Debian's PostgreSQL 15 by ``../shared/citus/install.sh``;
``ZTATE_CITUS_PG_BIN`` names another server's binaries.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

PG_BIN = Path(os.environ.get("ZTATE_CITUS_PG_BIN", "/usr/lib/postgresql/15/bin"))
OS_USER = "postgres"
SUPERUSER = "postgres"
HOST = "127.0.0.1"
START_TIMEOUT_SECONDS = 60


class CitusUnavailable(RuntimeError):
    """No PostgreSQL with the citus extension on this machine."""


def citus_installed() -> str | None:
    """Why a cluster cannot start here, or None when it can."""
    if not (PG_BIN / "pg_ctl").exists():
        return f"no PostgreSQL server binaries in {PG_BIN}"
    libdir = subprocess.run(
        [str(PG_BIN / "pg_config"), "--pkglibdir"], capture_output=True, text=True, check=False
    ).stdout.strip()
    if not (Path(libdir) / "citus.so").exists():
        return f"citus.so is not in {libdir or PG_BIN}: run ../shared/citus/install.sh"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _as_postgres(argv: list[str]) -> list[str]:
    """``argv`` as the postgres system user when we are root (Postgres refuses root)."""
    return ["runuser", "-u", OS_USER, "--", *argv] if os.geteuid() == 0 else argv


def _run(argv: list[str]) -> None:
    done = subprocess.run(_as_postgres(argv), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise CitusUnavailable(f"{' '.join(argv)} failed: {done.stderr or done.stdout}")


@dataclass(frozen=True)
class Node:
    """One PostgreSQL server of the cluster."""

    name: str
    port: int
    data: Path

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@{HOST}:{self.port}/{database}"

    @property
    def pid(self) -> int:
        """The postmaster's process id (its first line of postmaster.pid)."""
        return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])

    @property
    def log(self) -> Path:
        return self.data.parent / f"{self.name}.log"


@dataclass
class CitusCluster:
    """A coordinator and ``workers`` workers; ``start`` and ``stop`` them."""

    workers: int = 2
    durable: bool = False  # fsync and synchronous commit, as a production node runs
    shard_count: int = 8
    root: Path = field(init=False)
    coordinator: Node = field(init=False)
    worker_nodes: list[Node] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="ztate-citus-"))
        if os.geteuid() == 0:
            account = pwd.getpwnam(OS_USER)
            os.chown(self.root, account.pw_uid, account.pw_gid)
        self.coordinator = Node("coordinator", free_port(), self.root / "coordinator")
        self.worker_nodes = [
            Node(f"worker-{n}", free_port(), self.root / f"worker-{n}")
            for n in range(1, self.workers + 1)
        ]

    @property
    def nodes(self) -> list[Node]:
        return [self.coordinator, *self.worker_nodes]

    def _settings(self, node: Node) -> str:
        durable = "on" if self.durable else "off"
        return "\n".join(
            [
                f"listen_addresses = '{HOST}'",
                f"port = {node.port}",
                f"unix_socket_directories = '{self.root}'",
                "shared_preload_libraries = 'citus'",
                "max_connections = 300",
                "shared_buffers = 64MB",
                f"fsync = {durable}",
                f"synchronous_commit = {durable}",
                f"full_page_writes = {durable}",
                f"citus.shard_count = {self.shard_count}",
                "",
            ]
        )

    def start(self) -> None:
        """initdb and start every node; ``pg_ctl -w`` returns once each accepts
        connections."""
        try:
            for node in self.nodes:
                _run(
                    [
                        str(PG_BIN / "initdb"),
                        "-D",
                        str(node.data),
                        "-U",
                        SUPERUSER,
                        "--auth=trust",
                        "--no-sync",
                    ]
                )
                conf = node.data / "postgresql.conf"
                with conf.open("a", encoding="utf-8") as out:
                    out.write(self._settings(node))
                _run(
                    [
                        str(PG_BIN / "pg_ctl"),
                        "-D",
                        str(node.data),
                        "-l",
                        str(node.log),
                        "-w",
                        "-t",
                        str(START_TIMEOUT_SECONDS),
                        "start",
                    ]
                )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every node that runs and remove the data folder."""
        for node in self.nodes:
            if (node.data / "postmaster.pid").exists():
                subprocess.run(
                    _as_postgres(
                        [str(PG_BIN / "pg_ctl"), "-D", str(node.data), "-m", "immediate", "stop"]
                    ),
                    capture_output=True,
                    check=False,
                )
        shutil.rmtree(self.root, ignore_errors=True)

    async def database(
        self, prefix: str = "ztate_citus", workers: Sequence[Node] | None = None
    ) -> str:
        """A new database with the citus extension on every node, the coordinator
        named and ``workers`` (all by default) added; returns the coordinator's
        superuser DSN."""
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        for node in self.nodes:
            admin = await asyncpg.connect(node.dsn())
            try:
                await admin.execute(f'CREATE DATABASE "{name}"')
            finally:
                await admin.close()
            conn = await asyncpg.connect(node.dsn(name))
            try:
                await conn.execute("CREATE EXTENSION citus")
            finally:
                await conn.close()
        conn = await asyncpg.connect(self.coordinator.dsn(name))
        try:
            await conn.execute(
                "SELECT citus_set_coordinator_host($1, $2)", HOST, self.coordinator.port
            )
            for worker in self.worker_nodes if workers is None else workers:
                await conn.execute("SELECT citus_add_node($1, $2)", HOST, worker.port)
        finally:
            await conn.close()
        return self.coordinator.dsn(name)


ZTATE = Path(sys.executable).with_name("ztate")


async def ztate_database(
    cluster: CitusCluster, workers: Sequence[Node] | None = None, *, distribute: bool = True
) -> str:
    """A new database of ``cluster`` (on ``workers``, all by default) laid out as an
    operator does it (docs/scale-out.md, "Applying it"): ``ztate db migrate``, then
    ``ztate db citus`` unless ``distribute`` is false (the tables then stay on the
    coordinator, as on plain Postgres). Returns the coordinator's superuser DSN."""
    dsn = await cluster.database(workers=workers)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    commands = [("db", "migrate"), ("db", "citus")] if distribute else [("db", "migrate")]
    for command in commands:
        process = await asyncio.create_subprocess_exec(
            str(ZTATE),
            *command,
            env=dict(env, DATABASE_URL=dsn),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await process.communicate()
        if process.returncode != 0:
            raise CitusUnavailable(
                f"ztate {' '.join(command)} exited {process.returncode}: "
                f"{(stdout + stderr).decode(errors='replace')}"
            )
    return dsn


# The storage parameters migrations set on distributed tables (0021, 0022): each shard,
# where the rows are, must carry its table's.
STORAGE_PARAMETERS = {
    "ztate.transitions": "toast_tuple_target=8160",
    "ztate.threads": "fillfactor=50",
}


async def shard_storage_parameters(conn: asyncpg.Connection, table: str) -> set[str]:
    """The storage parameters of every shard of ``table``, as one text per distinct value."""
    rows = await conn.fetch(
        "SELECT result FROM run_command_on_shards($1, "
        "$$SELECT array_to_string(reloptions, ',') FROM pg_class "
        "WHERE oid = '%s'::regclass$$)",
        table,
    )
    assert rows, f"{table} has no shards"
    return {r["result"] for r in rows}


async def shard_hex_checks(conn: asyncpg.Connection, table: str) -> set[str]:
    """The definitions of the hex digest CHECKs of every shard of ``table``, as one text
    per distinct set (a shard's constraints carry the shard's number in their names)."""
    rows = await conn.fetch(
        "SELECT result FROM run_command_on_shards($1, "
        "$$SELECT string_agg(pg_get_constraintdef(oid), ' | ' ORDER BY conname) "
        "FROM pg_constraint WHERE conrelid = '%s'::regclass AND contype = 'c' "
        "AND pg_get_constraintdef(oid) LIKE '%%0-9a-f%%'$$)",
        table,
    )
    assert rows, f"{table} has no shards"
    return {r["result"] for r in rows}


# The language of ztate.patch_keys on each worker (migration 0023 makes it PL/pgSQL).
PATCH_KEYS_LANGUAGE_ON_WORKERS = (
    "SELECT success, result FROM run_command_on_workers($$"
    "SELECT l.lanname FROM pg_catalog.pg_proc p "
    "JOIN pg_catalog.pg_language l ON l.oid = p.prolang "
    "WHERE p.oid = 'ztate.patch_keys(bytea)'::regprocedure$$) ORDER BY nodeport"
)
