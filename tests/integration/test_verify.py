"""``ztate verify`` and ``ztate ledger export`` against a real ledger, then tampered.

Threads are written through the real transition service over mTLS, including a
risky transition committed under a signed approval receipt. Each test then
tampers with its own thread directly in Postgres as a superuser, the way an
attacker with database access would: the append-only triggers refuse UPDATE and
DELETE even to superusers, so the tampering session sets
``session_replication_role = replica``, which skips triggers. The verifier must
name the thread, the version and the check of every change, keep going to the
other threads, and find the untampered ones clean. The same tampering is done in
exported bundles by editing their JSON lines. All of it runs in a database of
its own, so no other test's data is ever touched.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from unittest import mock

import asyncpg
import grpc
import pytest
import pytest_asyncio

from tests.citus.lanes import LANES, lane_database
from tests.harness import (
    INITIAL,
    TRUST_DOMAIN,
    USER,
    Pki,
    act,
    as_operator_sees_it,
    client,
    deliver_approval,
    fresh_database,
    new_thread_id,
    with_database,
)
from tests.unit.test_verify_lane import LANE_OF, Counting
from ztate.contract.canonical import canonical_bytes, sha256_hex
from ztate.contract.keyring import Keyring, generate_signing_key, load_public_keys
from ztate.contract.record import build_record, seal, sign_digest
from ztate.services.policy.model import PolicySet
from ztate.services.runtime.config import Settings
from ztate.services.verify import checks
from ztate.services.verify.bundle import (
    BUNDLE_HASH,
    MANIFEST,
    RECORDS,
    export_bundle,
    verify_bundle,
)
from ztate.services.verify.checks import Finding, Summary, Trust, VerifyError, verify_database
from ztate.services.verify.parallel import verify_bundle_parallel, verify_database_parallel
from ztate.transition_service.app import RunningService, start
from ztate.v1 import transition_pb2, transition_pb2_grpc
from ztate.worker_sdk import AwaitingApproval

REPO = Path(__file__).resolve().parents[2]
OTHER_USER = "9b2f5d0e-1c3a-4e6b-8d7f-0a1b2c3d4e5f"
APPROVED_AT = 2  # the version committed under a receipt
VERSIONS = 5  # versions 0-4 per thread


@dataclass
class World:
    """A transition service on a database of its own, and the keys to verify it."""

    dsn: str
    root: Path
    pki: Pki
    settings: Settings
    service: RunningService
    keyring: Keyring
    trust: Trust
    tampered: set[str] = field(default_factory=set)

    @property
    def target(self) -> str:
        return f"localhost:{self.service.port}"

    async def thread(self) -> str:
        """Five versions; version 2 changes the target user, which needs approval."""
        thread_id = new_thread_id()
        async with client(self.target, self.pki.operator()) as operator:
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        async with client(self.target, self.pki.node("input-parser")) as parser:
            await parser.propose(thread_id, 0, {"requested_action": act(thread_id)})
        async with client(self.target, self.pki.node("planner")) as planner:
            with pytest.raises(AwaitingApproval) as parked:
                await planner.propose(thread_id, 1, {"target_user_id": OTHER_USER})
            await self.approve(await as_operator_sees_it(self.dsn, parked.value))
            plan = {"action": "refund", "order_id": "A-42", "amount_cents": 1200}
            await planner.propose(thread_id, 2, {"pending_transition": plan})
        async with client(self.target, self.pki.node("approval-gate")) as gate:
            await gate.propose(thread_id, 3, {"execution_permissions": []})
        return thread_id

    async def approve(self, parked: AwaitingApproval) -> None:
        """ApplyDecision as the approval service, with a receipt signed by its key."""
        applied = await deliver_approval(
            self.target,
            self.pki,
            self.root / "approval" / "signing-key.pem",
            parked.digest,
            parked.thread_id,
            parked.base_version,
        )
        assert applied.outcome == transition_pb2.OUTCOME_COMMITTED

    async def tamper(self, thread_id: str, *statements: tuple[str, tuple[Any, ...]]) -> None:
        """Run ``statements`` as a superuser with the append-only triggers skipped."""
        self.tampered.add(thread_id)
        conn = await asyncpg.connect(self.dsn)
        try:
            async with conn.transaction():
                # on Citus, SET LOCAL reaches the workers' sessions too (a plain
                # Postgres takes the citus.* name as a placeholder and ignores it)
                await conn.execute("SET LOCAL citus.propagate_set_commands = 'local'")
                await conn.execute("SET LOCAL session_replication_role = replica")
                for sql, args in statements:
                    await conn.execute(sql, *args)
        finally:
            await conn.close()

    async def row(self, thread_id: str, version: int) -> asyncpg.Record:
        conn = await asyncpg.connect(self.dsn)
        try:
            row = await conn.fetchrow(
                "SELECT * FROM ztate.transitions WHERE thread_id = $1 AND version = $2",
                thread_id,
                version,
            )
        finally:
            await conn.close()
        assert row is not None
        return row

    async def verify(self, thread_id: str | None = None) -> tuple[list[Finding], Summary]:
        """verify_database's findings and summary, the same (in the same order) with the
        compiled lane as with the reference alone: whatever the tampering, the lane may
        only make a run faster."""
        findings: list[Finding] = []
        summary = await verify_database(self.dsn, self.trust, findings.append, thread_id=thread_id)
        alone: list[Finding] = []
        with mock.patch.object(checks, "compiled_lane", return_value=None):
            reference = await verify_database(
                self.dsn, self.trust, alone.append, thread_id=thread_id
            )
        assert (findings, summary) == (alone, reference)
        return findings, summary


async def open_world(dsn: str, pki: Pki, keyring_file: Path, policy_dir: Path, root: Path) -> World:
    """A transition service (with an approval public key) on the fresh database ``dsn``."""
    public_keys = root / "approval-public.json"
    generate_signing_key(root / "approval" / "signing-key.pem", public_keys, "approval-k1")
    settings = Settings(
        home=root / "home",
        listen="127.0.0.1:0",
        trust_domain=TRUST_DOMAIN,
        tls_cert=pki.certs / "service-transition.crt",
        tls_key=pki.certs / "service-transition.key",
        tls_ca=pki.certs / "ca.crt",
        policy_path=policy_dir,
        hmac_keyring_file=keyring_file,
        approval_public_keys_file=public_keys,
        db_pool_size=4,
    )
    service = await start(settings, dsn=dsn)
    keyring = Keyring.load(keyring_file, None)
    trust = Trust(keyring, load_public_keys(public_keys), PolicySet.load(policy_dir))
    return World(dsn, root, pki, settings, service, keyring, trust)


@pytest_asyncio.fixture(scope="module", params=LANES)
async def world(
    request: pytest.FixtureRequest,
    pki: Pki,
    keyring_file: Path,
    policy_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[World]:
    """On a fresh database of each lane (Postgres; Citus in its lane)."""
    opened = await open_world(
        await lane_database(request.param, request),
        pki,
        keyring_file,
        policy_dir,
        tmp_path_factory.mktemp("verify"),
    )
    yield opened
    await opened.service.stop(grace=1.0)


@pytest_asyncio.fixture(scope="module")
async def clean(world: World) -> str:
    """A thread nobody tampers with."""
    return await world.thread()


OwnLedger = Callable[[int], Awaitable[tuple[World, list[str]]]]


@pytest_asyncio.fixture
def own_ledger(
    postgres_server_dsn: str, pki: Pki, keyring_file: Path, policy_dir: Path, tmp_path: Path
) -> OwnLedger:
    """A ledger of its own with ``n`` threads written, its service stopped (verification
    needs none): for a test that changes the schema, which the module's world shares."""

    async def written(n: int) -> tuple[World, list[str]]:
        own = await open_world(
            await fresh_database(postgres_server_dsn), pki, keyring_file, policy_dir, tmp_path
        )
        try:
            return own, [await own.thread() for _ in range(n)]
        finally:
            await own.service.stop(grace=1.0)

    return written


