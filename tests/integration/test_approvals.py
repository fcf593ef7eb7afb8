"""Approvals end to end: a separate approval-service process, a transition service,
real Postgres, real mTLS, and every attack on the receipt path.

The approval service runs as its own process (``ztate approval-serve``), with its
own certificate, database role and signing key; the transition service holds only
the public key. Waits are on real conditions (an outcome announced over
LISTEN/NOTIFY, a review that appears), never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import grpc
import pytest
import pytest_asyncio

from tests.citus.lanes import LANES, lane_database
from tests.harness import (
    INITIAL,
    TRUST_DOMAIN,
    USER,
    Ledger,
    Pki,
    act,
    as_operator_sees_it,
    client,
    new_thread_id,
    secure_channel,
)
from ztate.contract.keyring import generate_signing_key, load_public_keys, load_signing_key
from ztate.contract.receipts import SignedReceipt as Receipt
from ztate.contract.receipts import build_receipt, sign_receipt, verify_receipt
from ztate.services.cli import ca
from ztate.services.runtime.config import Settings
from ztate.services.runtime.identity import Identity, Role
from ztate.services.runtime.serving import APPROVAL_MAX_MESSAGE_BYTES
from ztate.services.store.approvals import ApprovalStore
from ztate.services.store.interface import Park
from ztate.services.store.rows import PendingTransition
from ztate.transition_service import outbox as outbox_module
from ztate.transition_service.app import RunningService, start
from ztate.v1 import (
    approval_pb2,
    approval_pb2_grpc,
    ledger_pb2,
    ledger_pb2_grpc,
    transition_pb2,
    transition_pb2_grpc,
)
from ztate.worker_sdk import AwaitingApproval, PermissionDenied, ZtateClient

REPO = Path(__file__).resolve().parents[2]
OTHER_USER = "9b2f5d0e-1c3a-4e6b-8d7f-0a1b2c3d4e5f"
LISTENING = b"approval service listening on port"
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def eventually(probe: Callable[[], Awaitable[T | None]], within: float = 20.0) -> T:
    """Re-check a real condition until it holds (bounded), and return its value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        value = await probe()
        if value is not None:
            return value
        assert loop.time() < deadline, "condition did not hold in time"
        await asyncio.sleep(0.05)


