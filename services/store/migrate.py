"""Numbered SQL migrations, applied at start-up.

Each file ``NNNN_name.sql`` runs once, in order, inside one transaction, under an
advisory lock so replicas starting together apply it once. ``:service_role`` in a
file is replaced by the quoted name of the service's database role, which is
created (NOLOGIN) when missing. A file changed after it was applied stops
start-up: history of the schema is as append-only as the ledger. ``:reader_role``
likewise names the read-only role of ledger queries.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

import asyncpg

MIGRATION_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
ADVISORY_LOCK = 0x7A7461746531  # "ztate1"


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


def bundled_migrations() -> list[Migration]:
    """The migrations shipped with this version, in order."""
    found = []
    for entry in resources.files("services.store").joinpath("migrations").iterdir():
        match = MIGRATION_FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.number)
    numbers = [m.number for m in found]
    if numbers != list(range(1, len(found) + 1)):
        raise MigrationError(f"migrations must be numbered 1..n without gaps, found {numbers}")
    return found


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def migrate(
    conn: asyncpg.Connection, service_role: str, reader_role: str = "ztate_reader"
) -> list[str]:
    """Apply pending migrations; return the names of those applied now."""
    roles = {":service_role": service_role, ":reader_role": reader_role}
    applied_now: list[str] = []
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", ADVISORY_LOCK)
        await conn.execute(
            """CREATE TABLE IF NOT EXISTS public.ztate_schema_migrations (
                   number integer PRIMARY KEY,
                   name text NOT NULL,
                   checksum text NOT NULL,
                   applied_at timestamptz NOT NULL DEFAULT now())"""
        )
        for role in roles.values():
            if not await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
                await conn.execute(f"CREATE ROLE {_quote_ident(role)} NOLOGIN")
        done = {
            row["number"]: row["checksum"]
            for row in await conn.fetch(
                "SELECT number, checksum FROM public.ztate_schema_migrations"
            )
        }
        for migration in bundled_migrations():
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
                "INSERT INTO public.ztate_schema_migrations (number, name, checksum) "
                "VALUES ($1, $2, $3)",
                migration.number,
                migration.name,
                migration.checksum,
            )
            applied_now.append(f"{migration.number:04d}_{migration.name}")
    return applied_now