async def tampered_findings(
    world: World, thread_id: str, clean: str
) -> set[tuple[int | None, str]]:
    """Verify the whole database: the clean thread passes, failures are only in
    threads some test tampered with, and this thread's are returned."""
    findings, summary = await world.verify()
    assert {f.thread_id for f in findings} <= world.tampered
    assert all(f.thread_id != clean for f in findings)
    assert summary.threads >= 2
    assert summary.failures == len(findings)
    alone, _ = await world.verify(thread_id)
    mine = [f for f in findings if f.thread_id == thread_id]
    assert alone == mine  # one thread alone is verified exactly as within the whole
    return {(f.version, f.check) for f in mine}


# --- a clean ledger -------------------------------------------------------------------


async def test_a_ledger_written_by_the_service_verifies(world: World, clean: str) -> None:
    findings, summary = await world.verify(clean)
    assert findings == []
    assert (summary.threads, summary.records, summary.exit_code) == (1, VERSIONS, 0)
    approved = await world.row(clean, APPROVED_AT)
    assert approved["receipt"] is not None  # the receipt path was exercised


async def test_the_compiled_lane_takes_the_rows_the_service_wrote(world: World, clean: str) -> None:
    """From the database as from a bundle: the genesis and the plain transitions
    (versions 0, 1, 3 and 4: not the one under a receipt) go through the compiled lane."""
    counters: list[Counting] = []

    def counted(trust: Trust) -> Counting:
        counters.append(Counting(LANE_OF(trust)))
        return counters[-1]

    findings: list[Finding] = []
    with mock.patch.object(checks, "compiled_lane", counted):
        summary = await verify_database(world.dsn, world.trust, findings.append, thread_id=clean)
    assert (findings, summary.records) == ([], VERSIONS)
    (counter,) = counters
    assert (counter.taken, counter.declined) == (4, 1)  # declined: the receipt's row


# --- tampering in the database ----------------------------------------------------------


def update(column: str, value: Any, thread_id: str, version: int) -> tuple[str, tuple[Any, ...]]:
    assert column.isidentifier()  # a column name from this file, never data
    return (
        f"UPDATE ztate.transitions SET {column} = $1 WHERE thread_id = $2 AND version = $3",  # noqa: S608
        (value, thread_id, version),
    )


async def test_a_changed_state_body_is_pinpointed(world: World, clean: str) -> None:
    thread_id = await world.thread()
    forged = canonical_bytes({**INITIAL, "target_user_id": OTHER_USER, "is_admin": True})
    await world.tamper(thread_id, update("state", forged, thread_id, 3))
    assert await tampered_findings(world, thread_id, clean) == {(3, "state")}