@dataclass
class World:
    """Both services, their keys, and the database they share (in separate schemas)."""

    root: Path
    dsn: str
    pki: Pki
    settings: Settings
    transition: RunningService
    approval_port: int
    approval: asyncio.subprocess.Process | None
    signing_key: Path
    public_keys: Path
    ledger: Ledger

    @property
    def target(self) -> str:
        return f"localhost:{self.settings.listen.rsplit(':', 1)[1]}"

    @property
    def approval_target(self) -> str:
        return f"localhost:{self.approval_port}"

    async def start_approval(self) -> None:
        certs = self.root / "approval-certs"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZTATE_")}
        env.update(
            DATABASE_URL=self.dsn,
            ZTATE_HOME=str(self.root / "approval-home"),
            ZTATE_TRUST_DOMAIN=TRUST_DOMAIN,
            ZTATE_APPROVAL_LISTEN=f"127.0.0.1:{self.approval_port}",
            ZTATE_APPROVAL_TLS_CERT=str(certs / "service-approval.crt"),
            ZTATE_APPROVAL_TLS_KEY=str(certs / "service-approval.key"),
            ZTATE_APPROVAL_TLS_CA=str(certs / "ca.crt"),
            ZTATE_APPROVAL_SIGNING_KEY_FILE=str(self.signing_key),
            ZTATE_APPROVAL_TRANSITION_TARGET=self.target,
            ZTATE_APPROVAL_OUTBOX_INTERVAL_SECONDS="0.2",
        )
        process = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).with_name("ztate")),
            "approval-serve",
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        assert process.stderr is not None

        async def listening() -> None:
            assert process.stderr is not None
            while LISTENING not in (line := await process.stderr.readline()):
                assert line, "the approval service exited before it listened"

        await asyncio.wait_for(listening(), 60)
        self.approval = process
        asyncio.get_running_loop().create_task(self._drain(process))

    @staticmethod
    async def _drain(process: asyncio.subprocess.Process) -> None:
        assert process.stderr is not None
        while await process.stderr.readline():
            pass

    async def stop_approval(self) -> None:
        if self.approval is not None and self.approval.returncode is None:
            self.approval.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(self.approval.wait(), 30) == 0
        self.approval = None

    async def restart_transition(self) -> None:
        await self.transition.stop(grace=1.0)
        self.transition = await start(self.settings, dsn=self.dsn)

    # --- actors ---------------------------------------------------------------------

    def worker(self, name: str) -> ZtateClient:
        return client(self.target, self.pki.node(name))

    def reviewers(self, name: str) -> grpc.aio.Channel:
        return secure_channel(self.approval_target, self.pki.identity(Role.REVIEWER, name))

    async def decide(self, reviewer: str, digest: str, approve: bool = True) -> Any:
        async with self.reviewers(reviewer) as open_channel:
            stub = approval_pb2_grpc.ApprovalServiceStub(open_channel)
            decision = approval_pb2.DECISION_APPROVE if approve else approval_pb2.DECISION_REJECT
            return await stub.Decide(approval_pb2.DecideRequest(digest=digest, decision=decision))

    async def review(self, digest: str) -> Any:
        """The review of ``digest`` once the outbox has delivered it."""

        async def probe() -> Any:
            async with self.reviewers("alice") as open_channel:
                stub = approval_pb2_grpc.ApprovalServiceStub(open_channel)
                try:
                    response = await stub.GetReview(approval_pb2.GetReviewRequest(digest=digest))
                except grpc.aio.AioRpcError as error:
                    if error.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                        return None
                    raise
                return response.review

        return await eventually(probe)

    async def apply(self, receipt: Receipt) -> Any:
        """ApplyDecision as the approval service's identity (to play the attacker)."""
        async with secure_channel(self.target, self.pki.identity(Role.SERVICE, "approval")) as ch:
            stub = transition_pb2_grpc.TransitionServiceStub(ch)
            return await stub.ApplyDecision(
                transition_pb2.ApplyDecisionRequest(
                    receipt=approval_pb2.SignedReceipt(
                        receipt_json=receipt.receipt_bytes,
                        signature=receipt.signature,
                        key_id=receipt.key_id,
                    )
                )
            )

    def receipt(self, pending: AwaitingApproval, **changes: Any) -> Receipt:
        now = datetime.now(UTC)
        fields: dict[str, Any] = {
            "transition_digest": pending.digest,
            "thread_id": pending.thread_id,
            "base_version": pending.base_version,
            "decision": "approve",
            "reviewers": ["spiffe://ztate.test/reviewer/alice"],
            "issued_at": now - timedelta(seconds=1),
            "expires_at": now + timedelta(minutes=5),
            "key_id": "approval-k1",
        }
        fields.update(changes)
        return sign_receipt(build_receipt(**fields), load_signing_key(self.signing_key))

    async def thread(self, policy: str = "pipeline", state: dict[str, Any] | None = None) -> str:
        thread_id = new_thread_id()
        async with client(self.target, self.pki.operator()) as operator:
            await operator.create_thread(thread_id, state or INITIAL, policy=policy)
        return thread_id

    async def park(self, thread_id: str, node: str = "planner", **patch: Any) -> AwaitingApproval:
        """Park a proposal; returned with the digest and rules a reviewer sees (the
        proposing node itself gets neither: see test_projection_confidentiality)."""
        async with self.worker(node) as worker:
            with pytest.raises(AwaitingApproval) as parked:
                await worker.propose(thread_id, 0, patch or {"target_user_id": OTHER_USER})
        return await as_operator_sees_it(self.dsn, parked.value)

    async def submitted_at(self, digest: str) -> datetime | None:
        """When the outbox handed ``digest`` to the approval service (None: not yet)."""
        conn = await asyncpg.connect(self.dsn)
        try:
            at: datetime | None = await conn.fetchval(
                "SELECT submitted_at FROM ztate.pending_transitions WHERE digest = $1", digest
            )
            return at
        finally:
            await conn.close()

    async def pending_status(self, digest: str) -> str:
        conn = await asyncpg.connect(self.dsn)
        try:
            status: str = await conn.fetchval(
                "SELECT status FROM ztate.pending_transitions WHERE digest = $1", digest
            )
            return status
        finally:
            await conn.close()


