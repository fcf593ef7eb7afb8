"""Which driver failures mean "the database could not be reached", not "the request
was bad": the RPC guard answers them UNAVAILABLE (retry), the stores and background
loops recognise them, and nothing else does.

It lives in the runtime, below the stores, so that the RPC guard needs no store.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

import asyncpg


class ConnectionLost(Exception):
    """asyncpg refused a pooled connection the server had terminated while it sat
    idle, before sending anything on it (see ``connection_lost``)."""


def connection_lost(failure: BaseException) -> bool:
    """Whether ``failure`` is asyncpg's refusal of a connection the server terminated.

    A session the server ends while it is idle in the pool (a restart, a failover,
    ``pg_terminate_backend``) gets an unsolicited FATAL before its socket closes.
    asyncpg's protocol cannot attribute it to an operation and enters its
    error-consuming state (2), and a connection handed out in that window refuses
    the next operation, having sent nothing, with exactly this InternalClientError
    (MagicStack/asyncpg#1069, #784); or ``not connected`` once it is marked bad.
    Every other InternalClientError (ProtocolError, OutdatedSchemaCacheError, an
    unexpected state) stays unexpected: INTERNAL, logged with its traceback.
    """
    if type(failure) is not asyncpg.InternalClientError:
        return False
    message = str(failure)
    return message == "not connected" or (
        message.startswith("cannot switch to state ")
        and message.endswith("; another operation (2) is in progress")
    )


T = TypeVar("T")


async def settled(call: Awaitable[T]) -> T:
    """``await call``, with ``connection_lost`` failures raised as ``ConnectionLost``."""
    try:
        return await call
    except asyncpg.InternalClientError as failure:
        if connection_lost(failure):
            raise ConnectionLost(str(failure)) from failure
        raise


STORAGE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.OperatorInterventionError,  # the server is shutting down or restarting
    ConnectionLost,  # a pooled connection terminated while idle (``settled``)
)
"""Failures that mean the database could not be reached, not that a request was bad."""


def is_outage(failure: BaseException) -> bool:
    """Whether ``failure`` means the database could not be reached: one of
    ``STORAGE_ERRORS``, or asyncpg's refusal of a connection lost while idle."""
    return isinstance(failure, STORAGE_ERRORS) or connection_lost(failure)
