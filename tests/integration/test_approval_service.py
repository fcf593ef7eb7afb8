"""The approval service over real gRPC and mutual TLS, on a real Postgres.

Only the transition service opens reviews, and only for proposal bytes that hash
to the digest; reviewers and operators read them, with the redacted diff; only
reviewers decide, never on their own proposal and never twice; a review closes
at its first rejection or its k-th distinct approval, and only then is a receipt
signed, which verifies with the approval service's public key. Its database role
and the transition service's cannot touch each other's tables.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import re
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
import pytest_asyncio
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from tests.harness import TRUST_DOMAIN, Credentials, Pki, new_thread_id
from tests.integration.test_http_probes import get
from ztate.approval_service.app import SERVICE_NAME, RunningApproval, start
from ztate.approval_service.cli import register as add_approval_commands
from ztate.approval_service.delivery import refusal_reason
from ztate.contract.canonical import canonical_bytes, sha256_hex
from ztate.contract.keyring import generate_signing_key, load_public_keys
from ztate.contract.receipts import SignedReceipt, verify_receipt
from ztate.services.cli import ca
from ztate.services.cli.main import dispatch
from ztate.services.cli.main import main as ztate
from ztate.services.runtime.config import ApprovalSettings
from ztate.services.runtime.identity import Identity, Role
from ztate.services.runtime.telemetry import Metrics, Telemetry
from ztate.transition_service.app import RunningService
from ztate.v1 import approval_pb2, approval_pb2_grpc

KEY_ID = "approval-test-k1"
REVIEW_TTL = timedelta(hours=2)
RECEIPT_TTL = timedelta(minutes=10)
PROPOSER = "input-parser"
PROPOSER_ID = f"spiffe://{TRUST_DOMAIN}/node/{PROPOSER}"
APPROVAL_ROLE = "ztate_approver"
TRANSITION_ROLE = "ztate_transition"
# Nothing listens here: receipts stay in the outbox (delivery is the e2e tests' part).
NO_TRANSITION_SERVICE = "127.0.0.1:9"


@dataclass(frozen=True)
class ApprovalKeys:
    private: Path
    public: Path


@pytest.fixture(scope="module")
def approval_keys(tmp_path_factory: pytest.TempPathFactory) -> ApprovalKeys:
    folder = tmp_path_factory.mktemp("approval-keys")
    keys = ApprovalKeys(folder / "signing-key.pem", folder / "approval-public.json")
    generate_signing_key(keys.private, keys.public, KEY_ID)
    return keys


@pytest.fixture(scope="module")
def approval_settings(
    pki: Pki, approval_keys: ApprovalKeys, tmp_path_factory: pytest.TempPathFactory
) -> ApprovalSettings:
    home = tmp_path_factory.mktemp("approval-home")
    certs = home / "certs"
    issued = ca.issue(
        pki.ca_dir,
        Identity(TRUST_DOMAIN, Role.SERVICE, "approval"),
        certs,
        dns_names=("localhost",),
        ip_addresses=("127.0.0.1",),
    )
    # The settings shared with the transition service are named by their variable.
    return ApprovalSettings(
        ZTATE_HOME=home,
        ZTATE_TRUST_DOMAIN=TRUST_DOMAIN,
        listen="127.0.0.1:0",
        tls_cert=issued.cert,
        tls_key=issued.key,
        tls_ca=issued.ca_cert,
        signing_key_file=approval_keys.private,
        key_id=KEY_ID,
        transition_target=NO_TRANSITION_SERVICE,
        transition_server_name="localhost",
        review_ttl_seconds=int(REVIEW_TTL.total_seconds()),
        receipt_ttl_seconds=int(RECEIPT_TTL.total_seconds()),
        outbox_interval_seconds=60.0,
        db_pool_size=4,
    )


@pytest_asyncio.fixture(scope="module")
async def approval(
    approval_settings: ApprovalSettings, database_dsn: str, service: RunningService
) -> AsyncIterator[RunningApproval]:
    """The approval service, in the database where the transition service migrated too."""
    running = await start(approval_settings, dsn=database_dsn)
    yield running
    await running.stop(grace=1.0)


@pytest.fixture(scope="module")
def approval_target(approval: RunningApproval) -> str:
    return f"localhost:{approval.port}"


@contextlib.asynccontextmanager
async def stub_as(
    target: str, creds: Credentials
) -> AsyncIterator[approval_pb2_grpc.ApprovalServiceStub]:
    credentials = grpc.ssl_channel_credentials(
        creds.ca.read_bytes(), creds.key.read_bytes(), creds.cert.read_bytes()
    )
    async with grpc.aio.secure_channel(target, credentials) as channel:
        yield approval_pb2_grpc.ApprovalServiceStub(channel)


BASE_STATE = {"is_admin": False, "owner": "acme"}


@dataclass(frozen=True)
class Parked:
    """A proposal as the transition service would submit it for review."""

    request: approval_pb2.SubmitReviewRequest

    @property
    def digest(self) -> str:
        return self.request.digest


def parked(
    *,
    thread_id: str | None = None,
    base_version: int = 3,
    node: str = PROPOSER,
    approvals: int = 1,
    rules: tuple[str, ...] = ("privilege-change",),
) -> Parked:
    thread = thread_id or new_thread_id()
    node_id = f"spiffe://{TRUST_DOMAIN}/node/{node}"
    base_state = canonical_bytes(BASE_STATE)
    base_record = canonical_bytes(
        {
            "format": 1,
            "kind": "transition",
            "thread_id": thread,
            "version": base_version,
            "state_digest": sha256_hex(base_state),
        }
    )
    patch = {"is_admin": True, "api_token": "s3cret"}
    proposal = canonical_bytes(
        {
            "format": 1,
            "kind": "proposal",
            "thread_id": thread,
            "base_version": base_version,
            "parent_digest": sha256_hex(base_record),
            "node_id": node_id,
            "patch": patch,
            "state_digest": sha256_hex(canonical_bytes({**BASE_STATE, **patch})),
            "policy_digest": "ef" * 32,
            "risk_rules": sorted(rules),
        }
    )
    return Parked(
        approval_pb2.SubmitReviewRequest(
            digest=sha256_hex(proposal),
            thread_id=thread,
            base_version=base_version,
            node_id=node_id,
            risk_rules=list(rules),
            required_approvals=approvals,
            proposal_json=proposal,
            base_record_json=base_record,
            base_state_json=base_state,
            sensitive_keys=["api_token"],
        )
    )


def reviewer_id(name: str) -> str:
    return f"spiffe://{TRUST_DOMAIN}/reviewer/{name}"


def approve(digest: str) -> approval_pb2.DecideRequest:
    return approval_pb2.DecideRequest(digest=digest, decision=approval_pb2.DECISION_APPROVE)


def reject(digest: str) -> approval_pb2.DecideRequest:
    return approval_pb2.DecideRequest(digest=digest, decision=approval_pb2.DECISION_REJECT)


async def submitted(target: str, pki: Pki, proposal: Parked) -> approval_pb2.Review:
    async with stub_as(target, pki.identity(Role.SERVICE, "transition")) as stub:
        response = await stub.SubmitReview(proposal.request)
    return response.review


async def decide(
    target: str, pki: Pki, reviewer: str, request: approval_pb2.DecideRequest
) -> approval_pb2.Review:
    async with stub_as(target, pki.identity(Role.REVIEWER, reviewer)) as stub:
        response = await stub.Decide(request)
    return response.review


def refusal(error: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    return error.code(), refusal_reason(error)


async def refused(call: Any) -> tuple[grpc.StatusCode, str]:
    """The status code and reason of a call that must fail."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return refusal(caught.value)


