"""``ztate db`` with a DSN it cannot use: one clear line on stderr, exit 2, no
traceback, and never the DSN or its password."""

from __future__ import annotations

import os

import pytest

from tests.faults import free_port, run_ztate
from ztate.services.cli.db import _explain

PASSWORD = "s3cret-Pa55word"


@pytest.mark.parametrize(
    ("dsn", "says", "exit_code"),
    [
        ("host:notaport", "invalid DSN", 2),
        ("mysql://x", "invalid DSN: scheme is expected to be", 2),
        (f"postgresql://ztate:{PASSWORD}@db.example:notaport/ztate", "notaport", 2),
        (f"postgresql://ztate:{PASSWORD}@127.0.0.1:{{port}}/ztate", "ConnectionRefusedError", 4),
    ],
    ids=["no-scheme", "mysql", "bad-port", "unreachable-with-password"],
)
@pytest.mark.parametrize("command", ["migrate", "citus"])
async def test_a_dsn_that_cannot_be_used_is_one_line_and_exit_2_or_4(
    dsn: str, says: str, exit_code: int, command: str
) -> None:
    """2: the DSN is wrong; 4: the database cannot be reached (docs/cli.md)."""
    dsn = dsn.format(port=free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    code, output = await run_ztate("db", command, env=dict(env, DATABASE_URL=dsn))
    assert code == exit_code, output
    [line] = output.splitlines()
    assert line.startswith(f"ztate db {command}: ")
    assert says in line
    assert "Traceback" not in output
    assert PASSWORD not in output
    assert dsn not in output


def test_the_explanation_masks_the_dsn_and_its_password() -> None:
    dsn = f"postgresql://ztate:{PASSWORD}@db.example:5432/ztate"
    assert _explain(ValueError(f"bad {dsn}"), dsn) == "ValueError: bad ***"
    assert _explain(OSError(f"as ztate:{PASSWORD}"), dsn) == "OSError: as ztate:***"
    assert _explain(TimeoutError(), dsn) == "TimeoutError: no answer in time"
