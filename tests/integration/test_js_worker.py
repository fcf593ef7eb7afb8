"""A worker in another language: JavaScript on @grpc/grpc-js, with nothing of ztate
but the .proto files and its own certificate, against the real service."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.harness import INITIAL, Ledger, Pki, client, new_thread_id, run_example_worker

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "js-worker"
NODE, NPM = shutil.which("node"), shutil.which("npm")


@pytest.fixture(scope="module")
def installed() -> Path:
    if NODE is None or NPM is None:
        pytest.fail("Node.js and npm are required by the test suite (every CI machine has them)")
    if not (EXAMPLE / "node_modules" / "@grpc" / "grpc-js").exists():
        subprocess.run(
            [NPM, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=EXAMPLE,
            check=True,
            timeout=300,
        )
    return EXAMPLE


async def test_a_javascript_worker_reads_proposes_and_is_refused(
    installed: Path, target: str, pki: Pki, ledger: Ledger
) -> None:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    creds = pki.node("input-parser")
    assert NODE is not None
    view, committed, refused = await run_example_worker(
        NODE, str(installed / "worker.js"), target, creds, thread_id
    )
    assert view == {"step": "view", "version": 0, "state": {"raw_text": INITIAL["raw_text"]}}
    assert committed["version"] == 1
    assert committed["node_id"] == "spiffe://ztate.test/node/input-parser"
    assert refused["code"] == "PERMISSION_DENIED"
    assert "is_admin" in refused["message"]
    rows = await ledger.rows(thread_id)
    assert rows[1]["version"] == committed["version"]
    # the input parser is not marked read_records: it is told no digest (docs/api.md)
    assert committed["digest"] == ""
    assert await ledger.verify(thread_id) == 2