@pytest_asyncio.fixture(scope="module", params=LANES)
async def world(
    request: pytest.FixtureRequest,
    pki: Pki,
    keyring_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[World]:
    """Both services on a fresh database of each lane (Postgres; Citus in its lane)."""
    root = tmp_path_factory.mktemp("approvals")
    dsn = await lane_database(request.param, request)
    ca.issue(
        pki.ca_dir,
        Identity(TRUST_DOMAIN, Role.SERVICE, "approval"),
        root / "approval-certs",
        dns_names=("localhost",),
        ip_addresses=("127.0.0.1",),
    )
    policies = root / "policies"
    policies.mkdir()
    shutil.copyfile(REPO / "services" / "defaults" / "policy.yaml", policies / "pipeline.yaml")
    shutil.copyfile(REPO / "tests" / "policies" / "two_person.yaml", policies / "treasury.yaml")
    signing_key, public_keys = root / "approval" / "signing-key.pem", root / "public.json"
    generate_signing_key(signing_key, public_keys, "approval-k1")
    approval_port = free_port()
    settings = Settings(
        home=root / "home",
        listen=f"127.0.0.1:{free_port()}",
        trust_domain=TRUST_DOMAIN,
        tls_cert=pki.certs / "service-transition.crt",
        tls_key=pki.certs / "service-transition.key",
        tls_ca=pki.certs / "ca.crt",
        policy_path=policies,
        hmac_keyring_file=keyring_file,
        approval_target=f"localhost:{approval_port}",
        approval_public_keys_file=public_keys,
        outbox_interval_seconds=0.2,
        db_pool_size=4,
    )
    transition = await start(settings, dsn=dsn)
    from ztate.contract.keyring import Keyring

    world = World(
        root,
        dsn,
        pki,
        settings,
        transition,
        approval_port,
        None,
        signing_key,
        public_keys,
        Ledger(dsn, Keyring.load(keyring_file, None)),
    )
    await world.start_approval()
    yield world
    await world.stop_approval()
    await world.transition.stop(grace=1.0)


# --- the happy path ----------------------------------------------------------------------


async def test_parked_then_approved_commits_with_a_verifiable_receipt(world: World) -> None:
    thread_id = await world.thread()
    parked = await world.park(thread_id)
    assert parked.risk_rules == ("target-user-change",)
    review = await world.review(parked.digest)
    assert review.status == approval_pb2.REVIEW_STATUS_OPEN
    diff = json.loads(review.redacted_diff_json)
    assert diff["changes"]["target_user_id"] == {"old": USER, "new": OTHER_USER}
    assert review.node_id == "spiffe://ztate.test/node/planner"

    decided = await world.decide("alice", parked.digest)
    assert decided.review.status == approval_pb2.REVIEW_STATUS_APPROVED
    async with world.worker("planner") as planner:
        outcome = await planner.wait_for_outcome(parked, within=20)
        view = await planner.get_view(thread_id)
    assert outcome.status == "committed"
    assert outcome.transition is not None
    assert outcome.transition.version == 1
    record = await world.ledger.record(thread_id, 1)
    assert record["version"] == 1
    assert record["node_id"] == "spiffe://ztate.test/node/planner"
    assert record["patch"] == {"target_user_id": OTHER_USER}
    assert view.state["target_user_id"] == OTHER_USER

    [row] = [r for r in await world.ledger.rows(thread_id) if r["version"] == 1]
    stored = Receipt(bytes(row["receipt"]), row["receipt_signature"], row["receipt_key_id"])
    assert record["receipt_digest"] == hashlib.sha256(stored.receipt_bytes).hexdigest()
    assert stored.receipt_bytes == decided.review.receipt.receipt_json
    committed_at = datetime.fromisoformat(record["committed_at"].replace("Z", "+00:00"))
    receipt = verify_receipt(stored, load_public_keys(world.public_keys), now=committed_at)
    assert receipt["transition_digest"] == parked.digest
    assert receipt["reviewers"] == ["spiffe://ztate.test/reviewer/alice"]
    assert await world.ledger.verify(thread_id) == 2
    assert await world.pending_status(parked.digest) == "committed"

    # operators see the receipt through the ledger API, byte for byte
    creds = world.pki.operator()
    credentials = grpc.ssl_channel_credentials(
        creds.ca.read_bytes(), creds.key.read_bytes(), creds.cert.read_bytes()
    )
    async with grpc.aio.secure_channel(world.target, credentials) as channel:
        detail = await ledger_pb2_grpc.LedgerServiceStub(channel).GetTransitionDetail(
            ledger_pb2.GetTransitionDetailRequest(thread_id=thread_id, version=1)
        )
    assert detail.entry.has_receipt
    assert detail.receipt_json.encode() == stored.receipt_bytes
    assert (detail.receipt_signature, detail.receipt_key_id) == (
        stored.signature,
        row["receipt_key_id"],
    )


async def test_a_rejection_closes_the_transition_and_commits_nothing(world: World) -> None:
    thread_id = await world.thread()
    parked = await world.park(thread_id)
    await world.review(parked.digest)
    before = await world.ledger.snapshot(thread_id)
    await world.decide("bob", parked.digest, approve=False)
    async with world.worker("planner") as planner:
        outcome = await planner.wait_for_outcome(parked, within=20)
    assert (outcome.status, outcome.transition) == ("rejected", None)
    assert await world.ledger.snapshot(thread_id) == before


async def test_two_person_rule_needs_two_distinct_reviewers(world: World) -> None:
    thread_id = await world.thread("treasury", {"memo": "march"})
    parked = await world.park(thread_id, "treasurer", payout_cents=120_000)
    await world.review(parked.digest)
    first = await world.decide("alice", parked.digest)
    assert first.review.status == approval_pb2.REVIEW_STATUS_OPEN
    assert list(first.review.approvers) == ["spiffe://ztate.test/reviewer/alice"]
    with pytest.raises(grpc.aio.AioRpcError) as twice:
        await world.decide("alice", parked.digest)
    assert twice.value.code() == grpc.StatusCode.ALREADY_EXISTS
    async with world.worker("treasurer") as treasurer:
        waiting = await treasurer.wait_for_outcome(parked, within=0.5)
        assert waiting.status == "pending"  # one approval of two authorises nothing
        assert (await world.ledger.snapshot(thread_id)).head_version == 0
        second = await world.decide("bob", parked.digest)
        assert second.review.status == approval_pb2.REVIEW_STATUS_APPROVED
        outcome = await treasurer.wait_for_outcome(parked, within=20)
    assert outcome.status == "committed"
    receipt = json.loads(second.review.receipt.receipt_json)
    assert receipt["reviewers"] == [
        "spiffe://ztate.test/reviewer/alice",
        "spiffe://ztate.test/reviewer/bob",
    ]


# --- attacks on the receipt path ------------------------------------------------------------


async def refused_apply(world: World, receipt: Receipt, code: grpc.StatusCode, reason: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await world.apply(receipt)
    assert caught.value.code() == code
    from ztate.worker_sdk.errors import from_rpc_error

    assert from_rpc_error(caught.value).reason == reason


async def test_forged_expired_mismatched_receipts_commit_nothing(world: World) -> None:
    thread_id = await world.thread()
    parked = await world.park(thread_id)
    other_thread = await world.thread()
    other = await world.park(other_thread)
    before = (await world.ledger.snapshot(thread_id), await world.ledger.snapshot(other_thread))
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    forged = sign_receipt(
        build_receipt(
            transition_digest=parked.digest,
            thread_id=thread_id,
            base_version=0,
            decision="approve",
            reviewers=["spiffe://ztate.test/reviewer/alice"],
            issued_at=datetime.now(UTC) - timedelta(seconds=1),
            expires_at=datetime.now(UTC) + timedelta(minutes=5),
            key_id="approval-k1",
        ),
        Ed25519PrivateKey.generate(),
    )
    invalid, mismatch = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    await refused_apply(world, forged, invalid, "RECEIPT_INVALID")
    await refused_apply(
        world, world.receipt(parked, transition_digest="ab" * 32), mismatch, "RECEIPT_MISMATCH"
    )
    # a receipt for one thread's transition presented as another thread's
    await refused_apply(
        world, world.receipt(parked, thread_id=other_thread), mismatch, "RECEIPT_MISMATCH"
    )
    await refused_apply(world, world.receipt(parked, base_version=7), mismatch, "RECEIPT_MISMATCH")
    expired = world.receipt(
        parked,
        issued_at=datetime.now(UTC) - timedelta(minutes=20),
        expires_at=datetime.now(UTC) - timedelta(minutes=10),
    )
    await refused_apply(world, expired, mismatch, "RECEIPT_EXPIRED")
    after = (await world.ledger.snapshot(thread_id), await world.ledger.snapshot(other_thread))
    assert after == before
    assert await world.pending_status(parked.digest) == "pending"
    assert await world.pending_status(other.digest) == "pending"


async def test_a_replayed_nonce_fails_even_after_both_services_restart(world: World) -> None:
    thread_id = await world.thread()
    parked = await world.park(thread_id)
    receipt = world.receipt(parked)
    applied = await world.apply(receipt)
    assert applied.outcome == transition_pb2.OUTCOME_COMMITTED
    await refused_apply(world, receipt, grpc.StatusCode.ALREADY_EXISTS, "RECEIPT_REPLAYED")

    # the same nonce on a receipt for another parked transition
    second_thread = await world.thread()
    second = await world.park(second_thread)
    nonce = json.loads(receipt.receipt_bytes)["nonce"]
    await world.stop_approval()
    await world.restart_transition()
    await world.start_approval()
    before = await world.ledger.snapshot(second_thread)
    await refused_apply(
        world,
        world.receipt(second, nonce=nonce),
        grpc.StatusCode.ALREADY_EXISTS,
        "RECEIPT_REPLAYED",
    )
    await refused_apply(world, receipt, grpc.StatusCode.ALREADY_EXISTS, "RECEIPT_REPLAYED")
    assert await world.ledger.snapshot(second_thread) == before
    assert await world.ledger.verify(thread_id) == 2


async def test_an_approval_after_the_head_moved_authorises_nothing(world: World) -> None:
    thread_id = await world.thread()
    parked = await world.park(thread_id)
    async with world.worker("planner") as planner:
        moved = await planner.propose(
            thread_id, 0, {"pending_transition": {"action": "lookup", "order_id": "A-1"}}
        )
    assert moved.version == 1
    before = await world.ledger.snapshot(thread_id)
    await refused_apply(
        world, world.receipt(parked), grpc.StatusCode.FAILED_PRECONDITION, "APPROVAL_STALE"
    )
    assert await world.ledger.snapshot(thread_id) == before
    assert await world.pending_status(parked.digest) == "stale"
    async with world.worker("planner") as planner:
        assert (await planner.wait_for_outcome(parked, within=5)).status == "stale"


async def test_a_reviewer_cannot_approve_their_own_proposal(world: World) -> None:
    thread_id = await world.thread()
    parked = await world.park(thread_id)  # proposed by node "planner"
    await world.review(parked.digest)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await world.decide("planner", parked.digest)  # reviewer "planner": the same name
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    from ztate.worker_sdk.errors import from_rpc_error

    assert from_rpc_error(caught.value).reason == "SELF_APPROVAL"
    assert await world.pending_status(parked.digest) == "pending"


async def test_a_worker_cannot_use_the_approval_api(world: World) -> None:
    thread_id = await world.thread()
    parked = await world.park(thread_id)
    async with secure_channel(world.approval_target, world.pki.node("approval-gate")) as ch:
        stub = approval_pb2_grpc.ApprovalServiceStub(ch)
        for call in (
            stub.ListReviews(approval_pb2.ListReviewsRequest()),
            stub.Decide(
                approval_pb2.DecideRequest(
                    digest=parked.digest, decision=approval_pb2.DECISION_APPROVE
                )
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # nor may a worker deliver decisions to the transition service
    async with secure_channel(world.target, world.pki.node("approval-gate")) as ch:
        stub2 = transition_pb2_grpc.TransitionServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub2.ApplyDecision(transition_pb2.ApplyDecisionRequest())
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert await world.pending_status(parked.digest) == "pending"


async def test_a_reviewer_cannot_write_state(world: World) -> None:
    thread_id = await world.thread()
    before = await world.ledger.snapshot(thread_id)
    async with client(world.target, world.pki.identity(Role.REVIEWER, "alice")) as reviewer:
        with pytest.raises(PermissionDenied) as caught:
            await reviewer.propose(thread_id, 0, {"target_user_id": OTHER_USER})
    assert caught.value.reason == "ROLE_FORBIDDEN"
    assert await world.ledger.snapshot(thread_id) == before


# --- failures: nothing is lost ----------------------------------------------------------------


async def test_parked_while_the_approval_service_is_down_is_reviewed_once_back(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ztate.transition")
    await world.stop_approval()
    try:
        thread_id = await world.thread()
        parked = await world.park(thread_id)
        assert await world.pending_status(parked.digest) == "pending"

        async def refused_submission() -> bool | None:
            failed = f"submitting {parked.digest[:16]} to the approval service failed"
            return any(failed in r.getMessage() for r in caplog.records) or None

        await eventually(refused_submission)  # the outbox tried, and keeps it for later
        assert await world.submitted_at(parked.digest) is None
        # the parked transition survives a restart of the transition service too
        await world.restart_transition()
        async with world.worker("planner") as planner:
            assert (await planner.wait_for_outcome(parked, within=0.5)).status == "pending"
        assert await world.submitted_at(parked.digest) is None
    finally:
        await world.start_approval()
    review = await world.review(parked.digest)
    assert review.thread_id == thread_id
    # the outbox marks the row once the approval service has answered, which can be
    # just after the review became visible to a reviewer
    assert await eventually(lambda: world.submitted_at(parked.digest)) is not None
    before = await world.ledger.snapshot(thread_id)
    assert before.head_version == 0
    await world.decide("alice", parked.digest)
    async with world.worker("planner") as planner:
        outcome = await planner.wait_for_outcome(parked, within=20)
    assert outcome.status == "committed"
    assert outcome.transition is not None
    record = await world.ledger.record(thread_id, outcome.transition.version)
    assert record["patch"] == {"target_user_id": OTHER_USER}
    assert await world.pending_status(parked.digest) == "committed"
    assert await world.ledger.verify(thread_id) == 2


async def test_a_review_the_approval_service_refuses_holds_back_no_other(
    world: World, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outbox submits parked transitions oldest first. One the approval service
    refuses (here a proposal that is not a JSON object, INVALID_ARGUMENT: a parked row
    no pipeline writes, but one the approval service cannot review), and one whose base
    record is not in the ledger, are set aside: they stay parked and unsubmitted, and
    the transitions parked after them are reviewed; each is tried again after
    SET_ASIDE_SECONDS (a refusal may be a version skew that passes). Before, each round
    stopped at the first and backed off: no later review was ever submitted."""
    monkeypatch.setattr(outbox_module, "SET_ASIDE_SECONDS", 0.5)
    caplog.set_level(logging.WARNING, logger="ztate.transition")
    thread_id = await world.thread()
    head = await world.transition.store.read_head(thread_id)
    assert head is not None

    def unreviewable(key: str, proposal: bytes, base_version: int) -> PendingTransition:
        return PendingTransition(
            digest=hashlib.sha256(f"{thread_id}/{key}".encode()).hexdigest(),
            thread_id=thread_id,
            base_version=base_version,
            parent_digest=head.digest,
            node_id=f"spiffe://{TRUST_DOMAIN}/node/planner",
            proposal=proposal,
            risk_rules=["target-user-change"],
            idempotency_key=key,
            request_digest="0" * 64,
            status="pending",
            parked_at=datetime.now(UTC) - timedelta(minutes=1),  # first in line
            sensitive_keys=[],
            required_approvals=1,
        )

    refused = unreviewable("refused", b'["not", "an object"]', 0)
    baseless = unreviewable("baseless", b'{"target_user_id": "x"}', 7)  # no version 7
    for row in (refused, baseless):
        assert (await world.transition.store.park(row, b"{}")).outcome is Park.PARKED

    def said_twice(row: PendingTransition, why: str) -> Callable[[], Awaitable[bool | None]]:
        line = (
            f"parked transition {row.digest[:16]} cannot be reviewed ({why}): set aside, "
            "tried again in 0.5s"
        )

        async def probe() -> bool | None:
            return [r.getMessage() for r in caplog.records].count(line) >= 2 or None

        return probe

    try:
        parked = await world.park(await world.thread())  # parked after them
        review = await world.review(parked.digest)
        assert review.digest == parked.digest
        # set aside, then tried again (and set aside again) once their time is up
        await eventually(said_twice(refused, "the approval service refused it: INVALID_ARGUMENT"))
        await eventually(said_twice(baseless, "its base record is gone"))
        for row in (refused, baseless):
            assert await world.submitted_at(row.digest) is None
            assert await world.pending_status(row.digest) == "pending"
    finally:
        await ApprovalStore(world.transition.store.pool).close_without_decision(
            [refused, baseless], "expired", datetime.now(UTC)
        )


async def test_a_submission_over_the_approval_services_limit_holds_back_no_other(
    world: World, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parked transition whose submission (its proposal, base record and base state)
    is over the approval service's request limit, which a large ZTATE_MAX_STATE_BYTES
    allows, is set aside as a refused one is: it stays parked and unsubmitted, and the
    transitions parked after it are reviewed. Before, the approval service's
    RESOURCE_EXHAUSTED stopped every round at it: no later review was submitted until
    it expired."""
    monkeypatch.setattr(outbox_module, "SET_ASIDE_SECONDS", 0.5)
    caplog.set_level(logging.WARNING, logger="ztate.transition")
    thread_id = await world.thread()
    head = await world.transition.store.read_head(thread_id)
    assert head is not None
    huge = b'{"target_user_id": "' + b"u" * (APPROVAL_MAX_MESSAGE_BYTES + 1) + b'"}'
    large = PendingTransition(
        digest=hashlib.sha256(huge).hexdigest(),
        thread_id=thread_id,
        base_version=0,
        parent_digest=head.digest,
        node_id=f"spiffe://{TRUST_DOMAIN}/node/planner",
        proposal=huge,
        risk_rules=["target-user-change"],
        idempotency_key="too-large",
        request_digest="0" * 64,
        status="pending",
        parked_at=datetime.now(UTC) - timedelta(minutes=1),  # first in line
        sensitive_keys=[],
        required_approvals=1,
    )
    assert (await world.transition.store.park(large, b"{}")).outcome is Park.PARKED
    prefix = f"parked transition {large.digest[:16]} cannot be reviewed (its submission is "

    async def set_aside() -> bool | None:
        return any(r.getMessage().startswith(prefix) for r in caplog.records) or None

    try:
        parked = await world.park(await world.thread())  # parked after it
        review = await world.review(parked.digest)
        assert review.digest == parked.digest
        await eventually(set_aside)
        assert await world.submitted_at(large.digest) is None
        assert await world.pending_status(large.digest) == "pending"
    finally:
        await ApprovalStore(world.transition.store.pool).close_without_decision(
            [large], "expired", datetime.now(UTC)
        )


async def test_a_backlog_of_refused_reviews_larger_than_the_set_aside_holds_back_none(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process sets aside at most MAX_SET_ASIDE refused transitions; past that the
    oldest is tried again. With more refused ones parked first than it holds, each round
    read the oldest page not set aside, which (evicting as it went) was always among
    them: a review parked after them was never submitted, until the refused ones
    expired. Rounds now page through the waiting transitions, each full page's round
    ending where the next starts, so the one parked after them is reached. (Here a page
    of two and a set-aside of two, five refused transitions first.)"""
    monkeypatch.setattr(outbox_module, "BATCH", 2)
    monkeypatch.setattr(outbox_module, "MAX_SET_ASIDE", 2)
    thread_id = await world.thread()
    head = await world.transition.store.read_head(thread_id)
    assert head is not None
    refused = [
        PendingTransition(
            digest=hashlib.sha256(f"{thread_id}/refused-{n}".encode()).hexdigest(),
            thread_id=thread_id,
            base_version=0,
            parent_digest=head.digest,
            node_id=f"spiffe://{TRUST_DOMAIN}/node/planner",
            proposal=b'["not", "an object"]',  # INVALID_ARGUMENT: the review is refused
            risk_rules=["target-user-change"],
            idempotency_key=f"refused-{n}",
            request_digest="0" * 64,
            status="pending",
            parked_at=datetime.now(UTC) - timedelta(minutes=10 - n),  # first in line
            sensitive_keys=[],
            required_approvals=1,
        )
        for n in range(5)
    ]
    for row in refused:
        assert (await world.transition.store.park(row, b"{}")).outcome is Park.PARKED
    try:
        parked = await world.park(await world.thread())  # parked after them

        review = await world.review(parked.digest)

        assert review.digest == parked.digest
        for row in refused:
            assert await world.submitted_at(row.digest) is None
            assert await world.pending_status(row.digest) == "pending"
    finally:
        await ApprovalStore(world.transition.store.pool).close_without_decision(
            refused, "expired", datetime.now(UTC)
        )


async def test_restarting_the_transition_service_between_parking_and_approval(
    world: World,
) -> None:
    thread_id = await world.thread()
    parked = await world.park(thread_id)
    await world.review(parked.digest)
    await world.restart_transition()
    await world.decide("alice", parked.digest)
    async with world.worker("planner") as planner:
        outcome = await planner.wait_for_outcome(parked, within=20)
    assert outcome.status == "committed"
    assert await world.ledger.verify(thread_id) == 2


# --- what a decision did, told to everyone (issue 11, items 2 and 7) -----------------------


async def reviewed_outcome(world: World, digest: str) -> str:
    """The review's outcome once the decision was delivered to the transition service."""

    async def probe() -> str | None:
        async with world.reviewers("alice") as open_channel:
            stub = approval_pb2_grpc.ApprovalServiceStub(open_channel)
            got = await stub.GetReview(approval_pb2.GetReviewRequest(digest=digest))
        outcome: str = got.review.outcome
        return outcome or None

    return await eventually(probe)


async def test_a_parked_change_does_not_survive_a_policy_tightening(world: World) -> None:
    """Before: after the policy stopped letting the planner write target_user_id, its
    parked proposal was approved and committed, while a fresh one was refused."""
    thread_id = await world.thread()
    parked = await world.park(thread_id)
    await world.review(parked.digest)
    pipeline = world.settings.policy_path / "pipeline.yaml"
    loose = pipeline.read_text()
    tight = loose.replace(
        "write: [pending_transition, target_user_id]", "write: [pending_transition]"
    )
    assert tight != loose
    pipeline.write_text(tight)
    try:
        await world.restart_transition()
        rejections_before = [r["reason"] for r in await world.ledger.rejections(thread_id)]
        await world.decide("alice", parked.digest)
        async with world.worker("planner") as planner:
            outcome = await planner.wait_for_outcome(parked, within=20)
            fresh = planner.propose(thread_id, 0, {"target_user_id": OTHER_USER})
            with pytest.raises(PermissionDenied) as refused:
                await fresh
        # the proposer, the reviewer and the ledger all see it, with the same reason
        assert (outcome.status, outcome.reason) == ("refused", "KEY_NOT_WRITABLE")
        assert refused.value.reason == "KEY_NOT_WRITABLE"
        assert await reviewed_outcome(world, parked.digest) == "refused: KEY_NOT_WRITABLE"
        after = await world.ledger.rejections(thread_id)
        assert [r["reason"] for r in after] == [
            *rejections_before,
            "KEY_NOT_WRITABLE",  # the approved proposal, at commit
            "KEY_NOT_WRITABLE",  # the fresh one
        ]
        assert after[len(rejections_before)]["method"] == "ApplyDecision"
        assert (await world.ledger.snapshot(thread_id)).head_version == 0  # nothing committed
        assert await world.pending_status(parked.digest) == "refused"
    finally:
        pipeline.write_text(loose)
        await world.restart_transition()


async def test_a_reviewer_approving_a_stale_transition_is_told_so(world: World) -> None:
    """Before: "review approved", though nothing could commit."""
    thread_id = await world.thread()
    parked = await world.park(thread_id)
    await world.review(parked.digest)
    async with world.worker("input-parser") as parser:
        await parser.propose(thread_id, 0, {"requested_action": act("moved-on")})
    code, said = await approve_with_the_cli(world, parked.digest)
    assert code == 1  # decided, but it did not take effect
    assert "stale: the thread moved on before the decision arrived" in said
    assert await reviewed_outcome(world, parked.digest) == "stale"


async def approve_with_the_cli(world: World, digest: str) -> tuple[int, str]:
    """``ztate approvals approve`` as alice would run it: exit code and what it printed."""
    creds = world.pki.identity(Role.REVIEWER, "alice")
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("ztate")),
        *("approvals", "approve", digest, "--target", world.approval_target),
        *("--cert", str(creds.cert), "--key", str(creds.key), "--ca", str(creds.ca)),
        *("--wait", "20"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, (out + err).decode()


# --- races inside the approved commit (ztate.commit_approved) -------------------------------
#
# Each race is ordered by a row lock that a second connection holds: the parked row, which
# commit_approved locks first. A call blocked on it has made its look-up already (the receipt's
# nonce unused, the row pending); what the other call commits meanwhile decides its answer.

PARKED_ROW = (
    "SELECT 1 FROM ztate.pending_transitions WHERE thread_id = $1 AND digest = $2 FOR UPDATE"
)


async def committing(dsn: str, calls: int, *tasks: asyncio.Task[Any]) -> None:
    """Until ``calls`` ApplyDecision calls are inside ztate.commit_approved (their look-ups
    done, the parked row's lock in the way), with a deadline."""
    watcher = await asyncpg.connect(dsn)
    try:

        async def inside() -> bool | None:
            for task in tasks:
                assert not task.done(), task  # none may get past the held row
            # pg_stat_activity is read once per transaction: the watcher is not in one
            count = await watcher.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                "AND state = 'active' AND query LIKE '%ztate.commit_approved(%'"
            )
            return True if count >= calls else None

        await eventually(inside)
    finally:
        await watcher.close()


async def receipt_rows(dsn: str, nonce: str) -> list[str]:
    """The transition digests the receipts with ``nonce`` were applied to."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT transition_digest FROM ztate.receipts WHERE nonce = $1", nonce
        )
    finally:
        await conn.close()
    return [r["transition_digest"] for r in rows]


async def test_two_receipts_racing_with_one_nonce_commit_once(world: World) -> None:
    """Two receipts with the same nonce, for two parked transitions, both pass the look-up
    (the nonce unused); the one that commits second is refused RECEIPT_REPLAYED by the
    nonce's uniqueness, and writes nothing: its parked row stays pending."""
    first_thread, second_thread = await world.thread(), await world.thread()
    first, second = await world.park(first_thread), await world.park(second_thread)
    winner = world.receipt(second)
    nonce = json.loads(winner.receipt_bytes)["nonce"]
    loser = world.receipt(first, nonce=nonce)
    before = await world.ledger.snapshot(first_thread)
    holder = await asyncpg.connect(world.dsn)
    try:
        held = holder.transaction()
        await held.start()
        await holder.execute(PARKED_ROW, first_thread, first.digest)
        blocked = asyncio.create_task(world.apply(loser))
        await committing(world.dsn, 1, blocked)
        applied = await world.apply(winner)  # commits under the nonce meanwhile
        assert applied.outcome == transition_pb2.OUTCOME_COMMITTED
        await held.rollback()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await asyncio.wait_for(blocked, 30)
    finally:
        await holder.close()
    from ztate.worker_sdk.errors import from_rpc_error

    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert from_rpc_error(caught.value).reason == "RECEIPT_REPLAYED"
    assert await world.ledger.snapshot(first_thread) == before  # head, ledger: untouched
    assert await world.pending_status(first.digest) == "pending"  # still to decide
    assert await receipt_rows(world.dsn, nonce) == [second.digest]  # one receipt row
    assert await world.ledger.verify(second_thread) == 2  # one commit: genesis and v1


async def test_one_receipt_applied_twice_at_once_commits_once(world: World) -> None:
    """The same receipt delivered twice at once (a retried delivery): both pass the look-up;
    the second to lock the parked row finds it committed by the first, under this very
    receipt. It is told RECEIPT_REPLAYED, as a replay after the commit is, and writes
    nothing. Before: REVIEW_CLOSED ("the transition was committed meanwhile")."""
    thread_id = await world.thread()
    parked = await world.park(thread_id)
    receipt = world.receipt(parked)
    nonce = json.loads(receipt.receipt_bytes)["nonce"]
    holder = await asyncpg.connect(world.dsn)
    try:
        held = holder.transaction()
        await held.start()
        await holder.execute(PARKED_ROW, thread_id, parked.digest)
        earlier = asyncio.create_task(world.apply(receipt))
        await committing(world.dsn, 1, earlier)
        later = asyncio.create_task(world.apply(receipt))
        await committing(world.dsn, 2, earlier, later)
        await held.rollback()
        answers = await asyncio.wait_for(asyncio.gather(earlier, later, return_exceptions=True), 30)
    finally:
        await holder.close()
    from ztate.worker_sdk.errors import from_rpc_error

    committed = [a for a in answers if not isinstance(a, BaseException)]
    refused = [a for a in answers if isinstance(a, grpc.aio.AioRpcError)]
    assert [c.outcome for c in committed] == [transition_pb2.OUTCOME_COMMITTED], answers
    assert [(r.code(), from_rpc_error(r).reason) for r in refused] == [
        (grpc.StatusCode.ALREADY_EXISTS, "RECEIPT_REPLAYED")
    ]
    assert await receipt_rows(world.dsn, nonce) == [parked.digest]  # one receipt row
    assert await world.ledger.verify(thread_id) == 2  # one commit: genesis and v1
    assert await world.pending_status(parked.digest) == "committed"


async def test_an_approval_whose_idempotency_key_was_taken_meanwhile_commits_nothing(
    world: World,
) -> None:
    """KEY_TAKEN inside ztate.commit_approved: while the approval waits on the parked row,
    a record of the same node with the proposal's idempotency key is committed on the
    thread. No request can do that through the API (a key parked refuses the commit of
    another request under it, and parking checks the committed keys), so the taking
    record is written by SQL here, as a replica of another version or a repair might.
    The approval must not commit a second record under the key: the caller is told
    APPROVAL_STALE, the parked row is closed as stale, no receipt is recorded, the head
    stays, and the key names the one record."""
    thread_id = await world.thread()
    parked = await world.park(thread_id)
    receipt = world.receipt(parked)
    nonce = json.loads(receipt.receipt_bytes)["nonce"]
    before = await world.ledger.snapshot(thread_id)
    holder, writer = await asyncpg.connect(world.dsn), await asyncpg.connect(world.dsn)
    try:
        row = await writer.fetchrow(
            "SELECT node_id, idempotency_key FROM ztate.pending_transitions WHERE digest = $1",
            parked.digest,
        )
        held = holder.transaction()
        await held.start()
        await holder.execute(PARKED_ROW, thread_id, parked.digest)
        blocked = asyncio.create_task(world.apply(receipt))
        await committing(world.dsn, 1, blocked)
        # the taking record: a copy of the genesis at a version far ahead, under the key
        await writer.execute(
            "INSERT INTO ztate.transitions (thread_id, version, digest, parent_digest, node_id, "
            "key_id, signature, record, state, idempotency_key, request_digest, committed_at) "
            "SELECT thread_id, 99, $2, $3, $4, key_id, signature, record, state, $5, "
            "request_digest, committed_at FROM ztate.transitions "
            "WHERE thread_id = $1 AND version = 0",
            thread_id,
            "ee" * 32,
            "ff" * 32,
            row["node_id"],
            row["idempotency_key"],
        )
        await held.rollback()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await asyncio.wait_for(blocked, 30)
        keyed = await writer.fetch(
            "SELECT version FROM ztate.transitions "
            "WHERE thread_id = $1 AND node_id = $2 AND idempotency_key = $3",
            thread_id,
            row["node_id"],
            row["idempotency_key"],
        )
    finally:
        await holder.close()
        await writer.close()
    from ztate.worker_sdk.errors import from_rpc_error

    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert from_rpc_error(caught.value).reason == "APPROVAL_STALE"
    assert [r["version"] for r in keyed] == [99]  # the key names the one record
    after = await world.ledger.snapshot(thread_id)
    assert (after.head_version, after.head_digest) == (before.head_version, before.head_digest)
    assert await world.pending_status(parked.digest) == "stale"
    assert await receipt_rows(world.dsn, nonce) == []