async def test_a_changed_patch_is_pinpointed(world: World, clean: str) -> None:
    thread_id = await world.thread()
    record = bytes((await world.row(thread_id, 3))["record"])
    assert record.count(b'"amount_cents":1200') == 1
    forged = record.replace(b'"amount_cents":1200', b'"amount_cents":9900')
    await world.tamper(thread_id, update("record", forged, thread_id, 3))
    # the bytes no longer hash to the signed digest, and replaying them gives another state
    assert await tampered_findings(world, thread_id, clean) == {(3, "digest"), (3, "replay")}


async def test_a_changed_node_id_is_pinpointed(world: World, clean: str) -> None:
    thread_id = await world.thread()
    await world.tamper(
        thread_id, update("node_id", "spiffe://ztate.test/node/db-writer", thread_id, 1)
    )
    assert await tampered_findings(world, thread_id, clean) == {(1, "column.node_id")}


async def test_null_columns_are_findings_not_crashes(world: World, clean: str) -> None:
    """The schema's NOT NULL is the database's word: dropped, and the columns emptied,
    each is a finding of its row (with the compiled lane as without it)."""
    thread_id = await world.thread()
    await world.tamper(
        thread_id,
        ("ALTER TABLE ztate.transitions ALTER COLUMN committed_at DROP NOT NULL", ()),
        ("ALTER TABLE ztate.transitions ALTER COLUMN signature DROP NOT NULL", ()),
        update("committed_at", None, thread_id, 1),
        update("signature", None, thread_id, 3),
    )
    assert await tampered_findings(world, thread_id, clean) == {
        (1, "column.committed_at"),
        (3, "signature"),
    }


async def test_null_versions_are_findings_not_crashes(own_ledger: OwnLedger) -> None:
    """With the primary keys' NOT NULL gone, a record with no version and a head with
    no version are findings of their thread, never a crash (one process and two, with
    the compiled lane as without it). A ledger of its own: the service needs its keys."""
    own, (records, head) = await own_ledger(2)
    await own.tamper(
        records,
        ("ALTER TABLE ztate.transitions DROP CONSTRAINT transitions_pkey CASCADE", ()),
        ("ALTER TABLE ztate.transitions ALTER COLUMN version DROP NOT NULL", ()),
        update("version", None, records, 3),
        ("ALTER TABLE ztate.threads ALTER COLUMN version DROP NOT NULL", ()),
        ("UPDATE ztate.threads SET version = NULL WHERE thread_id = $1", (head,)),
    )
    findings, summary = await own.verify()
    head_digest = (await own.row(head, VERSIONS - 1))["digest"]
    assert {(f.thread_id, f.version, f.check, f.expected, f.found) for f in findings} == {
        (records, 3, "version", "version 3", "version 4: version 3 is missing"),
        (records, None, "version", "a version", "none: a record with a null version column"),
        (
            head,
            VERSIONS - 1,
            "head",
            f"version none (a null column), digest {head_digest} (the head)",
            f"version {VERSIONS - 1}, digest {head_digest} (the last record)",
        ),
    }
    assert (summary.threads, summary.records, summary.failures) == (2, 2 * VERSIONS, 3)
    # signed heads with no version, or null columns: findings too, once the run checks them
    await own.tamper(
        records,
        ("ALTER TABLE ztate.checkpoints DROP CONSTRAINT checkpoints_pkey", ()),
        ("ALTER TABLE ztate.checkpoints ALTER COLUMN version DROP NOT NULL", ()),
        ("ALTER TABLE ztate.checkpoints ALTER COLUMN checkpoint DROP NOT NULL", ()),
        ("ALTER TABLE ztate.checkpoints ALTER COLUMN signature DROP NOT NULL", ()),
        ("ALTER TABLE ztate.checkpoints ALTER COLUMN key_id DROP NOT NULL", ()),
        (
            "INSERT INTO ztate.checkpoints (thread_id, version, head_digest, checkpoint, "
            "signature, key_id, signed_at) VALUES ($1, NULL, $2, '{}', 'x', 'k', now()), "
            "($1, 1, $2, NULL, NULL, NULL, now())",
            (records, head_digest),
        ),
    )
    signed = dataclasses.replace(own, trust=dataclasses.replace(own.trust, checkpoint_keys={}))
    with_heads, counted = await signed.verify()
    assert {(f.thread_id, f.version, f.check, f.found) for f in with_heads} == {
        (f.thread_id, f.version, f.check, f.found) for f in findings
    } | {
        (records, None, "checkpoint", "one with a null version"),
        (records, 1, "checkpoint", "no checkpoint public key has id NULL"),
    }
    assert counted.failures == 5
    parallel: list[Finding] = []
    two = await verify_database_parallel(own.dsn, own.trust, parallel.append, jobs=2)
    assert (sorted(map(str, parallel)), two) == (sorted(map(str, findings)), summary)


