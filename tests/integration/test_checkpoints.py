"""Signed checkpoints let anyone check the chain with public keys alone.

The transition service signs thread heads (Ed25519); ``ztate verify --public-only``
checks the chain links from genesis and that they pass through every signed head,
with no HMAC key. Rewriting history consistently (new bytes, new digests, new
parent links), which only an HMAC key holder could sign, is still caught.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from tests.harness import INITIAL, Pki, act, client, new_thread_id
from ztate.contract.canonical import JsonObject, canonical_bytes
from ztate.contract.keyring import (
    Keyring,
    generate_signing_key,
    load_public_keys,
    load_signing_key,
)
from ztate.services.policy.changes import apply_patch
from ztate.services.policy.model import PolicySet
from ztate.services.verify.bundle import (
    CHECKPOINTS,
    MANIFEST,
    RECORDS,
    BundleError,
    export_bundle,
    read_manifest,
    verify_bundle,
)
from ztate.services.verify.checks import Finding, Trust, verify_database
from ztate.transition_service.app import RunningService
from ztate.transition_service.checkpointer import Checkpointer
from ztate.transition_service.journal import CheckpointJournal

REPO = Path(__file__).resolve().parents[2]


@pytest_asyncio.fixture(scope="module")
async def signed(
    service: RunningService,
    target: str,
    pki: Pki,
    tmp_path_factory: pytest.TempPathFactory,
    keyring: Keyring,
) -> AsyncIterator[tuple[str, Path, Checkpointer]]:
    """A thread of three records whose head is checkpointed, and the public keys."""
    root = tmp_path_factory.mktemp("checkpoints")
    private, public = root / "signing.pem", root / "public.json"
    generate_signing_key(private, public, "checkpoint-k1")
    checkpointer = Checkpointer(
        service.store,
        load_signing_key(private),
        "checkpoint-k1",
        60,
        keyring=keyring,
        journal=CheckpointJournal(root / "journal.jsonl"),
    )
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(target, pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 0, {"requested_action": act("one")})
        assert await checkpointer.run_once() >= 1  # signs version 1 of this thread
        await parser.propose(thread_id, 1, {"requested_action": act("two")})
    yield thread_id, public, checkpointer


def public_trust(public: Path) -> Trust:
    policies = PolicySet.load(REPO / "services" / "defaults" / "policy.yaml")
    return Trust(None, {}, policies, load_public_keys(public))


async def verify(dsn: str, thread_id: str, trust: Trust) -> list[Finding]:
    findings: list[Finding] = []
    await verify_database(dsn, trust, findings.append, thread_id=thread_id)
    return findings


async def test_checkpoints_are_signed_once_per_head(
    signed: tuple[str, Path, Checkpointer], database_dsn: str
) -> None:
    thread_id, _public, checkpointer = signed
    await checkpointer.run_once()  # now version 2 too
    before = await checkpointer.run_once()
    assert before == 0  # nothing moved since: nothing new to sign
    conn = await asyncpg.connect(database_dsn)
    try:
        versions = await conn.fetch(
            "SELECT version FROM ztate.checkpoints WHERE thread_id = $1 ORDER BY version",
            thread_id,
        )
    finally:
        await conn.close()
    assert [r["version"] for r in versions] == [1, 2]


async def test_public_only_verification_passes_without_any_secret(
    signed: tuple[str, Path, Checkpointer], database_dsn: str
) -> None:
    thread_id, public, _ = signed
    assert await verify(database_dsn, thread_id, public_trust(public)) == []


async def test_a_consistent_rewrite_is_caught_by_the_signed_head(
    signed: tuple[str, Path, Checkpointer],
    service: RunningService,
    target: str,
    pki: Pki,
    database_dsn: str,
) -> None:
    """Rewrite version 1 and every link after it consistently, as only an HMAC key
    holder could: digests and parents agree, only the signed heads disagree."""
    _, public, checkpointer = signed
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(target, pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 0, {"requested_action": act("one")})
        await checkpointer.run_once()
        await parser.propose(thread_id, 1, {"requested_action": act("two")})
        await checkpointer.run_once()
    assert await verify(database_dsn, thread_id, public_trust(public)) == []
    conn = await asyncpg.connect(database_dsn)
    try:
        await conn.execute("SET session_replication_role = replica")  # skip the triggers
        rows = await conn.fetch(
            "SELECT version, record FROM ztate.transitions WHERE thread_id = $1 ORDER BY version",
            thread_id,
        )
        parent = None
        for row in rows:
            record = json.loads(bytes(row["record"]))
            if row["version"] == 1:
                record["patch"] = {"requested_action": act("forged")}
            if parent is not None:
                record["parent_digest"] = parent
            data = canonical_bytes(record)
            digest = hashlib.sha256(data).hexdigest()
            await conn.execute(
                "UPDATE ztate.transitions SET record = $3, digest = $4, parent_digest = $5 "
                "WHERE thread_id = $1 AND version = $2",
                thread_id,
                row["version"],
                data,
                digest,
                record["parent_digest"],
            )
            parent = digest
        await conn.execute(
            "UPDATE ztate.threads SET head_digest = $2 WHERE thread_id = $1", thread_id, parent
        )
    finally:
        await conn.close()
    findings = await verify(database_dsn, thread_id, public_trust(public))
    assert {(f.version, f.check) for f in findings if f.check == "checkpoint"} == {
        (1, "checkpoint"),
        (2, "checkpoint"),
    }


async def test_the_cli_verifies_with_public_keys_alone(
    signed: tuple[str, Path, Checkpointer], database_dsn: str, tmp_path: Path
) -> None:
    thread_id, public, checkpointer = signed
    await checkpointer.run_once()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    env.update(
        DATABASE_URL=database_dsn,
        ZTATE_HOME=str(tmp_path),  # no HMAC keyring anywhere here
        ZTATE_POLICY_PATH=str(REPO / "services" / "defaults" / "policy.yaml"),
    )
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("ztate")),
        "verify",
        "--public-only",
        "--checkpoint-keys",
        str(public),
        "--thread",
        thread_id,
        "--json",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    [summary] = [json.loads(line) for line in out.splitlines()]
    assert summary["type"] == "summary"
    assert summary["failures"] == 0
    assert summary["records"] == 3


# --- bundles carry the checkpoints --------------------------------------------------------


async def _exported(dsn: str, out: Path, thread_id: str) -> Path:
    await export_bundle(dsn, out, thread_id)
    return out


def _verify_bundle(folder: Path, thread_id: str, trust: Trust) -> list[Finding]:
    findings: list[Finding] = []
    verify_bundle(folder, trust, findings.append, thread_id=thread_id)
    return findings


def _rewrite_manifest(folder: Path) -> None:
    """Make the packing list agree with the edited files, as anyone could."""
    manifest = json.loads((folder / MANIFEST).read_bytes())
    records = (folder / RECORDS).read_bytes()
    checkpoints = (folder / CHECKPOINTS).read_bytes()
    manifest.update(
        records_sha256=hashlib.sha256(records).hexdigest(),
        records=len(records.splitlines()),
        checkpoints_sha256=hashlib.sha256(checkpoints).hexdigest(),
        checkpoints=len(checkpoints.splitlines()),
    )
    (folder / MANIFEST).write_text(json.dumps(manifest))


async def test_a_bundle_verifies_with_public_keys_alone(
    signed: tuple[str, Path, Checkpointer], database_dsn: str, tmp_path: Path
) -> None:
    thread_id, public, checkpointer = signed
    await checkpointer.run_once()
    folder = await _exported(database_dsn, tmp_path / "bundle", thread_id)
    manifest, _ = read_manifest(folder)
    assert manifest.checkpoints is not None
    assert manifest.checkpoints >= 1
    assert _verify_bundle(folder, thread_id, public_trust(public)) == []


async def test_a_consistent_rewrite_in_a_bundle_is_caught_by_the_signed_head(
    signed: tuple[str, Path, Checkpointer], database_dsn: str, tmp_path: Path
) -> None:
    """Without the HMAC key an attacker can rehash a bundle's chain and its manifest;
    only the checkpoints, signed elsewhere, disagree."""
    thread_id, public, checkpointer = signed
    await checkpointer.run_once()
    folder = await _exported(database_dsn, tmp_path / "bundle", thread_id)
    lines = [json.loads(line) for line in (folder / RECORDS).read_bytes().splitlines()]
    parent: str | None = None
    state: JsonObject = {}
    for line in lines:
        record = json.loads(line["record"])
        if line["version"] == 1:
            record["patch"] = {"requested_action": act("forged")}
        if parent is not None:
            record["parent_digest"] = line["parent_digest"] = parent
        state = apply_patch(state, record["patch"])
        line["state"] = canonical_bytes(state).decode()
        record["state_digest"] = hashlib.sha256(line["state"].encode()).hexdigest()
        line["record"] = canonical_bytes(record).decode()
        line["digest"] = parent = hashlib.sha256(line["record"].encode()).hexdigest()
    (folder / RECORDS).write_bytes(b"".join(canonical_bytes(line) + b"\n" for line in lines))
    manifest = json.loads((folder / MANIFEST).read_bytes())
    manifest["heads"][thread_id] = [lines[-1]["version"], parent]
    (folder / MANIFEST).write_text(json.dumps(manifest))
    _rewrite_manifest(folder)
    findings = _verify_bundle(folder, thread_id, public_trust(public))
    checks = {(f.version, f.check) for f in findings}
    assert (1, "checkpoint") in checks
    assert [str(f) for f in findings if f.check != "checkpoint"] == []


async def test_a_checkpoint_removed_from_a_bundle_is_reported(
    signed: tuple[str, Path, Checkpointer], database_dsn: str, tmp_path: Path
) -> None:
    thread_id, public, checkpointer = signed
    await checkpointer.run_once()
    folder = await _exported(database_dsn, tmp_path / "bundle", thread_id)
    kept = (folder / CHECKPOINTS).read_bytes().splitlines(keepends=True)[1:]
    (folder / CHECKPOINTS).write_bytes(b"".join(kept))
    findings = _verify_bundle(folder, thread_id, public_trust(public))
    assert {f.check for f in findings} == {"bundle.file_hash", "bundle.count"}


async def test_a_signed_head_of_a_thread_whose_records_were_removed_is_reported(
    signed: tuple[str, Path, Checkpointer], database_dsn: str, tmp_path: Path
) -> None:
    thread_id, public, checkpointer = signed
    await checkpointer.run_once()
    folder = await _exported(database_dsn, tmp_path / "bundle", thread_id)
    (folder / RECORDS).write_bytes(b"")
    manifest = json.loads((folder / MANIFEST).read_bytes())
    manifest.update(threads=0, heads={})
    (folder / MANIFEST).write_text(json.dumps(manifest))
    _rewrite_manifest(folder)
    findings: list[Finding] = []
    verify_bundle(folder, public_trust(public), findings.append)
    orphans = [f for f in findings if f.check == "checkpoint"]
    assert orphans
    assert all(f.thread_id == thread_id for f in orphans)
    assert all(f.found == "no record of the thread in the bundle" for f in orphans)


async def test_public_only_refuses_a_bundle_without_checkpoints(
    signed: tuple[str, Path, Checkpointer], database_dsn: str, tmp_path: Path
) -> None:
    thread_id, public, _ = signed
    folder = await _exported(database_dsn, tmp_path / "bundle", thread_id)
    manifest = json.loads((folder / MANIFEST).read_bytes())
    manifest["format"] = 1  # a bundle from before checkpoints travelled with it
    del manifest["checkpoints"], manifest["checkpoints_sha256"]
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="carries no checkpoints"):
        verify_bundle(folder, public_trust(public), lambda finding: None, thread_id=thread_id)
