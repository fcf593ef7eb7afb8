"""The four-node pipeline as separate processes: ``make demo``'s orchestrator, run for
real (``ztate run`` with its approval service and embedded Postgres, four node
processes with their own certificates, the reviewer CLI, ``ztate verify``), then
its ledger inspected directly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.harness import USER
from ztate.contract.keyring import load_public_keys
from ztate.contract.receipts import SignedReceipt, verify_receipt
from ztate.services.store.embedded import start_embedded_postgres

REPO = Path(__file__).resolve().parents[2]
ATTACKER = "6f1c2b3a-9d8e-4f7a-8b6c-5d4e3f2a1b0c"
DEMO_TIMEOUT_SECONDS = 240


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    root = tmp_path_factory.mktemp("demo")
    home, report = root / "home", root / "report.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo" / "run.py"), "--home", str(home),
         "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_SECONDS,
        env={k: v for k, v in os.environ.items() if k != "DATABASE_URL"},
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return home, json.loads(report.read_text()), result.stdout


@pytest.fixture(scope="module")
def ledger_dsn(demo: tuple[Path, dict[str, Any], str]) -> Iterator[str]:
    """The demo's own database, restarted after the demo stopped it."""
    home, _, _ = demo
    dsn, server = start_embedded_postgres(home / "pg")
    yield dsn
    server.cleanup()


async def fetch(dsn: str, query: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(query, *args)
    finally:
        await conn.close()


def test_every_process_the_demo_started_is_gone(demo: tuple[Path, dict[str, Any], str]) -> None:
    home, _, _ = demo
    leftovers = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if str(home) in cmdline or f"ZTATE_HOME={home}".encode() in environ:
            leftovers.append(cmdline)
    assert leftovers == []


async def test_a_normal_request_flows_through_the_four_nodes(
    demo: tuple[Path, dict[str, Any], str], ledger_dsn: str
) -> None:
    _, report, _ = demo
    thread = report["normal"]["thread"]
    rows = await fetch(
        ledger_dsn,
        "SELECT version, node_id, receipt FROM ztate.transitions WHERE thread_id = $1 "
        "ORDER BY version",
        thread,
    )
    assert [(r["version"], r["node_id"].rsplit("/", 1)[-1]) for r in rows] == [
        (0, "admin"),
        (1, "input-parser"),
        (2, "planner"),
        (3, "approval-gate"),
        (4, "db-writer"),
    ]
    assert all(r["receipt"] is None for r in rows)  # nothing risky: no approval needed


async def test_the_injected_parser_is_refused_and_commits_nothing(
    demo: tuple[Path, dict[str, Any], str], ledger_dsn: str
) -> None:
    home, report, stdout = demo
    injection = report["injection"]
    thread = injection["thread"]
    assert injection["refused"]["reason"] == "KEY_NOT_WRITABLE"
    assert injection["refused"]["keys"] == ["execution_permissions", "target_user_id"]
    # the rejection in the ledger, as `ztate ledger rejections` showed it
    assert injection["cli_exit"] == 0
    assert "KEY_NOT_WRITABLE" in stdout
    rejections = await fetch(
        ledger_dsn, "SELECT * FROM ztate.rejections WHERE thread_id = $1", thread
    )
    assert len(rejections) == 1
    (rejection,) = rejections
    assert rejection["reason"] == "KEY_NOT_WRITABLE"
    assert list(rejection["keys"]) == ["execution_permissions", "target_user_id"]
    assert rejection["node_id"].endswith("/node/input-parser")
    assert rejection["base_version"] == 0
    assert [r["reason"] for r in injection["rejections"]] == ["KEY_NOT_WRITABLE"]
    # nothing committed: the thread holds its genesis only, no state names the attacker
    versions = await fetch(
        ledger_dsn, "SELECT version FROM ztate.transitions WHERE thread_id = $1", thread
    )
    assert [r["version"] for r in versions] == [0]
    assert injection["head_version"] == 0
    records = await fetch(ledger_dsn, "SELECT record FROM ztate.transitions")
    for found in records:  # the attacker's id is in the injected text, never in a write
        patch = json.loads(bytes(found["record"]))["patch"]
        assert patch.get("target_user_id") in (None, USER)
        assert "cancel_order" not in (patch.get("execution_permissions") or [])
    heads = await fetch(ledger_dsn, "SELECT state FROM ztate.threads")
    for head in heads:
        state = json.loads(head["state"])
        assert state["target_user_id"] == USER
        assert "cancel_order" not in state["execution_permissions"]
    written = (home / "demo-orders-db.jsonl").read_text().splitlines()
    assert [json.loads(w)["order_id"] for w in written] == ["A-42"]  # never A-99


async def test_the_risky_change_is_approved_and_the_writer_verified_its_receipt(
    demo: tuple[Path, dict[str, Any], str], ledger_dsn: str
) -> None:
    home, report, _ = demo
    risky = report["risky"]
    thread = risky["thread"]
    assert risky["approve_exit"] == 0
    (row,) = await fetch(
        ledger_dsn,
        "SELECT version, digest, record, receipt, receipt_signature, receipt_key_id, "
        "committed_at FROM ztate.transitions WHERE thread_id = $1 AND receipt IS NOT NULL",
        thread,
    )
    assert row["version"] == risky["committed"]["version"] == 3
    # the approval gate is not marked read_records: told the version, not the digest
    assert risky["committed"]["digest"] == ""
    # the receipt, checked by the server's own code against the same public keys
    signed = SignedReceipt(bytes(row["receipt"]), row["receipt_signature"], row["receipt_key_id"])
    record = json.loads(bytes(row["record"]))
    committed_at = datetime.fromisoformat(record["committed_at"].replace("Z", "+00:00"))
    receipt = verify_receipt(
        signed, load_public_keys(home / "keys" / "approval-public.json"), now=committed_at
    )
    assert receipt["transition_digest"] == risky["transition_digest"]
    assert receipt["reviewers"] == ["spiffe://ztate.local/reviewer/alice"]
    # what the database writer verified, before it acted, is that very receipt and head
    verified = risky["verified"]
    assert verified["receipt_digest"] == signed.digest == record["receipt_digest"]
    assert verified["transition_digest"] == risky["transition_digest"]
    assert verified["version"] == 3
    assert verified["checkpoint_version"] == 3
    (checkpoint,) = await fetch(
        ledger_dsn,
        "SELECT head_digest FROM ztate.checkpoints WHERE thread_id = $1 AND version = 3",
        thread,
    )
    assert checkpoint["head_digest"] == row["digest"]
    assert risky["written"]["version"] == 4


def test_ztate_verify_passes_over_the_demo_ledger(demo: tuple[Path, dict[str, Any], str]) -> None:
    _, report, stdout = demo
    assert report["verify_exit"] == 0
    assert report["verify_public_exit"] == 0
    assert "OK: verified 3 threads" in stdout