async def paged(
    stub: approval_pb2_grpc.ApprovalServiceStub, thread_id: str, *, page_size: int, most: int
) -> list[list[str]]:
    """The review digests of each page of a thread's reviews, following the page tokens
    until one is empty (at most ``most`` pages, or the pages never end)."""
    pages: list[list[str]] = []
    token = ""
    for _ in range(most):
        page = await stub.ListReviews(
            approval_pb2.ListReviewsRequest(
                thread_id=thread_id, page_size=page_size, page_token=token
            )
        )
        pages.append([review.digest for review in page.reviews])
        token = page.next_page_token
        if not token:
            return pages
    raise AssertionError(f"the pages did not end within {most}")


async def fetch(dsn: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetch(query, *args)
    finally:
        await conn.close()


def verified(receipt: approval_pb2.SignedReceipt, keys: ApprovalKeys) -> dict[str, Any]:
    signed = SignedReceipt(receipt.receipt_json, receipt.signature, receipt.key_id)
    return verify_receipt(signed, load_public_keys(keys.public), now=datetime.now(UTC))


# --- serving ----------------------------------------------------------------------------


async def test_reports_serving_over_mtls(approval_target: str, pki: Pki) -> None:
    creds = pki.operator()
    credentials = grpc.ssl_channel_credentials(
        creds.ca.read_bytes(), creds.key.read_bytes(), creds.cert.read_bytes()
    )
    async with grpc.aio.secure_channel(approval_target, credentials) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        response = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_client_without_a_certificate_is_turned_away(
    approval_target: str, pki: Pki
) -> None:
    credentials = grpc.ssl_channel_credentials(pki.operator().ca.read_bytes())
    async with grpc.aio.secure_channel(approval_target, credentials) as channel:
        stub = approval_pb2_grpc.ApprovalServiceStub(channel)
        code, _ = await refused(stub.ListReviews(approval_pb2.ListReviewsRequest(), timeout=10))
    assert code is grpc.StatusCode.UNAVAILABLE


# --- submitting -------------------------------------------------------------------------


async def test_submitting_the_same_digest_twice_opens_one_review(
    approval_target: str, pki: Pki, database_dsn: str
) -> None:
    proposal = parked(approvals=2)
    first = await submitted(approval_target, pki, proposal)
    again = await submitted(approval_target, pki, proposal)
    assert first == again
    assert first.status == approval_pb2.REVIEW_STATUS_OPEN
    assert (first.digest, first.thread_id, first.base_version) == (
        proposal.digest,
        proposal.request.thread_id,
        3,
    )
    assert (first.node_id, list(first.risk_rules), first.required_approvals) == (
        PROPOSER_ID,
        ["privilege-change"],
        2,
    )
    assert first.expires_at.ToDatetime() - first.opened_at.ToDatetime() == REVIEW_TTL
    assert not first.HasField("receipt")
    rows = await fetch(
        database_dsn, "SELECT * FROM ztate_approval.reviews WHERE digest = $1", proposal.digest
    )
    assert len(rows) == 1
    assert bytes(rows[0]["proposal"]) == proposal.request.proposal_json


def _tampered(field: str, value: Any) -> approval_pb2.SubmitReviewRequest:
    request = approval_pb2.SubmitReviewRequest()
    request.CopyFrom(parked().request)
    if field == "proposal_json":
        request.proposal_json = request.proposal_json.replace(b'"is_admin":true', value)
    elif field == "risk_rules":
        request.risk_rules[:] = value
    else:
        setattr(request, field, value)
    return request


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("proposal_json", b'"is_admin":false'),  # the bytes no longer hash to the digest
        ("digest", "0" * 64),
        ("digest", "not-a-digest"),
        ("thread_id", "another-thread"),
        ("base_version", 4),
        ("node_id", f"spiffe://{TRUST_DOMAIN}/node/planner"),
        ("risk_rules", ["harmless"]),
        ("required_approvals", 0),
        ("required_approvals", 17),
        # a base that is not the one the proposal builds on: the review would show
        # old values the ledger never held
        ("base_record_json", b'{"thread_id": "x"}'),
        ("base_state_json", b'{"is_admin": true, "owner": "acme"}'),
        ("base_state_json", b""),
    ],
)
async def test_a_submission_that_does_not_match_its_proposal_is_refused(
    approval_target: str, pki: Pki, database_dsn: str, field: str, value: Any
) -> None:
    request = _tampered(field, value)
    async with stub_as(approval_target, pki.identity(Role.SERVICE, "transition")) as stub:
        assert await refused(stub.SubmitReview(request)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "REQUEST_INVALID",
        )
    rows = await fetch(
        database_dsn,
        "SELECT 1 FROM ztate_approval.reviews WHERE digest = $1 OR thread_id = $2",
        request.digest,
        request.thread_id,
    )
    assert rows == []


