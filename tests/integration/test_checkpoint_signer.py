"""The checkpoint signer does not take the database's word for a head (issue 13).

A Postgres superuser who rewrites a thread's history and deletes its checkpoint rows
used to get a valid signature over the forgery at the next round, and public-only
verification passed. Now the signer checks that a head extends the last head it
signed, as its own journal outside the database remembers it, and refuses loudly
otherwise; ``ztate verify --checkpoints JOURNAL`` makes the chain pass through what
the signer signed, whatever the database lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path

import asyncpg
import pytest

from tests.harness import INITIAL, Pki, act, client, new_thread_id
from ztate.contract.canonical import JsonObject, canonical_bytes, sha256_hex
from ztate.contract.keyring import Keyring, generate_signing_key, load_public_keys, load_signing_key
from ztate.contract.record import seal
from ztate.services.policy.changes import apply_patch
from ztate.services.policy.model import PolicySet
from ztate.services.verify.checks import Finding, Trust, verify_database
from ztate.services.verify.parallel import verify_database_parallel
from ztate.transition_service.app import RunningService
from ztate.transition_service.checkpointer import Checkpointer
from ztate.transition_service.journal import CheckpointJournal, NotePublisher

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "services" / "defaults" / "policy.yaml"


class Signer:
    def __init__(self, service: RunningService, keyring: Keyring, root: Path) -> None:
        self.private, self.public = root / "signing.pem", root / "public.json"
        generate_signing_key(self.private, self.public, "checkpoint-k1")
        self.journal = root / "journal.jsonl"
        self.checkpointer = Checkpointer(
            service.store,
            load_signing_key(self.private),
            "checkpoint-k1",
            60,
            keyring=keyring,
            journal=CheckpointJournal(self.journal),
            notes=NotePublisher(root / "notes", "ztate.test"),
        )

    def kept(self) -> dict[str, dict[int, object]]:
        from ztate.contract.checkpoints import parse_checkpoint_line

        kept: dict[str, dict[int, object]] = {}
        for line in self.journal.read_bytes().splitlines():
            thread_id, version, signed = parse_checkpoint_line(line)
            kept.setdefault(thread_id, {})[version] = signed
        return kept

    def trust(self, *, keyring: Keyring | None = None, kept: bool) -> Trust:
        return Trust(
            keyring,
            {},
            PolicySet.load(POLICY),
            load_public_keys(self.public),
            self.kept() if kept else {},  # type: ignore[arg-type]
        )


async def three_records(target: str, pki: Pki) -> str:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(target, pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 0, {"requested_action": act("one")})
        await parser.propose(thread_id, 1, {"requested_action": act("two")})
    return thread_id


async def checkpoint_versions(dsn: str, thread_id: str) -> list[int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT version FROM ztate.checkpoints WHERE thread_id = $1 ORDER BY version",
            thread_id,
        )
    finally:
        await conn.close()
    return [r["version"] for r in rows]


async def rewrite(dsn: str, thread_id: str, *, from_version: int, keyring: Keyring | None) -> None:
    """As a database superuser: change the patch at ``from_version``, replay the states,
    and relink every later record (re-signed under ``keyring`` when given: a holder of
    the HMAC key; else the old signatures stay and no longer verify), move the head, and
    delete the thread's checkpoint rows: a rewrite consistent in every way but the keys."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("SET session_replication_role = replica")  # past the triggers
        rows = await conn.fetch(
            "SELECT version, record, signature, state FROM ztate.transitions "
            "WHERE thread_id = $1 ORDER BY version",
            thread_id,
        )
        parent: str | None = None
        state: JsonObject = {}
        for row in rows:
            if row["version"] < from_version:
                state = json.loads(bytes(row["state"]))
                continue
            record = json.loads(bytes(row["record"]))
            if row["version"] == from_version:
                record["patch"] = {"requested_action": act("forged")}
            if parent is not None:
                record["parent_digest"] = parent
            state = apply_patch(state, record["patch"])
            state_bytes = canonical_bytes(state)
            record["state_digest"] = sha256_hex(state_bytes)
            if keyring is not None:
                sealed = seal(record, keyring)
                data, digest, signature = sealed.record_bytes, sealed.digest, sealed.signature
            else:
                data = canonical_bytes(record)
                digest, signature = sha256_hex(data), row["signature"]
            await conn.execute(
                "UPDATE ztate.transitions SET record = $3, digest = $4, parent_digest = $5, "
                "signature = $6, state = $7 WHERE thread_id = $1 AND version = $2",
                thread_id,
                row["version"],
                data,
                digest,
                record["parent_digest"],
                signature,
                state_bytes,
            )
            parent = digest
        await conn.execute(
            "UPDATE ztate.threads SET head_digest = $2, state = $3 WHERE thread_id = $1",
            thread_id,
            parent,
            canonical_bytes(state),
        )
        await conn.execute("DELETE FROM ztate.checkpoints WHERE thread_id = $1", thread_id)
    finally:
        await conn.close()