async def test_rows_and_heads_of_no_thread_are_verified_alike_on_workers(
    own_ledger: OwnLedger,
) -> None:
    """With the primary keys dropped, a record with a null thread_id and a head with a
    null thread_id: the workers (--jobs 2 and 3) report exactly what one process does.
    Before, no range of thread ids held the record (its findings were lost), and a
    range starting at the null head's tile took the whole ledger again."""
    own, (a, _clean, c) = await own_ledger(3)
    await own.tamper(
        a,
        ("ALTER TABLE ztate.transitions DROP CONSTRAINT transitions_pkey CASCADE", ()),
        ("ALTER TABLE ztate.threads DROP CONSTRAINT threads_pkey CASCADE", ()),
        ("ALTER TABLE ztate.transitions ALTER COLUMN thread_id DROP NOT NULL", ()),
        ("ALTER TABLE ztate.threads ALTER COLUMN thread_id DROP NOT NULL", ()),
        (
            "UPDATE ztate.transitions SET thread_id = NULL WHERE thread_id = $1 AND version = 3",
            (a,),
        ),
        ("UPDATE ztate.threads SET thread_id = NULL WHERE thread_id = $1", (c,)),
    )
    findings, summary = await own.verify()
    last = VERSIONS - 1
    assert sorted((f.thread_id or "", f.version or 0, f.check) for f in findings) == sorted(
        [
            (a, 3, "version"),  # missing where it was
            (c, last, "head"),  # c's head row is no longer c's
            ("", 0, "version"),  # the rows of no thread: versions 0-2 missing
            ("", 3, "thread_id"),  # its record names thread a
            ("", 3, "head"),  # no head of no thread for it
            ("", last, "head"),  # a head of no thread, without records
        ]
    )
    for jobs in (2, 3):
        parallel: list[Finding] = []
        counted = await verify_database_parallel(own.dsn, own.trust, parallel.append, jobs=jobs)
        assert (sorted(map(str, parallel)), counted) == (sorted(map(str, findings)), summary)


async def test_columns_of_another_type_reach_the_checks_as_the_schemas(
    own_ledger: OwnLedger, tmp_path: Path
) -> None:
    """A column whose type was altered (committed_at to text, signature to varchar): read
    cast to the schema's type, the ledger verifies as before (the values are those
    the service wrote). A value that does not convert stops the run with exit 2,
    'reading the ledger failed', the value's control characters escaped on the
    terminal. A bundle exported from it verifies. Before, the checks and the export
    got a str and crashed (AttributeError)."""
    own, (thread_id,) = await own_ledger(1)
    await own.tamper(
        thread_id,
        ("ALTER TABLE ztate.transitions ALTER COLUMN committed_at TYPE text", ()),
        ("ALTER TABLE ztate.transitions ALTER COLUMN signature TYPE varchar(80)", ()),
    )
    findings, summary = await own.verify()
    assert (findings, summary.records, summary.exit_code) == ([], VERSIONS, 0)
    await export_bundle(own.dsn, tmp_path / "bundle")  # exported as the types it holds
    exported = verify_bundle(tmp_path / "bundle", own.trust, findings.append)
    assert (findings, exported.records) == ([], VERSIONS)

    await own.tamper(thread_id, update("committed_at", "\x1b[2J\x1b[32mOK", thread_id, 1))
    with pytest.raises(VerifyError, match="reading the ledger failed: InvalidDatetimeFormatError"):
        await verify_database(own.dsn, own.trust, findings.append)
    assert findings == []
    code, _, err = await ztate(own, "verify")
    assert code == 2
    assert "\x1b" not in err
    assert 'timestamp with time zone: "\\x1b[2J\\x1b[32mOK"' in err


def test_a_finding_shows_the_sources_text_escaped() -> None:
    """A thread id, expected or found holding a terminal's control sequence, a
    right-to-left override or a line separator: the text line escapes them (the JSON
    line escapes them by JSON's rules)."""
    finding = Finding("t\x1b[2J", 3, "thread_id", "a\u202eb", "line\u2028two\nthree")
    assert str(finding) == (
        "thread t\\x1b[2J version 3: thread_id: expected a\\u202eb; found line\\u2028two\\nthree"
    )
    assert str(finding).isprintable()


async def test_a_changed_signature_is_pinpointed(world: World, clean: str) -> None:
    thread_id = await world.thread()
    signature = (await world.row(thread_id, 4))["signature"]
    flipped = ("0" if signature[0] != "0" else "1") + signature[1:]
    await world.tamper(thread_id, update("signature", flipped, thread_id, 4))
    assert await tampered_findings(world, thread_id, clean) == {(4, "signature")}


async def test_a_changed_receipt_is_pinpointed(world: World, clean: str) -> None:
    thread_id = await world.thread()
    receipt = bytes((await world.row(thread_id, APPROVED_AT))["receipt"])
    forged = receipt.replace(b"reviewer/alice", b"reviewer/mallo")
    await world.tamper(thread_id, update("receipt", forged, thread_id, APPROVED_AT))
    assert await tampered_findings(world, thread_id, clean) == {
        (APPROVED_AT, "receipt.digest"),
        (APPROVED_AT, "receipt.signature"),
    }


async def test_a_removed_receipt_is_pinpointed(world: World, clean: str) -> None:
    thread_id = await world.thread()
    await world.tamper(
        thread_id,
        update("receipt", None, thread_id, APPROVED_AT),
        update("receipt_signature", None, thread_id, APPROVED_AT),
    )
    assert await tampered_findings(world, thread_id, clean) == {(APPROVED_AT, "receipt.missing")}