@pytest.mark.parametrize(
    ("role", "name"),
    [
        (Role.NODE, PROPOSER),
        (Role.REVIEWER, "alice"),
        (Role.OPERATOR, "admin"),
        (Role.SERVICE, "approval"),
    ],
)
async def test_only_the_transition_service_submits(
    approval_target: str, pki: Pki, role: Role, name: str
) -> None:
    async with stub_as(approval_target, pki.identity(role, name)) as stub:
        assert await refused(stub.SubmitReview(parked().request)) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "ROLE_FORBIDDEN",
        )


# --- reading ----------------------------------------------------------------------------


@pytest.mark.parametrize(("role", "name"), [(Role.REVIEWER, "alice"), (Role.OPERATOR, "admin")])
async def test_reviewers_and_operators_see_the_redacted_diff(
    approval_target: str, pki: Pki, role: Role, name: str
) -> None:
    proposal = parked()
    await submitted(approval_target, pki, proposal)
    async with stub_as(approval_target, pki.identity(role, name)) as stub:
        listed = await stub.ListReviews(
            approval_pb2.ListReviewsRequest(thread_id=proposal.request.thread_id)
        )
        got = await stub.GetReview(approval_pb2.GetReviewRequest(digest=proposal.digest))
    assert [review.digest for review in listed.reviews] == [proposal.digest]
    assert listed.reviews[0] == got.review
    diff = json.loads(got.review.redacted_diff_json)
    assert diff["changes"]["is_admin"] == {"old": False, "new": True}
    assert b"s3cret" not in got.review.SerializeToString()
    # the sensitive value is a keyed digest, not its plain SHA-256 (a guessing oracle)
    shown = diff["changes"]["api_token"]["new"]["redacted_hmac_sha256"]
    assert shown != sha256_hex(b'"s3cret"')
    assert len(shown) == 64


async def test_the_review_shows_the_change_that_commits_not_the_summary_it_was_given(
    approval_target: str, pki: Pki
) -> None:
    """Issue 11 item 7: a submitter (even holding the transition service's certificate)
    wrote a summary saying the key was unchanged; the reviewer approved; the hidden
    change committed under a genuine receipt. The summary is now ignored: what is shown
    is computed from the proposal bytes the receipt binds and their verified base."""
    proposal = parked()
    lying = approval_pb2.SubmitReviewRequest()
    lying.CopyFrom(proposal.request)
    lying.redacted_diff_json = canonical_bytes(
        {"changes": {"is_admin": {"old": False, "new": False}}}  # "unchanged"
    )
    await submitted(approval_target, pki, Parked(lying))
    async with stub_as(approval_target, pki.identity(Role.REVIEWER, "alice")) as stub:
        got = await stub.GetReview(approval_pb2.GetReviewRequest(digest=proposal.digest))
    diff = json.loads(got.review.redacted_diff_json)
    assert diff["changes"]["is_admin"] == {"old": False, "new": True}
    assert set(diff["changes"]) == {"is_admin", "api_token"}


