"""Shared test machinery: a real Postgres, a real PKI and a real mTLS service.

Nothing here is mocked. Postgres is the embedded server ztate itself uses (or
``ZTATE_TEST_DATABASE_URL`` when set); certificates come from ztate's own CA code;
the service listens on a loopback port with mutual TLS.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import grpc

from ztate.contract.keyring import Keyring, load_signing_key
from ztate.contract.receipts import build_receipt, sign_receipt
from ztate.contract.record import GENESIS_PARENT, verify_record
from ztate.services.cli import ca
from ztate.services.runtime.identity import Identity, Role
from ztate.v1 import approval_pb2, transition_pb2, transition_pb2_grpc
from ztate.worker_sdk import AwaitingApproval, ZtateClient

TRUST_DOMAIN = "ztate.test"
NODES = ("input-parser", "planner", "approval-gate", "db-writer")
USER = "123e4567-e89b-42d3-a456-426614174000"
# A valid initial state of the default pipeline policy (services/defaults/policy.yaml).
INITIAL = {
    "raw_text": "please refund order A-42",
    "authority": {"tenant": "acme"},
    "target_user_id": USER,
}


def act(tag: str, action: str = "refund") -> dict[str, str]:
    """A requested_action the input parser may write, distinguishable by ``tag``."""
    return {"action": action, "order_id": re.sub(r"[^A-Z0-9-]", "-", tag.upper())[:32]}


def with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, parts.fragment))


@dataclass(frozen=True)
class Credentials:
    cert: Path
    key: Path
    ca: Path


class Pki:
    """A CA for the test trust domain, plus certificates no honest service accepts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca_dir = root / "ca"
        self.certs = root / "certs"
        ca.init_ca(self.ca_dir, TRUST_DOMAIN)
        self.foreign_ca_dir = root / "foreign-ca"
        ca.init_ca(self.foreign_ca_dir, TRUST_DOMAIN)
        ca.issue(
            self.ca_dir,
            Identity(TRUST_DOMAIN, Role.SERVICE, "transition"),
            self.certs,
            dns_names=("localhost",),
            ip_addresses=("127.0.0.1",),
        )

    def identity(self, role: Role, name: str) -> Credentials:
        cert = self.certs / f"{role}-{name}.crt"
        if not cert.exists():
            ca.issue(self.ca_dir, Identity(TRUST_DOMAIN, role, name), self.certs)
        return Credentials(cert, self.certs / f"{role}-{name}.key", self.certs / ca.CA_CERT)

    def node(self, name: str) -> Credentials:
        return self.identity(Role.NODE, name)

    def operator(self, name: str = "admin") -> Credentials:
        return self.identity(Role.OPERATOR, name)

    def foreign(self, name: str) -> Credentials:
        """Signed by another CA that claims the same trust domain."""
        out = self.root / "foreign"
        paths = ca.issue(self.foreign_ca_dir, Identity(TRUST_DOMAIN, Role.NODE, name), out)
        return Credentials(paths.cert, paths.key, self.certs / ca.CA_CERT)

    def expired(self, name: str) -> Credentials:
        out = self.root / "expired"
        now = datetime.now(UTC)
        paths = ca.issue(
            self.ca_dir,
            Identity(TRUST_DOMAIN, Role.NODE, name),
            out,
            not_before=now - timedelta(days=30),
            not_after=now - timedelta(days=1),
        )
        return Credentials(paths.cert, paths.key, self.certs / ca.CA_CERT)

    def with_uris(self, stem: str, *uris: str) -> Credentials:
        """Signed by our CA, with arbitrary URI SANs (or none)."""
        out = self.root / "odd"
        paths = ca.issue_for_uris(self.ca_dir, uris, out, stem=stem, common_name=stem)
        return Credentials(paths.cert, paths.key, self.certs / ca.CA_CERT)


def secure_channel(target: str, creds: Credentials) -> grpc.aio.Channel:
    """A raw gRPC channel with ``creds``: for calls the SDK does not make, or makes
    differently (undecodable bytes, default client options)."""
    return grpc.aio.secure_channel(
        target,
        grpc.ssl_channel_credentials(
            creds.ca.read_bytes(), creds.key.read_bytes(), creds.cert.read_bytes()
        ),
    )


async def fresh_database(server_dsn: str) -> str:
    """A new, empty database on the test session's Postgres server."""
    name = f"ztate_t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return with_database(server_dsn, name)


def client(target: str, creds: Credentials, *, timeout: float = 10.0) -> ZtateClient:
    return ZtateClient.from_files(
        target, cert=creds.cert, key=creds.key, ca=creds.ca, timeout=timeout
    )


def new_thread_id() -> str:
    return f"t-{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True)
class LedgerSnapshot:
    """Everything a refused call must leave untouched."""

    head_version: int | None
    head_digest: str | None
    transitions: int