async def test_a_deleted_row_is_pinpointed(world: World, clean: str) -> None:
    thread_id = await world.thread()
    await world.tamper(
        thread_id,
        ("DELETE FROM ztate.transitions WHERE thread_id = $1 AND version = 2", (thread_id,)),
    )
    findings = await tampered_findings(world, thread_id, clean)
    assert findings == {(2, "version")}


async def test_a_deleted_head_row_is_pinpointed(world: World, clean: str) -> None:
    thread_id = await world.thread()
    await world.tamper(
        thread_id,
        ("DELETE FROM ztate.transitions WHERE thread_id = $1 AND version = 4", (thread_id,)),
    )
    assert await tampered_findings(world, thread_id, clean) == {(4, "head")}


def forged_row(
    world: World, parent: asyncpg.Record, version: int, node: str, patch: dict[str, Any]
) -> tuple[tuple[str, tuple[Any, ...]], bytes, str]:
    """An INSERT of a record on ``parent``, signed with the real key (a stolen key or
    a buggy writer), with the state bytes and digest it commits to."""
    state = canonical_bytes({**json.loads(bytes(parent["state"])), **patch})
    node_id = f"spiffe://ztate.test/node/{node}"
    now = datetime.now(UTC)
    sealed = seal(
        build_record(
            kind="transition",
            thread_id=parent["thread_id"],
            version=version,
            parent_digest=parent["digest"],
            node_id=node_id,
            patch=patch,
            state_digest=sha256_hex(state),
            policy_digest=json.loads(bytes(parent["record"]))["policy_digest"],
            receipt_digest=None,
            key_id=world.keyring.current,
            committed_at=now,
        ),
        world.keyring,
    )
    insert = (
        "INSERT INTO ztate.transitions (thread_id, version, digest, parent_digest, node_id, "
        "key_id, signature, record, state, committed_at) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        (
            parent["thread_id"],
            version,
            sealed.digest,
            parent["digest"],
            node_id,
            sealed.key_id,
            sealed.signature,
            sealed.record_bytes,
            state,
            now,
        ),
    )
    return insert, state, sealed.digest


async def test_an_inserted_fork_is_pinpointed(world: World, clean: str) -> None:
    """A second child of version 1, appended as version 5."""
    thread_id = await world.thread()
    parent, head = await world.row(thread_id, 1), await world.row(thread_id, 4)
    (sql, args), _, _ = forged_row(
        world, parent, 5, "db-writer", {"result_ref": "https://x.example/"}
    )
    # the parent_digest column claims a clean link to the head; the signed record forks
    args = (*args[:3], head["digest"], *args[4:])
    await world.tamper(thread_id, (sql, args))
    findings = await tampered_findings(world, thread_id, clean)
    assert (5, "parent") in findings
    assert {version for version, _ in findings} == {5}
    assert {check for _, check in findings} == {"parent", "column.parent_digest", "replay", "head"}


async def test_a_risky_transition_committed_without_a_receipt_is_pinpointed(
    world: World, clean: str
) -> None:
    """Well signed, well linked, the head moved along: only the missing approval shows."""
    thread_id = await world.thread()
    head = await world.row(thread_id, 4)
    insert, state, digest = forged_row(world, head, 5, "planner", {"target_user_id": USER})
    await world.tamper(
        thread_id,
        insert,
        (
            "UPDATE ztate.threads SET version = 5, head_digest = $2, state = $3 "
            "WHERE thread_id = $1",
            (thread_id, digest, state),
        ),
    )
    findings, _ = await world.verify(thread_id)
    assert [(f.version, f.check) for f in findings] == [(5, "risk")]
    assert "target-user-change" in findings[0].expected
    assert await tampered_findings(world, thread_id, clean) == {(5, "risk")}


async def test_swapped_versions_are_pinpointed(world: World, clean: str) -> None:
    thread_id = await world.thread()
    await world.tamper(
        thread_id,
        update("version", 1000, thread_id, 1),
        update("version", 1, thread_id, 3),
        update("version", 3, thread_id, 1000),
    )
    assert await tampered_findings(world, thread_id, clean) == {(1, "version"), (3, "version")}


async def test_a_head_without_records_is_reported_and_an_unknown_thread_is_a_usage_error(
    world: World,
) -> None:
    thread_id = await world.thread()
    await world.tamper(
        thread_id, ("DELETE FROM ztate.transitions WHERE thread_id = $1", (thread_id,))
    )
    findings, summary = await world.verify(thread_id)
    assert [(f.thread_id, f.version, f.check) for f in findings] == [(thread_id, 4, "head")]
    assert summary.exit_code == 1
    # a thread with neither head nor records: nothing was tampered with, the name is wrong
    with pytest.raises(VerifyError, match="the ledger has no thread no-such-thread"):
        await world.verify("no-such-thread")


# --- bundles ----------------------------------------------------------------------------


async def test_a_bundle_finds_exactly_what_the_database_finds(
    world: World, clean: str, tmp_path: Path
) -> None:
    from_db, db_summary = await world.verify()
    manifest = await export_bundle(world.dsn, tmp_path / "bundle")
    from_bundle: list[Finding] = []
    summary = verify_bundle(tmp_path / "bundle", world.trust, from_bundle.append)
    assert from_bundle == from_db
    assert (summary.threads, summary.records) == (db_summary.threads, db_summary.records)
    assert manifest.records == summary.records
    assert world.trust.policies.policies["pipeline"].digest in manifest.policy_digests


