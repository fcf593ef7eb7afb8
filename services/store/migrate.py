"""Numbered SQL migrations, applied at start-up (or by ``ztate db migrate``).

Each service owns a set of files ``NNNN_name.sql`` in a package folder. Each file
runs once, in order, inside one transaction, under an advisory lock so replicas
starting together apply it once, and is recorded with its checksum in that
service's own table. Placeholders such as ``:service_role`` are replaced by the
quoted name of a database role, created (NOLOGIN) when missing. A file changed
after it was applied stops start-up: the history of the schema is as
append-only as the ledger.

With ``ZTATE_MIGRATE_ON_START=false`` a service only verifies, with one SELECT on
its migrations table, that every migration it ships was applied unchanged, and
refuses to start otherwise: its login then needs no CREATE on schema public.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

import asyncpg

MIGRATION_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql\Z")
IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}\Z")


class MigrationError(RuntimeError):
    """The database schema cannot be brought to this version."""


@dataclass(frozen=True)
class Migration:
    number: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


@dataclass(frozen=True)
class MigrationSet:
    """One service's migrations: where the files are and where they are recorded."""

    package: str
    table: str  # unqualified, in schema public
    lock: int  # the advisory lock key

    def bundled(self) -> list[Migration]:
        """The migrations shipped with this version, in order."""
        found = []
        for entry in resources.files(self.package).joinpath("migrations").iterdir():
            match = MIGRATION_FILE.match(entry.name)
            if match:
                found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
        found.sort(key=lambda m: m.number)
        numbers = [m.number for m in found]
        if numbers != list(range(1, len(found) + 1)):
            raise MigrationError(f"migrations must be numbered 1..n without gaps, found {numbers}")
        return found


TRANSITION_MIGRATIONS = MigrationSet(
    "ztate.services.store", "ztate_schema_migrations", 0x7A7461746531
)


def bundled_migrations() -> list[Migration]:
    """The transition service's migrations."""
    return TRANSITION_MIGRATIONS.bundled()


async def _create_role_if_missing(conn: asyncpg.Connection, role: str) -> None:
    """Roles belong to the cluster, not the database: the advisory lock serialises the
    migrations of one database only, so another database's migration (a second
    deployment on the cluster) may create the same role between the check and the
    CREATE. Theirs is then the role; the CREATE is undone by its savepoint alone."""
    if await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
        return
    try:
        async with conn.transaction():
            await conn.execute(f"CREATE ROLE {_quote_ident(role)} NOLOGIN")
    except (asyncpg.DuplicateObjectError, asyncpg.UniqueViolationError):
        # created and committed meanwhile (42710), or committed while ours waited on
        # the catalog's unique index (23505)
        if not await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
            raise


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def apply_migrations(
    conn: asyncpg.Connection, migrations: MigrationSet, roles: dict[str, str]
) -> list[str]:
    """Apply pending migrations of ``migrations``; ``roles`` maps placeholders such as
    ``:service_role`` to role names. Returns the names of those applied now."""
    if not IDENTIFIER.match(migrations.table):
        raise MigrationError(f"bad migration table name {migrations.table!r}")
    applied_now: list[str] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", migrations.lock)
        await conn.execute(
            f"""CREATE TABLE IF NOT EXISTS public.{migrations.table} (
                   number integer PRIMARY KEY,
                   name text NOT NULL,
                   checksum text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"""
        )
        for role in roles.values():
            await _create_role_if_missing(conn, role)
        done = {
            row["number"]: row["checksum"]
            for row in await conn.fetch(
                f"SELECT number, checksum FROM public.{migrations.table}"  # noqa: S608
            )
        }
        for migration in migrations.bundled():
            if migration.number in done:
                if done[migration.number] != migration.checksum:
                    raise MigrationError(
                        f"migration {migration.number:04d}_{migration.name} was changed after it "
                        "was applied; add a new migration instead"
                    )
                continue
            sql = migration.sql
            for placeholder, role in roles.items():
                sql = sql.replace(placeholder, _quote_ident(role))
            await conn.execute(sql)
            await conn.execute(
                f"INSERT INTO public.{migrations.table} (number, name, checksum) "  # noqa: S608
                "VALUES ($1, $2, $3)",
                migration.number,
                migration.name,
                migration.checksum,
            )
            applied_now.append(f"{migration.number:04d}_{migration.name}")
    return applied_now


async def verify_migrations(conn: asyncpg.Connection, migrations: MigrationSet) -> None:
    """Raise ``MigrationError`` unless every migration this version ships is applied,
    unchanged. Read-only: one SELECT on the migrations table. Migrations beyond
    this version's (a newer release migrated first, in a rolling upgrade) are
    accepted, as migrations only ever add to the schema."""
    if not IDENTIFIER.match(migrations.table):
        raise MigrationError(f"bad migration table name {migrations.table!r}")
    table = f"public.{migrations.table}"
    if await conn.fetchval("SELECT to_regclass($1)", table) is None:
        raise MigrationError(
            f"the database has no schema yet ({table} is missing): run `ztate db migrate` "
            "as the owner first, or set MIGRATE_ON_START=true"
        )
    done = {
        row["number"]: row["checksum"]
        for row in await conn.fetch(f"SELECT number, checksum FROM {table}")  # noqa: S608
    }
    for migration in migrations.bundled():
        name = f"{migration.number:04d}_{migration.name}"
        if migration.number not in done:
            raise MigrationError(
                f"the database schema is behind this version: {name} is not applied; "
                "run `ztate db migrate` as the owner first"
            )
        if done[migration.number] != migration.checksum:
            raise MigrationError(
                f"migration {name} in the database differs from this version's; "
                "add a new migration instead"
            )


PRUNER_ROLE = "ztate_pruner"


async def migrate(
    conn: asyncpg.Connection,
    service_role: str,
    reader_role: str = "ztate_reader",
    pruner_role: str = PRUNER_ROLE,
) -> list[str]:
    """Apply the transition service's pending migrations."""
    return await apply_migrations(
        conn,
        TRANSITION_MIGRATIONS,
        {
            ":service_role": service_role,
            ":reader_role": reader_role,
            ":pruner_role": pruner_role,
        },
    )
