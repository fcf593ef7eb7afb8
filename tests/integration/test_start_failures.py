"""A transition service that cannot start leaves nothing open behind it."""

from __future__ import annotations

import asyncpg
import pytest

from ztate.services.runtime.config import Settings
from ztate.transition_service.app import RunningService, start


async def _connections(dsn: str, role: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = $1 OR "
            "application_name = 'ztate-outcomes'",
            role,
        )
        return count
    finally:
        await conn.close()


async def test_a_port_in_use_refuses_start_and_closes_every_connection(
    settings: Settings, service: RunningService, database_dsn: str
) -> None:
    """The session's service holds the port; a second one on it must fail and
    close the pool, the reader pool and the LISTEN connection it had opened."""
    before = await _connections(database_dsn, settings.db_role)
    taken = settings.model_copy(update={"listen": f"127.0.0.1:{service.port}"})
    with pytest.raises((RuntimeError, OSError)):
        await start(taken, dsn=database_dsn)
    assert await _connections(database_dsn, settings.db_role) == before