def _ordered(findings: list[Finding]) -> list[Finding]:
    """Workers report threads as they finish them: compare findings as a multiset."""
    return sorted(findings, key=lambda f: (f.thread_id or "", f.version or -1, f.check, f.found))


async def test_verification_on_worker_processes_finds_exactly_what_one_process_finds(
    world: World, clean: str, tmp_path: Path
) -> None:
    """Over the whole ledger, with every tampering the tests above left in it."""
    from_db, db_summary = await world.verify()
    assert from_db  # the comparison means something only with findings to compare
    parallel: list[Finding] = []
    summary = await verify_database_parallel(world.dsn, world.trust, parallel.append, jobs=2)
    assert _ordered(parallel) == _ordered(from_db)
    assert summary == db_summary
    await export_bundle(world.dsn, tmp_path / "bundle")
    from_bundle: list[Finding] = []
    bundle_summary = verify_bundle_parallel(
        tmp_path / "bundle", world.trust, from_bundle.append, jobs=3
    )
    assert _ordered(from_bundle) == _ordered(from_db)
    assert bundle_summary == db_summary
    one: list[Finding] = []
    await verify_database_parallel(world.dsn, world.trust, one.append, jobs=2, thread_id=clean)
    assert one == []


Lines = list[dict[str, Any]]


def edit_record(line: dict[str, Any], old: str, new: str) -> None:
    assert line["record"].count(old) == 1
    line["record"] = line["record"].replace(old, new)


def set_state(lines: Lines) -> None:
    lines[3]["state"] = json.dumps({"is_admin": True}, separators=(",", ":"))


def set_patch(lines: Lines) -> None:
    edit_record(lines[3], '"amount_cents":1200', '"amount_cents":9900')


def set_node_id(lines: Lines) -> None:
    lines[1]["node_id"] = "spiffe://ztate.test/node/db-writer"


def set_signature(lines: Lines) -> None:
    lines[4]["signature"] = "0" * 64


def set_receipt(lines: Lines) -> None:
    lines[APPROVED_AT]["receipt"] = lines[APPROVED_AT]["receipt"].replace("alice", "mallo")


def delete_line(lines: Lines) -> None:
    del lines[2]


def swap_lines(lines: Lines) -> None:
    lines[1], lines[3] = lines[3], lines[1]


def fork_line(lines: Lines) -> None:
    """A second record at version 3, as a copy with another patch."""
    fork = dict(lines[3])
    edit_record(fork, '"amount_cents":1200', '"amount_cents":9900')
    lines.insert(4, fork)


BUNDLE_TAMPERING: dict[str, tuple[Callable[[Lines], None], set[tuple[int | None, str]]]] = {
    "state": (set_state, {(3, "state")}),
    "patch": (set_patch, {(3, "digest"), (3, "replay")}),
    "node_id": (set_node_id, {(1, "column.node_id")}),
    "signature": (set_signature, {(4, "signature")}),
    "receipt": (set_receipt, {(APPROVED_AT, "receipt.digest"), (APPROVED_AT, "receipt.signature")}),
    "deleted": (delete_line, {(2, "version")}),
    "fork": (fork_line, {(3, "version"), (3, "digest")}),
    "swapped": (swap_lines, {(1, "version"), (2, "version")}),
}