@pytest.mark.parametrize(
    ("role", "name"),
    [(Role.NODE, PROPOSER), (Role.NODE, "db-writer"), (Role.SERVICE, "transition")],
)
async def test_workers_may_not_use_the_approval_api(
    approval_target: str, pki: Pki, role: Role, name: str
) -> None:
    proposal = parked()
    await submitted(approval_target, pki, proposal)
    forbidden = (grpc.StatusCode.PERMISSION_DENIED, "ROLE_FORBIDDEN")
    async with stub_as(approval_target, pki.identity(role, name)) as stub:
        assert await refused(stub.ListReviews(approval_pb2.ListReviewsRequest())) == forbidden
        get = approval_pb2.GetReviewRequest(digest=proposal.digest)
        assert await refused(stub.GetReview(get)) == forbidden
        assert await refused(stub.Decide(approve(proposal.digest))) == forbidden


async def test_operators_read_but_do_not_decide(approval_target: str, pki: Pki) -> None:
    proposal = parked()
    await submitted(approval_target, pki, proposal)
    async with stub_as(approval_target, pki.operator()) as stub:
        assert await refused(stub.Decide(approve(proposal.digest))) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "ROLE_FORBIDDEN",
        )


@pytest.mark.parametrize("thread_id", ["\x00", "a\nb", "t" * 129, "é", "a b"])
async def test_a_malformed_thread_filter_is_refused_precisely(
    approval_target: str, pki: Pki, thread_id: str
) -> None:
    """Hostile thread ids in ListReviews (U+0000 once reached Postgres: INTERNAL)."""
    async with stub_as(approval_target, pki.identity(Role.REVIEWER, "alice")) as stub:
        listed = stub.ListReviews(approval_pb2.ListReviewsRequest(thread_id=thread_id))
        assert await refused(listed) == (grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_INVALID")


async def test_unknown_and_malformed_digests(approval_target: str, pki: Pki) -> None:
    async with stub_as(approval_target, pki.identity(Role.REVIEWER, "alice")) as stub:
        missing = "0" * 64
        assert await refused(stub.GetReview(approval_pb2.GetReviewRequest(digest=missing))) == (
            grpc.StatusCode.NOT_FOUND,
            "REVIEW_NOT_FOUND",
        )
        assert await refused(stub.Decide(approve(missing))) == (
            grpc.StatusCode.NOT_FOUND,
            "REVIEW_NOT_FOUND",
        )
        assert await refused(stub.Decide(approve("ABC"))) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "REQUEST_INVALID",
        )
        undecided = approval_pb2.DecideRequest(digest=missing)
        assert await refused(stub.Decide(undecided)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "REQUEST_INVALID",
        )


