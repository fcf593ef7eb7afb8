"""Waiting for a database that is not up yet, as ``ztate serve`` does at start-up.

Containers start in any order: a service whose Postgres is still starting waits for
it with exponential backoff, says so in one log line per attempt (host and port, never
the DSN or its password), and gives up after a bounded time
(``ZTATE_DATABASE_WAIT_SECONDS``, default 60; ``--wait-for-database``) with one line
that says why. Only a database that cannot be reached yet is waited for: a wrong
password, an unknown role, a missing database or a DSN the driver cannot use fails at
once with ``DatabaseRefused`` (the server's first line, the DSN and its password
masked by ``masked``, the one masking of a DSN in ztate).
"""

from __future__ import annotations

import os

WAIT_ENV = "ZTATE_DATABASE_WAIT_SECONDS"
DEFAULT_WAIT_SECONDS = 60.0
FIRST_DELAY_SECONDS = 0.5
MAX_DELAY_SECONDS = 5.0
CONNECT_TIMEOUT_SECONDS = 5.0


class DatabaseNotReady(Exception):
    """The database could not be reached within the wait."""


class DatabaseRefused(Exception):
    """The database (or the driver, for a DSN it cannot use) refused the connection:
    a configuration error, not waited for. The message holds the server's first line
    and the error's class, never the DSN or its password."""


UNESCAPED_AT = (
    "the text is withheld: the DSN's user part holds an @ that is not percent-encoded "
    "(write it %40), so the driver may have read part of the password as the host"
)


def masked(text: str, dsn: str | None) -> str:
    """``text`` with ``dsn``, and its password if it has one, shown as ``***``. A DSN
    whose user part holds a second ``@`` is split at the first by asyncpg and at the
    last by this masking: the driver's text may then quote a part of the password no
    masking finds, so none of it is shown (``UNESCAPED_AT``)."""
    from urllib.parse import urlsplit

    secrets = [dsn] if dsn else []
    if dsn:
        try:
            parts = urlsplit(dsn)
            password = parts.password
        except ValueError:
            parts, password = None, None
        if parts is not None and "@" in parts.netloc.rpartition("@")[0]:
            return UNESCAPED_AT
        secrets += [password] if password else []
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def first_line(error: BaseException, dsn: str | None) -> str:
    """The first line of ``error``'s text with ``dsn``'s secrets masked: what a start-up
    failure prints (never a traceback, never a password)."""
    lines = masked(str(error), dsn).splitlines()
    return lines[0] if lines else "no message"


def refused(error: BaseException, dsn: str) -> DatabaseRefused:
    """``error``, raised by the driver on connecting to ``dsn``, as ``DatabaseRefused``."""
    first = first_line(error, dsn)
    return DatabaseRefused(f"the database refused the connection: {first} ({type(error).__name__})")


def wait_default() -> float:
    """``ZTATE_DATABASE_WAIT_SECONDS``, or the default; a malformed value is the default."""
    try:
        return max(0.0, float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_SECONDS)))
    except ValueError:
        return DEFAULT_WAIT_SECONDS


def where(dsn: str) -> str:
    """The host and port of a DSN, for people: no user, no password, no options."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(dsn)
        host = parts.hostname or "localhost"
        return f"{host}:{parts.port or 5432}"
    except ValueError:
        return "the configured database"


async def wait_for_database(dsn: str, seconds: float) -> int:
    """Return once a connection to ``dsn`` opens (the number of attempts it took);
    raise ``DatabaseNotReady`` when none did within ``seconds``. A refusal
    (authentication, an unknown role, a missing database, a DSN the driver cannot use)
    raises ``DatabaseRefused`` at once."""
    import asyncio
    import logging

    import asyncpg

    log = logging.getLogger("ztate.database")

    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    delay, attempt = FIRST_DELAY_SECONDS, 0
    while True:
        attempt += 1
        try:
            conn = await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT_SECONDS)
        # not there yet, starting or stopping (a restart, a failover), or full: waited for
        except (
            OSError,
            TimeoutError,
            asyncpg.PostgresConnectionError,
            asyncpg.OperatorInterventionError,
            asyncpg.TooManyConnectionsError,
        ) as exc:
            reason = _reason(exc)
            left = deadline - loop.time()
            if left <= 0:
                raise DatabaseNotReady(
                    f"the database at {where(dsn)} is not reachable ({reason}); "
                    f"gave up after {seconds:g}s ({WAIT_ENV} or --wait-for-database)"
                ) from None
            pause = min(delay, left)
            log.warning(
                "waiting for the database at %s (%s); attempt %d, next in %.1fs, "
                "giving up in %.0fs",
                where(dsn),
                reason,
                attempt,
                pause,
                left,
            )
            await asyncio.sleep(pause)  # backoff before the next attempt, bounded above
            delay = min(delay * 2, MAX_DELAY_SECONDS)
            continue
        except (asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
            raise refused(exc, dsn) from None
        await conn.close()
        if attempt > 1:
            log.warning("the database at %s is up after %d attempts", where(dsn), attempt)
        return attempt


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return type(exc).__name__