def write_lines(folder: Path, lines: Lines, *, fix_manifest: bool) -> None:
    data = b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines)
    (folder / RECORDS).write_bytes(data)
    if fix_manifest:  # an attacker who also rewrites the packing list
        manifest = json.loads((folder / MANIFEST).read_text())
        manifest.update(records_sha256=sha256_hex(data), records=len(lines))
        (folder / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("jobs", [1, 2], ids=["one-process", "two-workers"])
@pytest.mark.parametrize("fix_manifest", [True, False], ids=["manifest-rewritten", "manifest-kept"])
@pytest.mark.parametrize("tampering", sorted(BUNDLE_TAMPERING))
async def test_tampering_in_a_bundle_is_pinpointed(
    world: World, clean: str, tmp_path: Path, tampering: str, fix_manifest: bool, jobs: int
) -> None:
    source = tmp_path / "bundle"
    await export_bundle(world.dsn, source, clean)
    lines = [json.loads(line) for line in (source / RECORDS).read_text().splitlines()]
    assert [line["version"] for line in lines] == list(range(VERSIONS))
    edit, expected = BUNDLE_TAMPERING[tampering]
    edit(lines)
    write_lines(source, lines, fix_manifest=fix_manifest)
    findings: list[Finding] = []
    if jobs == 1:
        summary = verify_bundle(source, world.trust, findings.append)
    else:
        summary = verify_bundle_parallel(source, world.trust, findings.append, jobs=jobs)
    pinpointed = {(f.version, f.check) for f in findings if f.thread_id == clean}
    assert pinpointed == expected
    bundle_level = {f.check for f in findings if f.thread_id is None}
    if fix_manifest:
        assert bundle_level == set()
    else:
        assert BUNDLE_HASH in bundle_level
    assert summary.exit_code == 1


async def test_a_bundle_whose_file_no_longer_matches_its_manifest(
    world: World, clean: str, tmp_path: Path
) -> None:
    folder = tmp_path / "bundle"
    await export_bundle(world.dsn, folder, clean)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["records_sha256"] = "0" * 64
    (folder / MANIFEST).write_text(json.dumps(manifest))
    findings: list[Finding] = []
    verify_bundle(folder, world.trust, findings.append)
    assert [(f.thread_id, f.version, f.check) for f in findings] == [(None, None, BUNDLE_HASH)]


# --- the command ------------------------------------------------------------------------


def cli_env(world: World, dsn: str | None = None) -> dict[str, str]:
    """What ``ztate`` runs with here: none of the caller's settings, the world's database
    (or ``dsn``), key files and policies, and a home of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
    env.update(
        DATABASE_URL=dsn or world.dsn,
        ZTATE_HOME=str(world.root / "cli-home"),
        ZTATE_HMAC_KEYRING_FILE=str(world.settings.hmac_keyring_file),
        ZTATE_APPROVAL_PUBLIC_KEYS_FILE=str(world.settings.approval_public_keys_file),
        ZTATE_POLICY_PATH=str(world.settings.policy_path),
    )
    return env


async def ztate(
    world: World, *args: str, dsn: str | None = None
) -> tuple[int, list[dict[str, Any]], str]:
    """Run the verifier's commands as a script would, with only key files and policies;
    returns the exit code, the JSON lines printed (with --json) and stderr."""
    env = cli_env(world, dsn)
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("ztate")),
        *args,
        env=env,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    lines = [json.loads(line) for line in out.splitlines()] if "--json" in args else []
    return process.returncode, lines, err.decode()


async def test_the_command_exits_0_clean_1_tampered_2_unable(
    own_ledger: OwnLedger, postgres_server_dsn: str, tmp_path: Path
) -> None:
    own, (thread_id, _) = await own_ledger(2)

    code, lines, _ = await ztate(own, "verify", "--json")
    assert code == 0
    assert lines == [
        {"type": "summary", "threads": 2, "records": 10, "failures": 0, "verified": True}
    ]

    await own.tamper(
        thread_id, update("node_id", "spiffe://ztate.test/node/db-writer", thread_id, 3)
    )
    code, lines, _ = await ztate(own, "verify", "--json")
    assert code == 1
    assert lines[0] == {
        "type": "finding",
        "thread_id": thread_id,
        "version": 3,
        "check": "column.node_id",
        "expected": "spiffe://ztate.test/node/planner (the record's)",
        "found": "spiffe://ztate.test/node/db-writer",
    }
    assert lines[-1]["type"] == "summary"
    assert lines[-1]["failures"] == 1
    # the reference alone, no compiled lane: the same lines
    assert await ztate(own, "verify", "--json", "--reference-only") == (code, lines, "")

    code, _, err = await ztate(own, "ledger", "export", "--out", str(tmp_path / "export"))
    assert code == 0, err
    # a thread the ledger never had: exit 3 and no bundle (an empty one verified "OK")
    nowhere = tmp_path / "nowhere"
    code, _, err = await ztate(own, "ledger", "export", "--out", str(nowhere), "--thread", "nosuch")
    assert code == 3
    assert err == "ztate ledger export: the ledger has no thread nosuch: nothing exported\n"
    assert not nowhere.exists()
    code, lines, _ = await ztate(own, "verify", "--bundle", str(tmp_path / "export"), "--json")
    assert code == 1
    assert [(line["version"], line["check"]) for line in lines[:-1]] == [(3, "column.node_id")]
    for source in ((), ("--bundle", str(tmp_path / "export"))):
        code, lines, _ = await ztate(own, "verify", *source, "--jobs", "2", "--json")
        assert code == 1
        assert [(line["version"], line["check"]) for line in lines[:-1]] == [(3, "column.node_id")]
        assert lines[-1]["records"] == 10
    code, _, err = await ztate(own, "verify", "--jobs", "-1")
    assert code == 2
    assert "--jobs: must be 0 (one per core) to 256" in err

    code, _, err = await ztate(own, "verify", "--keyring", str(tmp_path / "missing.json"))
    assert code == 2
    assert "cannot verify" in err
    code, _, err = await ztate(
        own, "verify", dsn=with_database(postgres_server_dsn, "no_such_database")
    )
    assert code == 2
    assert "cannot connect" in err


# --- reverts: what they must carry, and nothing more (issue 11, item 4) --------------------


async def revert(world: World, thread_id: str, to_version: int, key: str) -> int:
    creds = world.pki.operator()
    credentials = grpc.ssl_channel_credentials(
        creds.ca.read_bytes(), creds.key.read_bytes(), creds.cert.read_bytes()
    )
    async with grpc.aio.secure_channel(world.target, credentials) as channel:
        response = await transition_pb2_grpc.TransitionServiceStub(channel).RevertThread(
            transition_pb2.RevertThreadRequest(
                thread_id=thread_id, to_version=to_version, idempotency_key=key
            ),
            timeout=10,
        )
    version: int = response.transition.version
    return version


async def test_a_revert_undoing_an_approved_change_verifies(world: World) -> None:
    """Before: the documented revert, restoring the target_user_id an approved change
    had replaced, was reported "risk: expected an approval receipt"."""
    thread_id = await world.thread()  # version 2 changed target_user_id under a receipt
    reverted = await revert(world, thread_id, 1, f"undo-{thread_id}")
    assert reverted == VERSIONS
    findings, summary = await world.verify(thread_id)
    assert findings == []
    assert summary.exit_code == 0


async def test_a_revert_not_by_an_operator_is_reported(world: World) -> None:
    thread_id = await world.thread()
    version = await revert(world, thread_id, 1, f"undo-{thread_id}")
    row = await world.row(thread_id, version)
    record = json.loads(bytes(row["record"]))
    record["node_id"] = f"spiffe://{TRUST_DOMAIN}/node/planner"
    forged = seal_as(world, record)
    await world.tamper(
        thread_id,
        (
            "UPDATE ztate.transitions SET record = $3, digest = $4, signature = $5, node_id = $6 "
            "WHERE thread_id = $1 AND version = $2",
            (thread_id, version, forged[0], forged[1], forged[2], record["node_id"]),
        ),
        (
            "UPDATE ztate.threads SET head_digest = $2 WHERE thread_id = $1",
            (thread_id, forged[1]),
        ),
    )
    findings, _ = await world.verify(thread_id)
    assert [(f.version, f.check) for f in findings] == [(version, "role")]
    assert findings[0].expected == "an identity of role operator (a revert record)"


async def test_a_revert_to_a_state_the_thread_never_had_is_reported(world: World) -> None:
    thread_id = await world.thread()
    version = await revert(world, thread_id, 1, f"undo-{thread_id}")
    row = await world.row(thread_id, version)
    record = json.loads(bytes(row["record"]))
    invented = {"raw_text": "never there"}
    record["patch"] = {**{k: None for k in json.loads(bytes(row["state"]))}, **invented}
    record["state_digest"] = sha256_hex(canonical_bytes(invented))
    forged = seal_as(world, record)
    await world.tamper(
        thread_id,
        (
            "UPDATE ztate.transitions SET record = $3, digest = $4, signature = $5, "
            "state = $6 WHERE thread_id = $1 AND version = $2",
            (thread_id, version, forged[0], forged[1], forged[2], canonical_bytes(invented)),
        ),
        (
            "UPDATE ztate.threads SET head_digest = $2, state = $3 WHERE thread_id = $1",
            (thread_id, forged[1], canonical_bytes(invented)),
        ),
    )
    findings, _ = await world.verify(thread_id)
    assert (version, "revert") in [(f.version, f.check) for f in findings]


def seal_as(world: World, record: dict[str, Any]) -> tuple[bytes, str, str]:
    """Re-sign a record with the chain key, as an attacker holding it could."""
    data = canonical_bytes(record)
    digest = sha256_hex(data)
    return data, digest, sign_digest(world.keyring.key(record["key_id"]), digest)


async def test_configuration_mistakes_are_usage_errors_not_failures(
    world: World, clean: str, tmp_path: Path
) -> None:
    """Before: ``--thread`` naming no thread, or policies that are not the ledger's,
    printed FAIL lines and exited 1, as if the ledger were tampered with."""
    for source in ((), ("--jobs", "2")):
        code, lines, err = await ztate(
            world, "verify", "--thread", "no-such-thread", *source, "--json"
        )
        assert (code, lines) == (2, [])
        assert "the ledger has no thread no-such-thread: check --thread" in err
    code, _, err = await ztate(world, "ledger", "export", "--out", str(tmp_path / "b"))
    assert code == 0, err
    for jobs in ("1", "2"):
        code, lines, err = await ztate(
            world, "verify", "--bundle", str(tmp_path / "b"), "--thread", "no-such",
            "--jobs", jobs, "--json",
        )  # fmt: skip
        assert (code, lines) == (2, [])
        assert "the ledger has no thread no-such" in err
    other = tmp_path / "other-policies"
    other.mkdir()
    (other / "billing.yaml").write_text((REPO / "tests" / "policies" / "billing.yaml").read_text())
    for source in ((), ("--jobs", "2"), ("--bundle", str(tmp_path / "b"))):
        code, lines, err = await ztate(
            world, "verify", "--policy", str(other), *source, "--thread", clean, "--json"
        )
        assert (code, lines) == (2, [])
        assert "the policies given are not this ledger's" in err


@pytest.mark.parametrize("output", ["text", "json"])
async def test_verify_that_cannot_write_its_verdict_exits_2_never_1(
    own_ledger: OwnLedger, output: str
) -> None:
    """``ztate verify > /dev/full`` on a clean ledger exited 1 with a traceback: a script
    read "failures found". A verdict that cannot be written is no verdict: exit 2 (could
    not run), one line; the same when stdout is closed (``>&-``)."""
    own, _ = await own_ledger(1)
    args = ("verify", "--json") if output == "json" else ("verify",)
    env = cli_env(own)
    ztate_binary = str(Path(sys.executable).with_name("ztate"))
    for stdout, said in (
        ("/dev/full", "No space left on device"),
        (None, "standard output is closed"),
    ):
        if stdout is None:  # the shell closes fd 1, then runs ztate
            command = ["sh", "-c", 'exec "$0" "$@" >&-', ztate_binary, *args]
        else:
            command = ["sh", "-c", f'exec "$0" "$@" > {stdout}', ztate_binary, *args]
        process = await asyncio.create_subprocess_exec(
            *command, env=env, cwd=REPO, stderr=asyncio.subprocess.PIPE
        )
        _, err = await asyncio.wait_for(process.communicate(), 60)
        assert (process.returncode, err.decode()) == (
            2,
            f"ztate verify: cannot verify: cannot write the output: {said}\n",
        ), stdout
