"""Which database failures are an outage (UNAVAILABLE, retried) and which are bugs
(INTERNAL, logged with a traceback): ``STORAGE_ERRORS`` and ``settled``.

The one asyncpg InternalClientError that is an outage is reproduced for real: a
pooled connection whose session the server terminated while it sat idle, handed
out before its socket closed. Every other InternalClientError stays what it is.
"""

from __future__ import annotations

import time

import asyncpg
import pytest

from ztate.services.runtime.outage import (
    STORAGE_ERRORS,
    ConnectionLost,
    connection_lost,
    settled,
)


async def test_an_idle_connection_the_server_terminated_is_a_storage_failure(
    postgres_server_dsn: str,
) -> None:
    pool = await asyncpg.create_pool(postgres_server_dsn, min_size=1, max_size=1)
    admin = await asyncpg.connect(postgres_server_dsn)
    seen: set[type[BaseException]] = set()
    causes: list[BaseException | None] = []
    try:
        deadline = time.monotonic() + 30
        while ConnectionLost not in seen:
            assert time.monotonic() < deadline, f"the race never showed: {seen}"
            async with pool.acquire() as conn:
                pid = await conn.fetchval("SELECT pg_backend_pid()")
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
            # wait until the server has ended the session (its FATAL is on the wire)
            while await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid):
                assert time.monotonic() < deadline, "the backend did not end"
            try:
                await settled(pool.fetchval("SELECT 1"))
            except STORAGE_ERRORS as failure:  # either refusal is an outage, never a bug
                seen.add(type(failure))
                causes.append(failure.__cause__)
            else:
                seen.add(type(None))  # the pool noticed the close first and reconnected
    finally:
        await admin.close()
        await pool.close()
    assert seen <= {ConnectionLost, asyncpg.ConnectionDoesNotExistError, type(None)}
    # ConnectionLost stands for asyncpg's own refusal, which it keeps as its cause
    lost = [c for c in causes if isinstance(c, asyncpg.InternalClientError)]
    assert lost
    assert all(connection_lost(c) for c in lost)


@pytest.mark.parametrize(
    "failure",
    [
        asyncpg.exceptions.ProtocolError("unexpected message while reading the reply"),
        asyncpg.exceptions.OutdatedSchemaCacheError("cache lookup failed for type 12345"),
        asyncpg.InternalClientError(
            "cannot switch to state 12; another operation (11) is in progress"
        ),
        asyncpg.InternalClientError("attempting to deactivate an acquired connection"),
        asyncpg.InternalClientError("unknown error in protocol implementation"),
    ],
    ids=lambda f: type(f).__name__,
)
async def test_other_internal_client_errors_stay_unexpected(failure: Exception) -> None:
    """A protocol error may come after COMMIT was sent, a stale schema cache or a pool
    misuse is a bug: none of them is an outage to retry silently."""
    assert not connection_lost(failure)
    assert not isinstance(failure, STORAGE_ERRORS)

    async def raises() -> None:
        raise failure

    with pytest.raises(type(failure)) as raised:
        await settled(raises())
    assert raised.value is failure  # passed through untouched: INTERNAL, with a traceback