class Ledger:
    """Direct, superuser access to the tables, for assertions only."""

    def __init__(self, dsn: str, keyring: Keyring) -> None:
        self.dsn = dsn
        self.keyring = keyring

    async def snapshot(self, thread_id: str) -> LedgerSnapshot:
        conn = await asyncpg.connect(self.dsn)
        try:
            head = await conn.fetchrow(
                "SELECT version, head_digest FROM ztate.threads WHERE thread_id = $1", thread_id
            )
            count = await conn.fetchval(
                "SELECT count(*) FROM ztate.transitions WHERE thread_id = $1", thread_id
            )
        finally:
            await conn.close()
        return LedgerSnapshot(
            head["version"] if head else None, head["head_digest"] if head else None, count
        )

    async def rejections(self, thread_id: str) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.dsn)
        try:
            return await conn.fetch(
                "SELECT * FROM ztate.rejections WHERE thread_id = $1 ORDER BY id", thread_id
            )
        finally:
            await conn.close()

    async def rejection_count(self) -> int:
        conn = await asyncpg.connect(self.dsn)
        try:
            count: int = await conn.fetchval("SELECT count(*) FROM ztate.rejections")
            return count
        finally:
            await conn.close()

    async def rows(self, thread_id: str) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.dsn)
        try:
            return await conn.fetch(
                "SELECT * FROM ztate.transitions WHERE thread_id = $1 ORDER BY version", thread_id
            )
        finally:
            await conn.close()

    async def record(self, thread_id: str, version: int) -> dict[str, Any]:
        """The ledger record at ``version``, as an operator reads it (nodes not marked
        ``read_records`` are told versions only)."""
        conn = await asyncpg.connect(self.dsn)
        try:
            body = await conn.fetchval(
                "SELECT record FROM ztate.transitions WHERE thread_id = $1 AND version = $2",
                thread_id,
                version,
            )
        finally:
            await conn.close()
        assert body is not None, f"no record {thread_id}@{version}"
        parsed: dict[str, Any] = json.loads(bytes(body))
        return parsed

    async def verify(self, thread_id: str) -> int:
        """Verify the thread's whole chain from genesis; returns its length."""
        rows = await self.rows(thread_id)
        parent = GENESIS_PARENT
        for expected, row in enumerate(rows):
            record = verify_record(
                bytes(row["record"]),
                digest=row["digest"],
                signature=row["signature"],
                keyring=self.keyring,
                expected_parent=parent,
                expected_version=expected,
            )
            assert (record["thread_id"], record["key_id"]) == (thread_id, row["key_id"])
            parent = row["digest"]
        return len(rows)


async def as_operator_sees_it(dsn: str, parked: AwaitingApproval) -> AwaitingApproval:
    """A parked proposal with the digest and risk rules an operator or reviewer sees.

    A node not marked ``read_records`` gets neither (docs/api.md, "What a node
    receives"); tests that go on to review or decide the proposal read them from the
    database, as the approval service would receive them.
    """
    thread_id, key = parked.handle.split("/", 1)
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT digest, risk_rules FROM ztate.pending_transitions "
            "WHERE thread_id = $1 AND idempotency_key = $2",
            thread_id,
            key,
        )
    finally:
        await conn.close()
    assert row is not None, f"no parked proposal {parked.handle!r}"
    return AwaitingApproval(
        row["digest"], thread_id, parked.base_version, tuple(row["risk_rules"]), parked.handle
    )


async def deliver_approval(
    target: str, pki: Pki, signing_key: Path, digest: str, thread_id: str, base_version: int
) -> transition_pb2.ApplyDecisionResponse:
    """ApplyDecision as the approval service would call it, with a genuine receipt signed
    by ``signing_key`` (key id ``approval-k1``) approving ``digest``."""
    now = datetime.now(UTC)
    receipt = sign_receipt(
        build_receipt(
            transition_digest=digest,
            thread_id=thread_id,
            base_version=base_version,
            decision="approve",
            reviewers=[f"spiffe://{TRUST_DOMAIN}/reviewer/alice"],
            issued_at=now - timedelta(seconds=1),
            expires_at=now + timedelta(minutes=5),
            key_id="approval-k1",
        ),
        load_signing_key(signing_key),
    )
    async with secure_channel(target, pki.identity(Role.SERVICE, "approval")) as opened:
        applied: transition_pb2.ApplyDecisionResponse = await (
            transition_pb2_grpc.TransitionServiceStub(opened).ApplyDecision(
                transition_pb2.ApplyDecisionRequest(
                    receipt=approval_pb2.SignedReceipt(
                        receipt_json=receipt.receipt_bytes,
                        signature=receipt.signature,
                        key_id=receipt.key_id,
                    )
                )
            )
        )
    return applied
