"""How ``ztate serve`` and ``ztate approval-serve`` start, once for both: wait for the
database, serve, and turn a failure to start into one line and an exit code
(docs/cli.md): a database that never came 4, one that refused the connection 2, and 2
for anything else the service cannot start with (a migration, a file, a key, a setting).

A failure after the service started is not one of these: it is no mistake in the
configuration, and saying "cannot start" (exit 2) about a service that served would
send its operator to the wrong place. It is one line too, with its own prefix
(``the transition service stopped: ...``), ``dsn``'s password masked, and exit 1: the
service ran, and stopped on a failure.

Only the standard library at import time: the store's modules load when a service runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from ztate.services.cli.output import FAILED, OK, UNREACHABLE, USAGE, CliError

Started = Callable[[], None]
Serve = Callable[[Started], Coroutine[Any, Any, None]]


def run_service(
    serve: Serve, *, dsn: str | None, wait_seconds: float, prefix: str, stopped: str
) -> int:
    """Wait up to ``wait_seconds`` for the database at ``dsn`` (when there is one), then
    run ``serve(started)`` until it returns; ``serve`` calls ``started()`` once it
    serves. Until then a failure is a ``CliError``: the database not reachable in time
    (exit 4) or a file, key, setting or migration the service cannot use (a
    ``MigrationError``, an ``OSError`` or a ``ValueError``, such as ``KeyFileError``, or
    an ``asyncpg`` error, such as a migration the database refuses; exit 2), each as
    ``{prefix}: `` and its first line, and the database's refusal of the connection
    (exit 2) as the database said it. After ``started()``, such a failure is
    ``{stopped}: `` and its first line (exit 1). ``dsn``'s password is never printed."""
    import asyncpg

    from ztate.services.store.migrate import MigrationError
    from ztate.services.store.waiting import (
        DatabaseNotReady,
        DatabaseRefused,
        first_line,
        wait_for_database,
    )

    serving = False

    def started() -> None:
        nonlocal serving
        serving = True

    try:
        if dsn is not None:
            asyncio.run(wait_for_database(dsn, wait_seconds))
        asyncio.run(serve(started))
    except DatabaseNotReady as exc:
        raise CliError(f"{prefix}: {exc}", UNREACHABLE) from None
    except DatabaseRefused as exc:
        raise CliError(str(exc), USAGE) from None
    # a policy, keyring, key file or revocation list it cannot use is a ValueError; a
    # file it cannot read or an address it cannot listen on (CannotListen) an OSError;
    # a migration the database refuses (a privilege, a lock timeout) or a connection
    # lost after the wait, asyncpg's
    except (
        MigrationError,
        OSError,
        ValueError,
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
    ) as exc:
        if serving:
            raise CliError(f"{stopped}: {first_line(exc, dsn)}", FAILED) from None
        raise CliError(f"{prefix}: {first_line(exc, dsn)}", USAGE) from None
    return OK
