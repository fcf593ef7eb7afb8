"""The testing kit (ztate.testing): its documented example runs as a worker author runs
it, and the environment starts what it says, from any policy it is given."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from ztate.testing import ZtateEnvironment
from ztate.worker_sdk import PermissionDenied

REPO = Path(__file__).resolve().parents[2]

# a one-node policy given as a mapping, as a test would write it inline
NOTES = {
    "format": 1,
    "name": "notes",
    "keys": {
        "note": {"layer": "working", "type": "string", "max_length": 64},
        "owner": {"layer": "core", "type": "string", "max_length": 64},
    },
    "nodes": {"scribe": {"layer": "working", "read": ["note"], "write": ["note"]}},
}


def documented_example() -> str:
    text = (REPO / "docs" / "testing.md").read_text()
    section = text.split("## A complete example", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found is not None, "docs/testing.md has no example"
    return found.group(1)


async def test_the_documented_example_passes_under_pytest(
    tmp_path: Path, postgres_server_dsn: str
) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["ztate.testing.pytest_plugin"]\n')
    (tmp_path / "test_parser.py").write_text(documented_example())
    env = {**os.environ, "ZTATE_TEST_DATABASE_URL": postgres_server_dsn}
    run = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout, run.stdout


async def test_an_inline_policy_and_clients_per_identity(postgres_server_dsn: str) -> None:
    async with ZtateEnvironment.start(NOTES, postgres_dsn=postgres_server_dsn) as env:
        dsn = env.database_dsn
        genesis = await env.create_thread("n-1", {"owner": "ada"})
        assert genesis.version == 0
        scribe = env.client("scribe")
        assert (await scribe.get_view("n-1")).state == {}  # owner is not in its projection
        await scribe.propose("n-1", 0, {"note": "hello"})

        before = await env.ledger.snapshot("n-1")
        stranger = env.client("planner")  # a certificate of the CA, no node of this policy
        with pytest.raises(PermissionDenied) as refused:
            await stranger.propose("n-1", 1, {"note": "mine"})
        assert refused.value.reason == "NODE_NOT_REGISTERED"
        assert await env.ledger.snapshot("n-1") == before
        assert await env.ledger.verify("n-1") == 2

        blocking = env.sync_client("scribe")
        view = await asyncio.to_thread(blocking.get_view, "n-1")
        assert view.state == {"note": "hello"}
    # the environment's database is gone once it exits
    with pytest.raises(asyncpg.InvalidCatalogNameError):
        await asyncpg.connect(dsn)
