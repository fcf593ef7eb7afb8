"""services/cli/startup.py: how both services' commands start, once. What fails before
the service serves is a failure to start (one line, exit 2); what fails after is not,
and is never reported as one: it is one line of its own (exit 1), never a traceback.
(The real services' refusals, through the real binary: tests/integration/test_cli.py.)"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from ztate.contract.errors import KeyFileError
from ztate.services.cli.output import FAILED, OK, USAGE, CliError
from ztate.services.cli.startup import run_service

Serve = Callable[[Callable[[], None]], Awaitable[None]]


def refusal(serve: Serve, service: str, *, dsn: str | None = None, wait: float = 0) -> CliError:
    """What ``run_service`` raises for ``serve``, started as ``ztate <service> serve``."""
    with pytest.raises(CliError) as raised:
        run_service(
            serve,
            dsn=dsn,
            wait_seconds=wait,
            prefix=f"cannot start the {service} service",
            stopped=f"the {service} service stopped",
        )
    return raised.value


def test_a_failure_before_the_service_serves_is_a_failure_to_start() -> None:
    async def serve(started: Callable[[], None]) -> None:
        raise KeyFileError("/etc/ztate/tls.key is not a PEM private key\nsecond line")

    refused = refusal(serve, "approval")
    assert (refused.message, refused.code) == (
        "cannot start the approval service: /etc/ztate/tls.key is not a PEM private key",
        USAGE,
    )


@pytest.mark.parametrize(
    ("failure", "line"),
    [
        (
            OSError(5, "Input/output error"),
            "the transition service stopped: [Errno 5] Input/output error",
        ),
        (
            ValueError("a value met while serving\nsecond line"),
            "the transition service stopped: a value met while serving",
        ),
    ],
    ids=["OSError", "ValueError"],
)
def test_a_failure_after_the_service_served_is_one_line_not_a_failure_to_start(
    failure: Exception, line: str
) -> None:
    async def serve(started: Callable[[], None]) -> None:
        started()
        raise failure

    stopped = refusal(serve, "transition")
    assert (stopped.message, stopped.code) == (line, FAILED)


def with_password(dsn: str, password: str) -> str:
    parts = urlsplit(dsn)
    user = parts.username or "postgres"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}"))


def test_a_failure_after_the_service_served_masks_the_database_url(
    postgres_server_dsn: str,
) -> None:
    """The real database is waited for (and answers); what the service then fails on
    names the DSN and its password, and neither is printed."""
    dsn = with_password(postgres_server_dsn, "s3cret-pw")

    async def serve(started: Callable[[], None]) -> None:
        started()
        raise OSError(f"lost {dsn} (password s3cret-pw)\nsecond line")

    stopped = refusal(serve, "approval", dsn=dsn, wait=5)
    assert (stopped.message, stopped.code) == (
        "the approval service stopped: lost *** (password ***)",
        FAILED,
    )


def test_a_service_that_ran_and_stopped_exits_0() -> None:
    ran: list[bool] = []

    async def serve(started: Callable[[], None]) -> None:
        started()
        ran.append(True)

    stopped = "the transition service stopped"
    assert (
        run_service(serve, dsn=None, wait_seconds=0, prefix="cannot start", stopped=stopped) == OK
    )
    assert ran == [True]


@pytest.mark.parametrize(
    "failure",
    [
        asyncpg.InsufficientPrivilegeError("permission denied for schema public\ndetail"),
        asyncpg.InterfaceError("connection is closed"),
    ],
    ids=["refused-migration", "lost-connection"],
)
def test_a_database_error_while_starting_is_a_failure_to_start_not_a_traceback(
    failure: Exception,
) -> None:
    """A migration the database refuses (a privilege, a lock timeout while an index
    builds) or a connection lost between the wait and the start raised an asyncpg error
    that no clause caught: a traceback. It is a failure to start, one line."""

    async def serve(started: Callable[[], None]) -> None:
        raise failure

    refused = refusal(serve, "transition")
    first = str(failure).splitlines()[0]
    assert (refused.message, refused.code) == (
        f"cannot start the transition service: {first}",
        USAGE,
    )
