"""services/cli/startup.py: how both services' commands start, once. What fails before
the service serves is a failure to start (one line, exit 2); what fails after is not,
and is never reported as one. (The real services' refusals, through the real binary:
tests/integration/test_cli.py.)"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ztate.contract.errors import KeyFileError
from ztate.services.cli.output import OK, USAGE, CliError
from ztate.services.cli.startup import run_service


def test_a_failure_before_the_service_serves_is_a_failure_to_start() -> None:
    async def serve(started: Callable[[], None]) -> None:
        raise KeyFileError("/etc/ztate/tls.key is not a PEM private key\nsecond line")

    with pytest.raises(CliError) as refused:
        run_service(serve, dsn=None, wait_seconds=0, prefix="cannot start the approval service")
    assert (refused.value.message, refused.value.code) == (
        "cannot start the approval service: /etc/ztate/tls.key is not a PEM private key",
        USAGE,
    )


@pytest.mark.parametrize(
    "failure",
    [OSError(5, "Input/output error"), ValueError("a value met while serving")],
    ids=["OSError", "ValueError"],
)
def test_a_failure_after_the_service_served_is_not_a_failure_to_start(
    failure: Exception,
) -> None:
    async def serve(started: Callable[[], None]) -> None:
        started()
        raise failure

    with pytest.raises(type(failure)) as raised:
        run_service(serve, dsn=None, wait_seconds=0, prefix="cannot start")
    assert raised.value is failure


def test_a_service_that_ran_and_stopped_exits_0() -> None:
    ran: list[bool] = []

    async def serve(started: Callable[[], None]) -> None:
        started()
        ran.append(True)

    assert run_service(serve, dsn=None, wait_seconds=0, prefix="cannot start") == OK
    assert ran == [True]
