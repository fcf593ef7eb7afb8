"""``verify_migrations``, what a service with ZTATE_MIGRATE_ON_START=false runs at
start-up: read-only, and it refuses any schema that is not this version's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import pytest

from tests.harness import fresh_database
from ztate.services.store.migrate import (
    TRANSITION_MIGRATIONS,
    MigrationError,
    bundled_migrations,
    migrate,
    verify_migrations,
)


@asynccontextmanager
async def rolled_back(conn: asyncpg.Connection) -> AsyncIterator[None]:
    transaction = conn.transaction()
    await transaction.start()
    try:
        yield
    finally:
        await transaction.rollback()


async def test_verify_accepts_this_version_and_refuses_any_other(postgres_server_dsn: str) -> None:
    dsn = await fresh_database(postgres_server_dsn)
    conn = await asyncpg.connect(dsn)
    try:
        with pytest.raises(MigrationError, match=r"ztate_schema_migrations is missing\): run"):
            await verify_migrations(conn, TRANSITION_MIGRATIONS)
        assert await conn.fetchval("SELECT to_regclass('public.ztate_schema_migrations')") is None
        await migrate(conn, "ztate_transition", "ztate_reader")
        await verify_migrations(conn, TRANSITION_MIGRATIONS)  # this version: accepted
        last = bundled_migrations()[-1]
        name = f"{last.number:04d}_{last.name}"

        async with rolled_back(conn):  # a newer release migrated first: accepted
            await conn.execute(
                "INSERT INTO public.ztate_schema_migrations (number, name, checksum) "
                "VALUES ($1, 'later', 'x')",
                last.number + 1,
            )
            await verify_migrations(conn, TRANSITION_MIGRATIONS)
        async with rolled_back(conn):  # behind: refused, by name
            await conn.execute(
                "DELETE FROM public.ztate_schema_migrations WHERE number = $1", last.number
            )
            with pytest.raises(MigrationError, match=f"behind this version: {name} is not"):
                await verify_migrations(conn, TRANSITION_MIGRATIONS)
        async with rolled_back(conn):  # changed after it was applied: refused
            await conn.execute(
                "UPDATE public.ztate_schema_migrations SET checksum = 'x' WHERE number = $1",
                last.number,
            )
            with pytest.raises(MigrationError, match=f"migration {name} in the database differs"):
                await verify_migrations(conn, TRANSITION_MIGRATIONS)
        count = await conn.fetchval("SELECT count(*) FROM public.ztate_schema_migrations")
        assert count == len(bundled_migrations())  # verifying wrote nothing
    finally:
        await conn.close()