async def test_keyset_pagination_visits_each_review_once_oldest_first(
    approval_target: str, pki: Pki
) -> None:
    thread = new_thread_id()
    digests = []
    for version in range(5):
        proposal = parked(thread_id=thread, base_version=version)
        await submitted(approval_target, pki, proposal)
        digests.append(proposal.digest)
    async with stub_as(approval_target, pki.identity(Role.REVIEWER, "alice")) as stub:
        pages = await paged(stub, thread, page_size=2, most=len(digests) + 1)
        assert all(len(page) <= 2 for page in pages)
        assert [digest for page in pages for digest in page] == digests
        for bad in ({"page_token": "garbage"}, {"page_size": 1001}, {"status": 9}):
            assert await refused(
                stub.ListReviews(approval_pb2.ListReviewsRequest(**bad))  # type: ignore[arg-type]
            ) == (grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_INVALID")


async def test_a_page_of_large_reviews_is_cut_to_the_reply_budget_and_continues(
    approval_target: str, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each review carries its diff: 100 of a few hundred KB went over the 16 MiB reply
    limit, and every page (the console's, ``ztate approvals list``) failed with
    RESOURCE_EXHAUSTED while the reviews expired unseen. A page is now cut to the reply
    budget (here one byte: one review a page), its token after the last one sent."""
    from ztate.approval_service import server

    thread = new_thread_id()
    digests = []
    for version in range(4):
        proposal = parked(thread_id=thread, base_version=version)
        await submitted(approval_target, pki, proposal)
        digests.append(proposal.digest)
    monkeypatch.setattr(server, "LIST_REPLY_BUDGET", 1)
    async with stub_as(approval_target, pki.identity(Role.REVIEWER, "alice")) as stub:
        pages = await paged(stub, thread, page_size=100, most=len(digests) + 1)
    assert all(len(page) <= 1 for page in pages)
    assert [digest for page in pages for digest in page] == digests


# --- deciding ---------------------------------------------------------------------------


async def test_a_reviewer_never_decides_on_their_own_proposal(
    approval_target: str, pki: Pki, database_dsn: str
) -> None:
    proposal = parked()
    await submitted(approval_target, pki, proposal)
    for request in (approve(proposal.digest), reject(proposal.digest)):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await decide(approval_target, pki, PROPOSER, request)
        assert refusal(caught.value) == (grpc.StatusCode.PERMISSION_DENIED, "SELF_APPROVAL")
    decisions = await fetch(
        database_dsn, "SELECT 1 FROM ztate_approval.decisions WHERE digest = $1", proposal.digest
    )
    assert decisions == []
    review = await decide(approval_target, pki, "alice", approve(proposal.digest))
    assert review.status == approval_pb2.REVIEW_STATUS_APPROVED


async def test_a_reviewer_decides_once(approval_target: str, pki: Pki) -> None:
    proposal = parked(approvals=2)
    await submitted(approval_target, pki, proposal)
    first = await decide(approval_target, pki, "alice", approve(proposal.digest))
    assert list(first.approvers) == [reviewer_id("alice")]
    for request in (approve(proposal.digest), reject(proposal.digest)):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await decide(approval_target, pki, "alice", request)
        assert refusal(caught.value) == (grpc.StatusCode.ALREADY_EXISTS, "ALREADY_DECIDED")
    async with stub_as(approval_target, pki.identity(Role.REVIEWER, "bob")) as stub:
        review = (
            await stub.GetReview(approval_pb2.GetReviewRequest(digest=proposal.digest))
        ).review
    assert review.status == approval_pb2.REVIEW_STATUS_OPEN
    assert list(review.approvers) == [reviewer_id("alice")]


async def test_k_distinct_approvals_sign_one_receipt_over_all_approvers(
    approval_target: str, pki: Pki, approval_keys: ApprovalKeys, database_dsn: str
) -> None:
    proposal = parked(approvals=2)
    await submitted(approval_target, pki, proposal)
    first = await decide(approval_target, pki, "alice", approve(proposal.digest))
    assert first.status == approval_pb2.REVIEW_STATUS_OPEN
    assert not first.HasField("receipt")
    second = await decide(approval_target, pki, "bob", approve(proposal.digest))
    assert second.status == approval_pb2.REVIEW_STATUS_APPROVED
    assert sorted(second.approvers) == [reviewer_id("alice"), reviewer_id("bob")]
    receipt = verified(second.receipt, approval_keys)
    assert receipt["transition_digest"] == proposal.digest
    assert (receipt["thread_id"], receipt["base_version"]) == (proposal.request.thread_id, 3)
    assert receipt["decision"] == "approve"
    assert receipt["reviewers"] == [reviewer_id("alice"), reviewer_id("bob")]
    assert receipt["key_id"] == KEY_ID
    issued = datetime.fromisoformat(receipt["issued_at"].replace("Z", "+00:00"))
    expires = datetime.fromisoformat(receipt["expires_at"].replace("Z", "+00:00"))
    assert expires - issued == RECEIPT_TTL
    [stored] = await fetch(
        database_dsn,
        "SELECT nonce, receipt FROM ztate_approval.receipts WHERE digest = $1",
        proposal.digest,
    )
    assert (stored["nonce"], bytes(stored["receipt"])) == (
        receipt["nonce"],
        second.receipt.receipt_json,
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await decide(approval_target, pki, "carol", approve(proposal.digest))
    assert refusal(caught.value) == (grpc.StatusCode.FAILED_PRECONDITION, "REVIEW_CLOSED")
    async with stub_as(approval_target, pki.identity(Role.REVIEWER, "carol")) as stub:
        approved = await stub.ListReviews(
            approval_pb2.ListReviewsRequest(
                status=approval_pb2.REVIEW_STATUS_APPROVED, thread_id=proposal.request.thread_id
            )
        )
    assert [review.receipt for review in approved.reviews] == [second.receipt]


async def test_a_rejection_closes_the_review_with_a_reject_receipt(
    approval_target: str, pki: Pki, approval_keys: ApprovalKeys
) -> None:
    proposal = parked(approvals=2)
    await submitted(approval_target, pki, proposal)
    await decide(approval_target, pki, "alice", approve(proposal.digest))
    review = await decide(approval_target, pki, "bob", reject(proposal.digest))
    assert review.status == approval_pb2.REVIEW_STATUS_REJECTED
    receipt = verified(review.receipt, approval_keys)
    assert (receipt["decision"], receipt["reviewers"]) == ("reject", [reviewer_id("bob")])
    assert receipt["transition_digest"] == proposal.digest


async def test_concurrent_reviewers_close_a_review_once(
    approval_target: str, pki: Pki, database_dsn: str
) -> None:
    proposal = parked(approvals=1)
    await submitted(approval_target, pki, proposal)
    names = ["alice", "bob", "carol", "dave"]
    outcomes = await asyncio.gather(
        *(decide(approval_target, pki, name, approve(proposal.digest)) for name in names),
        return_exceptions=True,
    )
    won = [o for o in outcomes if isinstance(o, approval_pb2.Review)]
    lost = [refusal(o) for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(won) == 1
    assert lost == [(grpc.StatusCode.FAILED_PRECONDITION, "REVIEW_CLOSED")] * 3
    receipts = await fetch(
        database_dsn, "SELECT 1 FROM ztate_approval.receipts WHERE digest = $1", proposal.digest
    )
    assert len(receipts) == 1


async def test_k_concurrent_approvals_sign_exactly_one_receipt(
    approval_target: str, pki: Pki, approval_keys: ApprovalKeys
) -> None:
    proposal = parked(approvals=3)
    await submitted(approval_target, pki, proposal)
    reviews = await asyncio.gather(
        *(
            decide(approval_target, pki, name, approve(proposal.digest))
            for name in ("alice", "bob", "carol")
        )
    )
    closed = [r for r in reviews if r.status == approval_pb2.REVIEW_STATUS_APPROVED]
    assert len(closed) == 1
    receipt = verified(closed[0].receipt, approval_keys)
    assert receipt["reviewers"] == [reviewer_id(n) for n in ("alice", "bob", "carol")]


async def test_a_decision_answers_what_it_did_even_if_another_closes_the_review_next(
    approval_target: str, pki: Pki, approval: RunningApproval, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's approval only counts (two are needed); Bob's closes the review right after
    Alice's transaction commits. Alice is told "open, approved by alice", never "approved"
    (under load, two of three concurrent approvers were once both told APPROVED)."""
    proposal = parked(approvals=2)
    await submitted(approval_target, pki, proposal)
    store = approval.service._store
    read_review = store.get
    interleaved: list[approval_pb2.Review] = []
    hooked = [True]

    async def get_after_bob_decides(digest: str) -> Any:
        if hooked.pop() if hooked else False:  # the first read after Alice's decision
            interleaved.append(await decide(approval_target, pki, "bob", approve(digest)))
        return await read_review(digest)

    monkeypatch.setattr(store, "get", get_after_bob_decides)
    alice = await decide(approval_target, pki, "alice", approve(proposal.digest))
    monkeypatch.undo()
    bob = interleaved[0] if interleaved else None
    if bob is None:  # nothing read the review after Alice's decision: Bob decides now
        bob = await decide(approval_target, pki, "bob", approve(proposal.digest))
    assert (alice.status, list(alice.approvers)) == (
        approval_pb2.REVIEW_STATUS_OPEN,
        [reviewer_id("alice")],
    )
    assert not alice.HasField("receipt")
    assert bob.status == approval_pb2.REVIEW_STATUS_APPROVED
    assert bob.HasField("receipt")


async def test_an_overdue_review_expires_and_takes_no_decision(
    approval_target: str, pki: Pki, approval: RunningApproval, database_dsn: str
) -> None:
    late, swept = parked(), parked()
    for proposal in (late, swept):
        await submitted(approval_target, pki, proposal)
    await fetch(
        database_dsn,
        "UPDATE ztate_approval.reviews SET expires_at = now() - interval '1 second' "
        "WHERE digest = ANY($1::text[])",
        [late.digest, swept.digest],
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await decide(approval_target, pki, "alice", approve(late.digest))
    assert refusal(caught.value) == (grpc.StatusCode.FAILED_PRECONDITION, "REVIEW_CLOSED")
    # The sweep may also run in the delivery loop; either way both end expired.
    await approval.service.expire_overdue()
    rows = await fetch(
        database_dsn,
        "SELECT r.status, c.digest AS receipt FROM ztate_approval.reviews r "
        "LEFT JOIN ztate_approval.receipts c USING (digest) WHERE r.digest = ANY($1::text[])",
        [late.digest, swept.digest],
    )
    assert [(row["status"], row["receipt"]) for row in rows] == [("expired", None)] * 2


# --- separation of duties in the database -----------------------------------------------


@contextlib.asynccontextmanager
async def connected_as(dsn: str, role: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(dsn, server_settings={"role": role})
    try:
        yield conn
    finally:
        await conn.close()


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT * FROM ztate.threads",
        "SELECT * FROM ztate.transitions",
        "SELECT * FROM ztate.pending_transitions",
        "SELECT * FROM ztate.receipts",
        "INSERT INTO ztate.rejections (method, node_id, reason, message) "
        "VALUES ('x', 'y', 'z', 'w')",
        "UPDATE ztate.threads SET version = version + 1",
    ],
)
async def test_the_approval_role_cannot_touch_transition_tables(
    approval: RunningApproval, database_dsn: str, statement: str
) -> None:
    async with connected_as(database_dsn, APPROVAL_ROLE) as conn:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(statement)


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT * FROM ztate_approval.reviews",
        "SELECT * FROM ztate_approval.receipts",
        "INSERT INTO ztate_approval.decisions (digest, reviewer, decision) "
        "VALUES (repeat('0', 64), 'me', 'approve')",
        "UPDATE ztate_approval.reviews SET status = 'approved'",
    ],
)
async def test_the_transition_role_cannot_touch_approval_tables(
    approval: RunningApproval, database_dsn: str, statement: str
) -> None:
    async with connected_as(database_dsn, TRANSITION_ROLE) as conn:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(statement)


@pytest.mark.parametrize(
    "statement",
    [
        "DELETE FROM ztate_approval.decisions",
        "DELETE FROM ztate_approval.receipts",
        "UPDATE ztate_approval.reviews SET required_approvals = 1",
        "UPDATE ztate_approval.receipts SET receipt = ''::bytea",
    ],
)
async def test_the_approval_role_cannot_rewrite_decisions_or_receipts(
    approval: RunningApproval, database_dsn: str, statement: str
) -> None:
    async with connected_as(database_dsn, APPROVAL_ROLE) as conn:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(statement)


# --- the reviewer's command line --------------------------------------------------------


@dataclass(frozen=True)
class CliResult:
    code: int
    out: str
    err: str


def _run_cli(argv: list[str]) -> CliResult:
    """``ztate approvals ...`` in this process (from a worker thread: it runs its own loop)."""
    parser = argparse.ArgumentParser(prog="ztate")
    add_approval_commands(parser.add_subparsers(dest="command", required=True))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = dispatch(parser.parse_args(argv))
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli_flags(approval: RunningApproval, pki: Pki) -> list[str]:
    return ["--target", f"localhost:{approval.port}", "--ca", str(pki.certs / ca.CA_CERT)]


def _reviewer(pki: Pki, name: str) -> list[str]:
    creds = pki.identity(Role.REVIEWER, name)
    return ["--cert", str(creds.cert), "--key", str(creds.key)]


async def test_the_cli_lists_shows_and_decides(
    approval_target: str, pki: Pki, cli_flags: list[str]
) -> None:
    proposal = parked(approvals=2)
    await submitted(approval_target, pki, proposal)
    digest, thread = proposal.digest, proposal.request.thread_id

    def cli(*argv: str, reviewer: str = "alice") -> CliResult:
        command, rest = argv[0], list(argv[1:])
        return _run_cli(["approvals", command, *rest, *cli_flags, *_reviewer(pki, reviewer)])

    listed = await asyncio.to_thread(cli, "list", "--thread", thread, "--json")
    assert listed.code == 0, listed.err
    [row] = [json.loads(line) for line in listed.out.splitlines()]
    assert (row["digest"], row["status"], row["node_id"]) == (digest, "open", PROPOSER_ID)

    shown = await asyncio.to_thread(cli, "show", digest)
    assert shown.code == 0, shown.err
    for fragment in (digest, thread, PROPOSER_ID, "privilege-change", "2 required", "is_admin"):
        assert fragment in shown.out
    assert "- false" in shown.out
    assert "+ true" in shown.out
    assert "s3cret" not in shown.out

    own = await asyncio.to_thread(cli, "approve", digest, reviewer=PROPOSER)
    assert (own.code, own.out) == (1, "")
    assert "SELF_APPROVAL" in own.err

    assert (await asyncio.to_thread(cli, "approve", digest)).code == 0
    twice = await asyncio.to_thread(cli, "approve", digest)
    assert twice.code == 1
    assert "ALREADY_DECIDED" in twice.err
    done = await asyncio.to_thread(cli, "reject", digest, reviewer="bob")
    assert done.code == 0, done.err
    assert "review rejected" in done.out

    bad = await asyncio.to_thread(cli, "show", "not-a-digest")
    assert bad.code == 2
    assert "DIGEST" in bad.err
    unknown = await asyncio.to_thread(cli, "show", "0" * 64)
    assert (unknown.code, unknown.out) == (3, "")  # not found (docs/cli.md)
    assert "NOT_FOUND" in unknown.err
    listed = await asyncio.to_thread(
        cli, "list", "--status", "rejected", "--thread", thread, "-o", "json"
    )
    assert listed.code == 0, listed.err
    assert [(r["digest"], r["status"]) for r in json.loads(listed.out)] == [(digest, "rejected")]


async def test_the_approval_service_exports_its_pool_saturation(
    approval_settings: ApprovalSettings, database_dsn: str, service: RunningService
) -> None:
    """``ztate.db.pool.*`` for the approval service's own pool (read from the pool,
    through the metrics SDK's in-memory reader)."""
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    telemetry = Telemetry(TracerProvider(), meters, None, Metrics(meters.get_meter("ztate")))
    running = await start(approval_settings, dsn=database_dsn, telemetry=telemetry)
    try:
        data = reader.get_metrics_data()
        assert data is not None
        points = {
            (metric.name, point.attributes.get("ztate.pool"), point.attributes.get("state")): (
                point.value
            )
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            for point in metric.data.data_points
            if point.attributes is not None
        }
    finally:
        await running.stop(grace=1.0)
    assert points[("ztate.db.pool.max", "approval", None)] == approval_settings.db_pool_size
    used = points[("ztate.db.pool.connections", "approval", "used")]
    idle = points[("ztate.db.pool.connections", "approval", "idle")]
    assert 1 <= used + idle <= approval_settings.db_pool_size


async def test_a_revoked_reviewer_decides_nothing_more(
    approval_target: str,
    approval_settings: ApprovalSettings,
    pki: Pki,
    database_dsn: str,
) -> None:
    proposal = parked()
    await submitted(approval_target, pki, proposal)
    revocations = approval_settings.revocation_list_file
    assert revocations is not None
    async with stub_as(approval_target, pki.identity(Role.REVIEWER, "carol")) as stub:
        opened = await stub.GetReview(approval_pb2.GetReviewRequest(digest=proposal.digest))
        assert opened.review.status == approval_pb2.REVIEW_STATUS_OPEN
        revoked = reviewer_id("carol")
        assert ztate(["ca", "revoke", "--spiffe-id", revoked, "--list", str(revocations)]) == 0
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # the same, open connection
            await stub.Decide(approve(proposal.digest))
    assert refusal(caught.value) == (grpc.StatusCode.UNAUTHENTICATED, "IDENTITY_REVOKED")
    assert caught.value.details() == f"identity {revoked} is revoked"
    decisions = await fetch(
        database_dsn, "SELECT 1 FROM ztate_approval.decisions WHERE digest = $1", proposal.digest
    )
    assert decisions == []
    async with stub_as(approval_target, pki.identity(Role.REVIEWER, "bob")) as stub:
        review = (
            await stub.GetReview(approval_pb2.GetReviewRequest(digest=proposal.digest))
        ).review
    assert review.status == approval_pb2.REVIEW_STATUS_OPEN
    assert list(review.approvers) == []


async def test_an_approval_revoked_before_the_review_closes_is_taken_back(
    approval_target: str,
    approval_settings: ApprovalSettings,
    approval_keys: ApprovalKeys,
    pki: Pki,
    database_dsn: str,
    tmp_path: Path,
) -> None:
    """An approval counts toward k only while neither its reviewer nor the certificate
    it was made with is revoked: a stolen reviewer key that approved, revoked since (by
    identity or by serial), no longer makes a receipt with one honest approval."""
    proposal = parked(approvals=2)
    await submitted(approval_target, pki, proposal)
    revocations = approval_settings.revocation_list_file
    assert revocations is not None
    # mallory's key, stolen: it approves, then her identity is revoked
    first = await decide(approval_target, pki, "mallory", approve(proposal.digest))
    assert first.status == approval_pb2.REVIEW_STATUS_OPEN
    mallory = reviewer_id("mallory")
    assert ztate(["ca", "revoke", "--spiffe-id", mallory, "--list", str(revocations)]) == 0
    # dave approves with a certificate of his that is then revoked by its serial alone
    lost = ca.issue(pki.ca_dir, Identity(TRUST_DOMAIN, Role.REVIEWER, "dave"), tmp_path / "dave")
    async with stub_as(approval_target, Credentials(lost.cert, lost.key, lost.ca_cert)) as stub:
        second = (await stub.Decide(approve(proposal.digest))).review
    assert second.status == approval_pb2.REVIEW_STATUS_OPEN  # mallory's no longer counts
    assert ztate(["ca", "revoke", "--cert", str(lost.cert), "--list", str(revocations)]) == 0
    third = await decide(approval_target, pki, "bob", approve(proposal.digest))
    assert third.status == approval_pb2.REVIEW_STATUS_OPEN  # nor dave's: one approval counts
    assert not third.HasField("receipt")
    receipts = await fetch(
        database_dsn, "SELECT 1 FROM ztate_approval.receipts WHERE digest = $1", proposal.digest
    )
    assert receipts == []
    # every decision is kept, with the certificate it was made with
    decisions = await fetch(
        database_dsn,
        "SELECT reviewer, cert_serial FROM ztate_approval.decisions WHERE digest = $1 "
        "ORDER BY reviewer",
        proposal.digest,
    )
    assert [row["reviewer"] for row in decisions] == [
        reviewer_id("bob"),
        reviewer_id("dave"),
        mallory,
    ]
    assert decisions[1]["cert_serial"] == format(
        x509.load_pem_x509_certificate(lost.cert.read_bytes()).serial_number, "x"
    )
    # a second honest approval closes it, with the approvals that count
    closed = await decide(approval_target, pki, "erin", approve(proposal.digest))
    assert closed.status == approval_pb2.REVIEW_STATUS_APPROVED
    receipt = verified(closed.receipt, approval_keys)
    assert receipt["reviewers"] == [reviewer_id("bob"), reviewer_id("erin")]


async def test_the_approval_service_serves_its_metrics_for_prometheus(
    approval_settings: ApprovalSettings, database_dsn: str, service: RunningService
) -> None:
    """ZTATE_APPROVAL_METRICS_LISTEN: GET /metrics over real HTTP (docs/operations.md),
    and the kubelet's probes: the approval service hands the endpoint its health and loop."""
    running = await start(
        approval_settings.model_copy(update={"metrics_listen": "127.0.0.1:0"}), dsn=database_dsn
    )
    try:
        base = f"http://127.0.0.1:{running.telemetry.metrics_port}"
        with await asyncio.to_thread(
            urllib.request.urlopen, f"{base}/metrics", timeout=10
        ) as reply:
            body = reply.read().decode()
        assert await asyncio.to_thread(get, f"{base}/readyz") == (200, "ok")
        assert await asyncio.to_thread(get, f"{base}/livez") == (200, "live")
        await running.database_health.stop()  # as after two failed pings
        await running.health.set_serving(False)
        assert await asyncio.to_thread(get, f"{base}/readyz") == (503, "not serving")
        assert await asyncio.to_thread(get, f"{base}/livez") == (200, "live")
    finally:
        await running.stop(grace=1.0)
    assert re.search(r'^ztate_db_pool_max\{[^}]*ztate_pool="approval"\} 4\.0$', body, re.M)
