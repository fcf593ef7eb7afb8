"""``ztate verify --json`` output, byte for byte, on a ledger with findings.

Scripts parse these lines: how the command writes them (text or bytes, once or
twice encoded) must not change a byte of them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.integration.test_verify_workers import REPO, ZTATE, a_ledger, cli_env

EXPECTED = (  # as `ztate verify --json` wrote them when its lines were text, encoded twice
    b'{"type":"finding","thread_id":"out-a","version":1,"check":"state","expected":"a state '
    b'hashing to c79a80fd6d9639fac789da8b73aa327fb96d0c0c02ed4bc6d4a92d113817f55d","found":'
    b'"a state body hashing to 29e03b91bdaff88500e738d909527696ea21ba94b616d1d3207fc17a67bc0e6b"}\n'
    b'{"type":"finding","thread_id":"out-b","version":2,"check":"column.node_id","expected":'
    b'"spiffe://ztate.test/node/planner (the record\'s)","found":'
    b'"spiffe://ztate.test/node/\\\\xfcnknown"}\n'
    b'{"type":"summary","threads":2,"records":6,"failures":2,"verified":false}\n'
)


def tamper(thread_id: str, rows: list[tuple[Any, ...]]) -> None:
    """Version 1 of out-a stored with a state that is not its record's (non-ASCII, a
    line separator), version 2 of out-b with a node id its record does not hold."""
    if thread_id == "out-a":
        rows[1] = (*rows[1][:8], '{"\u00e9":"\u2028"}'.encode(), *rows[1][9:])
    else:
        rows[2] = (*rows[2][:4], "spiffe://ztate.test/node/\u00fcnknown", *rows[2][5:])


async def test_json_findings_and_summary_are_these_bytes(
    postgres_server_dsn: str, tmp_path: Path
) -> None:
    dsn = await a_ledger(postgres_server_dsn, ["out-a", "out-b"], tamper)
    process = await asyncio.create_subprocess_exec(
        str(ZTATE),
        *("verify", "--json"),
        env=cli_env(dsn, tmp_path),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)

    assert process.returncode == 1, err.decode()
    assert out == EXPECTED
