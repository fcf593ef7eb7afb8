"""``ztate db ...``: database administration that runs with an owner's DSN, once.

``ztate db migrate`` applies both services' numbered migrations (the same files
and advisory locks the services use at start-up), so that a deployment can run
them as a one-off job before the services start. ``ztate db citus`` applies the
optional Citus layout (``services/store/optional/citus.sql``), which is never
part of the numbered set: see docs/scale-out.md.

The DSN is ``DATABASE_URL``; it is never printed, nor its password. Exit codes: 0
done, 2 could not run (no DSN, a malformed one, a migration refused), 4 the
database could not be reached, with one line that says why and no traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ztate.services.runtime.config import ApprovalSettings, Settings

OK, CANNOT_RUN, UNREACHABLE = 0, 2, 4
CONNECT_TIMEOUT_SECONDS = 30.0


def _failures() -> tuple[type[BaseException], ...]:
    """Why ``ztate db`` may be unable to run: reported in one line, exit 2 (4 when the
    database cannot be reached)."""
    import asyncpg

    from ztate.services.store.migrate import MigrationError
    from ztate.services.store.optional import CitusError

    return (
        MigrationError,
        CitusError,
        OSError,  # unreachable: refused, no route, unknown host
        TimeoutError,  # the server did not answer in time
        ValueError,  # a malformed DSN (asyncpg's ClientConfigurationError is one too)
        OverflowError,  # a port beyond 65535: the socket layer's refusal
        asyncpg.InterfaceError,
        asyncpg.PostgresError,
    )


def _code(failure: BaseException) -> int:
    return UNREACHABLE if isinstance(failure, OSError | TimeoutError) else CANNOT_RUN


Subparsers = argparse._SubParsersAction  # the type argparse gives add_subparsers()


def _dsn_and_settings() -> tuple[str, Settings, ApprovalSettings]:
    from ztate.services.runtime.config import ApprovalSettings, Settings
    from ztate.services.store.migrate import MigrationError

    settings, approval = Settings(), ApprovalSettings()
    if settings.database_url is None:
        raise MigrationError("DATABASE_URL is not set (an owner of the ztate schemas)")
    return settings.database_url.get_secret_value(), settings, approval


def _explain(failure: BaseException, dsn: str | None) -> str:
    """``failure`` in one line, with the DSN and its password (if it has one) masked."""
    from ztate.services.store.waiting import masked

    return f"{type(failure).__name__}: {masked(str(failure) or 'no answer in time', dsn)}"


MIGRATION_GROUP = "ztate.migrations"
ServiceMigration = Callable[[str, "ApprovalSettings"], Awaitable[list[str]]]


def _service_migrations() -> dict[str, ServiceMigration]:
    """Each installed service's own migrations, by the name it registers them under in
    the ``ztate.migrations`` entry-point group (the core imports no server)."""
    from importlib.metadata import entry_points

    return {e.name: e.load() for e in sorted(entry_points(group=MIGRATION_GROUP), key=str)}


async def _migrate(
    dsn: str, settings: Settings, approval: ApprovalSettings
) -> dict[str, list[str]]:
    """The migrations applied now, by service."""
    import asyncpg

    from ztate.services.store.migrate import migrate

    conn = await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT_SECONDS)
    try:
        transition = await migrate(conn, settings.db_role, settings.db_reader_role)
    finally:
        await conn.close()
    applied = {"transition service": transition}
    for name, service_migrate in _service_migrations().items():
        applied[f"{name} service"] = await service_migrate(dsn, approval)
    return applied


async def _citus(dsn: str) -> list[str]:
    import asyncpg

    from ztate.services.store.optional import apply_citus_layout

    conn = await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT_SECONDS)
    try:
        return await apply_citus_layout(conn)
    finally:
        await conn.close()


def cmd_db_migrate(_: argparse.Namespace) -> int:
    import asyncio

    from pydantic import ValidationError

    from ztate.services.runtime.config import describe

    dsn = None
    try:
        dsn, settings, approval = _dsn_and_settings()
        applied = asyncio.run(_migrate(dsn, settings, approval))
    except ValidationError as exc:
        print(f"ztate db migrate: invalid configuration: {describe(exc)}", file=sys.stderr)
        return CANNOT_RUN
    except _failures() as exc:
        print(f"ztate db migrate: {_explain(exc, dsn)}", file=sys.stderr)
        return _code(exc)
    for service, names in applied.items():
        print(f"{service}: {', '.join(names) if names else 'up to date'}")
    return OK


def cmd_db_citus(_: argparse.Namespace) -> int:
    import asyncio

    from pydantic import ValidationError

    from ztate.services.runtime.config import describe

    dsn = None
    try:
        dsn, _settings, _approval = _dsn_and_settings()
        done = asyncio.run(_citus(dsn))
    except ValidationError as exc:
        print(f"ztate db citus: invalid configuration: {describe(exc)}", file=sys.stderr)
        return CANNOT_RUN
    except _failures() as exc:
        print(f"ztate db citus: {_explain(exc, dsn)}", file=sys.stderr)
        return _code(exc)
    print("\n".join(done))
    return OK


def register(subparsers: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``db`` to the ``ztate`` command."""
    add_db_commands(subparsers)


def add_db_commands(subparsers: Subparsers[argparse.ArgumentParser]) -> None:
    """Add ``db`` to the ``ztate`` command."""
    db = subparsers.add_parser("db", help="database administration (an owner's DATABASE_URL)")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    db_sub.add_parser(
        "migrate", help="apply both services' migrations, then exit (a deployment's job)"
    ).set_defaults(func=cmd_db_migrate)
    db_sub.add_parser(
        "citus", help="distribute the transition service's tables by thread_id (Citus only)"
    ).set_defaults(func=cmd_db_citus)