async def findings(dsn: str, thread_id: str, trust: Trust) -> list[Finding]:
    found: list[Finding] = []
    await verify_database(dsn, trust, found.append, thread_id=thread_id)
    return found


async def test_a_consistent_rewrite_with_the_key_and_deleted_checkpoints_is_refused(
    service: RunningService,
    target: str,
    pki: Pki,
    keyring: Keyring,
    database_dsn: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The issue's attack, both halves: the signer refuses the forged head, and the
    journal given to the verifier catches what the database alone no longer shows."""
    signer = Signer(service, keyring, tmp_path)
    thread_id = await three_records(target, pki)
    await signer.checkpointer.run_once()
    assert await checkpoint_versions(database_dsn, thread_id) == [2]
    await rewrite(database_dsn, thread_id, from_version=1, keyring=keyring)

    caplog.set_level(logging.ERROR, logger="ztate.transition")
    await signer.checkpointer.run_once()
    assert await checkpoint_versions(database_dsn, thread_id) == []  # nothing signed
    [refusal] = [r.getMessage() for r in caplog.records if thread_id in r.getMessage()]
    assert "REFUSED" in refusal
    assert "this signer signed version 2 digest" in refusal

    # the database alone says nothing: every link and every HMAC verifies
    assert await findings(database_dsn, thread_id, signer.trust(keyring=keyring, kept=False)) == []
    assert await findings(database_dsn, thread_id, signer.trust(kept=False)) == []
    # the journal, kept outside the database, does
    for trust in (signer.trust(keyring=keyring, kept=True), signer.trust(kept=True)):
        caught = await findings(database_dsn, thread_id, trust)
        assert [(f.thread_id, f.version, f.check) for f in caught] == [(thread_id, 2, "checkpoint")]
        # and on worker processes (--jobs), which read the journal as one process does
        caught = []
        await verify_database_parallel(
            database_dsn, trust, caught.append, jobs=2, thread_id=thread_id
        )
        assert [(f.thread_id, f.version, f.check) for f in caught] == [(thread_id, 2, "checkpoint")]


async def test_a_rewrite_after_the_last_checkpoint_without_the_key_is_refused(
    service: RunningService,
    target: str,
    pki: Pki,
    keyring: Keyring,
    database_dsn: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The limit the threat model names: records after the last checkpoint are not
    covered by a signature yet. Without the HMAC key the signer still refuses them
    (it checks every HMAC on the way), so the forgery never gets a checkpoint."""
    signer = Signer(service, keyring, tmp_path)
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(target, pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 0, {"requested_action": act("one")})
        await signer.checkpointer.run_once()  # signs version 1
        await parser.propose(thread_id, 1, {"requested_action": act("two")})
    assert await checkpoint_versions(database_dsn, thread_id) == [1]
    conn = await asyncpg.connect(database_dsn)
    try:
        kept_row = await conn.fetchrow(
            "SELECT checkpoint, signature, key_id, head_digest, signed_at FROM ztate.checkpoints "
            "WHERE thread_id = $1",
            thread_id,
        )
    finally:
        await conn.close()
    await rewrite(database_dsn, thread_id, from_version=2, keyring=None)
    # the rewrite deleted the checkpoint rows; put the honest one at version 1 back
    conn = await asyncpg.connect(database_dsn)
    try:
        await conn.execute(
            "INSERT INTO ztate.checkpoints (thread_id, version, head_digest, checkpoint, "
            "signature, key_id, signed_at) VALUES ($1, 1, $2, $3, $4, $5, $6)",
            thread_id,
            kept_row["head_digest"],
            kept_row["checkpoint"],
            kept_row["signature"],
            kept_row["key_id"],
            kept_row["signed_at"],
        )
    finally:
        await conn.close()

    caplog.set_level(logging.ERROR, logger="ztate.transition")
    await signer.checkpointer.run_once()
    assert await checkpoint_versions(database_dsn, thread_id) == [1]  # version 2 unsigned
    [refusal] = [r.getMessage() for r in caplog.records if thread_id in r.getMessage()]
    assert "version 2: HMAC signature does not verify" in refusal
    caught = await findings(database_dsn, thread_id, signer.trust(keyring=keyring, kept=True))
    assert [(f.version, f.check) for f in caught] == [(2, "signature")]


async def test_an_honest_thread_is_signed_and_re_signed_when_its_row_is_lost(
    service: RunningService,
    target: str,
    pki: Pki,
    keyring: Keyring,
    database_dsn: str,
    tmp_path: Path,
) -> None:
    signer = Signer(service, keyring, tmp_path)
    thread_id = await three_records(target, pki)
    await signer.checkpointer.run_once()
    conn = await asyncpg.connect(database_dsn)
    try:
        await conn.execute("SET session_replication_role = replica")
        await conn.execute("DELETE FROM ztate.checkpoints WHERE thread_id = $1", thread_id)
    finally:
        await conn.close()
    await signer.checkpointer.run_once()  # the same head, signed before: signed again
    assert await checkpoint_versions(database_dsn, thread_id) == [2]
    assert await findings(database_dsn, thread_id, signer.trust(kept=True)) == []


async def test_the_cli_takes_the_journal_and_reports_a_deleted_thread(
    service: RunningService,
    target: str,
    pki: Pki,
    keyring: Keyring,
    database_dsn: str,
    tmp_path: Path,
) -> None:
    signer = Signer(service, keyring, tmp_path)
    thread_id = await three_records(target, pki)
    await signer.checkpointer.run_once()
    conn = await asyncpg.connect(database_dsn)
    try:
        await conn.execute("SET session_replication_role = replica")
        for table in ("checkpoints", "transitions", "threads"):
            await conn.execute(f"DELETE FROM ztate.{table} WHERE thread_id = $1", thread_id)  # noqa: S608
    finally:
        await conn.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    env.update(DATABASE_URL=database_dsn, ZTATE_HOME=str(tmp_path), ZTATE_POLICY_PATH=str(POLICY))
    for jobs in ("1", "2"):  # the journal works on worker processes too
        process = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).with_name("ztate")),
            "verify",
            "--public-only",
            "--checkpoint-keys",
            str(signer.public),
            "--checkpoints",
            str(signer.journal),
            "--thread",
            thread_id,
            "--jobs",
            jobs,
            "--json",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 1, err.decode()
        lines = [json.loads(line) for line in out.splitlines()]
        assert [(d["thread_id"], d["version"], d["check"]) for d in lines[:-1]] == [
            (thread_id, 2, "checkpoint")
        ]
        assert lines[-1]["type"] == "summary"


