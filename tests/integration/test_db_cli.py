"""``ztate db`` with a DSN it cannot use: one clear line on stderr, exit 2, no
traceback, and never the DSN or its password."""

from __future__ import annotations

import os
from pathlib import Path

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
        (f"postgresql://ztate:{PASSWORD}@127.0.0.1:99999/ztate", "port must be 0-65535", 2),
        # an @ in the password, not percent-encoded: asyncpg splits at the first @ and
        # quoted the password's tail as the host's port
        (
            "postgresql://ztate:Tr0ub4dor@3:horse-battery-staple@db.internal:5432/ztate",
            "the text is withheld: the DSN's user part holds an @",
            2,
        ),
    ],
    ids=[
        "no-scheme",
        "mysql",
        "bad-port",
        "unreachable-with-password",
        "port-out-of-range",
        "unescaped-at-in-password",
    ],
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
    assert "horse-battery-staple" not in output
    assert dsn not in output


def test_the_explanation_masks_the_dsn_and_its_password() -> None:
    dsn = f"postgresql://ztate:{PASSWORD}@db.example:5432/ztate"
    assert _explain(ValueError(f"bad {dsn}"), dsn) == "ValueError: bad ***"
    assert _explain(OSError(f"as ztate:{PASSWORD}"), dsn) == "OSError: as ztate:***"
    assert _explain(TimeoutError(), dsn) == "TimeoutError: no answer in time"


@pytest.mark.parametrize(
    ("argv", "says", "exit_code"),
    [
        (("ledger", "export", "--out", "{out}"), "ztate ledger export: cannot connect", 2),
        (("ledger", "prune", "--older-than", "1", "--yes"), "ztate: ledger prune: the database", 1),
    ],
    ids=["export", "prune"],
)
async def test_operator_tools_refuse_a_port_out_of_range_in_one_line(
    argv: tuple[str, ...], says: str, exit_code: int, tmp_path: Path
) -> None:
    """The port is past 65535: the socket layer refuses it with OverflowError, which was
    a traceback (exit 1) from export, prune and db migrate."""
    dsn = f"postgresql://ztate:{PASSWORD}@127.0.0.1:99999/ztate"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    env.update(DATABASE_URL=dsn, ZTATE_HOME=str(tmp_path / "home"))
    out = tmp_path / "bundle"
    code, output = await run_ztate(*(a.format(out=out) for a in argv), env=env)
    assert code == exit_code, output
    [line] = output.splitlines()
    assert line.startswith(says), line
    assert "port must be 0-65535" in line
    assert PASSWORD not in output
    assert not out.exists()