async def test_each_threads_latest_checkpoint_is_published_as_a_c2sp_signed_note(
    service: RunningService, target: str, pki: Pki, keyring: Keyring, tmp_path: Path
) -> None:
    """The note names the thread's chain (origin), its size (records) and its head, and
    verifies under the checkpoint key's note verifier key; an altered note does not."""
    import base64

    from ztate.contract.checkpoints import note_verifier_key, verify_note
    from ztate.contract.errors import CheckpointInvalid

    signer = Signer(service, keyring, tmp_path)
    thread_id = await three_records(target, pki)
    await signer.checkpointer.run_once()
    note = (tmp_path / "notes" / f"thread-{thread_id}.note").read_bytes()
    [public] = load_public_keys(signer.public).values()
    head = (await service.store.read_head(thread_id)).digest  # type: ignore[union-attr]
    text = verify_note(note, "ztate.test", public)
    assert (
        text
        == (
            f"ztate.test/ztate/thread/{thread_id}\n3\n"
            f"{base64.b64encode(bytes.fromhex(head)).decode()}\n"
        ).encode()
    )
    assert note_verifier_key("ztate.test", public).startswith("ztate.test+")
    forged = note.replace(b"\n3\n", b"\n4\n", 1)
    with pytest.raises(CheckpointInvalid):
        verify_note(forged, "ztate.test", public)


async def test_notes_that_cannot_be_published_do_not_stop_the_signer(
    service: RunningService,
    target: str,
    pki: Pki,
    keyring: Keyring,
    tmp_path: Path,
    database_dsn: str,
) -> None:
    """The notes are a copy: when their folder cannot be written (here a file stands where
    it should be), the round still journals, stores and counts its checkpoints, and the
    next round publishes the notes of the heads it signs."""
    signer = Signer(service, keyring, tmp_path)
    (tmp_path / "notes").write_bytes(b"not a folder")
    thread_id = await three_records(target, pki)

    assert await signer.checkpointer.run_once() >= 1
    assert sorted(signer.kept()[thread_id]) == [2]
    assert await checkpoint_versions(database_dsn, thread_id) == [2]

    (tmp_path / "notes").unlink()
    async with client(target, pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 2, {"requested_action": act("n")})
    await signer.checkpointer.run_once()
    notes = sorted(p.name for p in (tmp_path / "notes").iterdir())
    assert notes == [f"thread-{thread_id}.note"]  # no temporary file left behind
