"""Regressions for defects a code review found; each test fails on the code before
its fix."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.harness import INITIAL, Ledger, Pki, as_operator_sees_it, client, new_thread_id
from ztate.contract.keyring import generate_signing_key, load_signing_key
from ztate.contract.receipts import build_receipt, sign_receipt
from ztate.contract.record import KIND_TRANSITION, build_record, seal
from ztate.services.policy.credentials import shown_name
from ztate.services.store.approvals import ApprovalStore, Approved, ApprovedCommit
from ztate.services.store.interface import TransitionStore
from ztate.transition_service.app import RunningService
from ztate.transition_service.outbox import ApprovalOutbox
from ztate.worker_sdk import (
    AwaitingApproval,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    PermissionDenied,
)

OTHER_USER = "9b2f5d0e-1c3a-4e6b-8d7f-0a1b2c3d4e5f"
SECRET_NAME = "AKIAIOSFODNN7EXAMPLE"


async def parked_thread(target: str, pki: Pki, dsn: str) -> tuple[str, AwaitingApproval]:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(target, pki.node("planner")) as planner:
        with pytest.raises(AwaitingApproval) as parked:
            await planner.propose(thread_id, 0, {"target_user_id": OTHER_USER})
    return thread_id, await as_operator_sees_it(dsn, parked.value)


async def expire_everything(service: RunningService) -> None:
    outbox = ApprovalOutbox(
        approvals=ApprovalStore(service.store.pool),
        channel=None,
        wake=asyncio.Event(),
        interval=60,
        pending_ttl=timedelta(0),
    )
    await outbox.run_once()


async def test_an_approval_commit_on_a_closed_transition_writes_nothing(
    target: str,
    pki: Pki,
    service: RunningService,
    ledger: Ledger,
    tmp_path: Path,
    database_dsn: str,
) -> None:
    """Review finding 1: the head moved without a ledger row when the parked row
    stopped being pending between reading it and committing."""
    thread_id, parked = await parked_thread(target, pki, database_dsn)
    store: TransitionStore = service.store
    pending = await store.pending_by_digest(parked.digest)
    assert pending is not None
    await expire_everything(service)
    before = await ledger.snapshot(thread_id)
    key_dir = tmp_path
    generate_signing_key(key_dir / "k.pem", key_dir / "k.json", "k")
    now = datetime.now(UTC)
    receipt = sign_receipt(
        build_receipt(
            transition_digest=parked.digest,
            thread_id=thread_id,
            base_version=0,
            decision="approve",
            reviewers=["spiffe://ztate.test/reviewer/alice"],
            issued_at=now,
            expires_at=now + timedelta(minutes=5),
            key_id="k",
        ),
        load_signing_key(key_dir / "k.pem"),
    )
    keyring = ledger.keyring
    sealed = seal(
        build_record(
            kind=KIND_TRANSITION,
            thread_id=thread_id,
            version=1,
            parent_digest=pending.parent_digest,
            node_id=pending.node_id,
            patch={"target_user_id": OTHER_USER},
            state_digest="0" * 64,
            policy_digest="0" * 64,
            receipt_digest=receipt.digest,
            key_id=keyring.current,
            committed_at=now,
        ),
        keyring,
    )
    result = await ApprovalStore(store.pool).commit_approved(
        sealed, b"{}", pending, receipt, "ab" * 16, now
    )
    assert result == ApprovedCommit(Approved.NOT_PENDING, "expired")
    assert await ledger.snapshot(thread_id) == before  # head, ledger: untouched


async def test_another_workflows_thread_tells_nothing_even_its_version(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    """Review finding 2: a stale version used to reveal the thread and its head."""
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(target, pki.node("invoicer")) as invoicer:
        for version in (0, 7):
            with pytest.raises(NotFound) as caught:
                await invoicer.propose(thread_id, version, {"invoice_note": "x"})
            assert caught.value.reason == "THREAD_NOT_FOUND"
            assert caught.value.current_version is None
    reasons = [r["reason"] for r in await ledger.rejections(thread_id)]
    assert reasons == ["POLICY_MISMATCH", "POLICY_MISMATCH"]


@pytest.mark.parametrize("service_name", ["approval", "transition"])
async def test_service_identities_neither_create_nor_read_threads(
    target: str, pki: Pki, service_name: str
) -> None:
    """Review finding 3: the approval service could create threads and read state."""
    from ztate.services.runtime.identity import Role

    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(target, pki.identity(Role.SERVICE, service_name)) as svc:
        with pytest.raises(PermissionDenied) as creating:
            await svc.create_thread(new_thread_id(), INITIAL, policy="pipeline")
        with pytest.raises(PermissionDenied) as reading:
            await svc.get_view(thread_id)
    assert creating.value.reason == reading.value.reason == "ROLE_FORBIDDEN"


async def test_an_expired_change_proposed_again_is_told_so(
    target: str, pki: Pki, service: RunningService, database_dsn: str
) -> None:
    """Review finding 6: the same change again silently returned the expired row."""
    thread_id, _ = await parked_thread(target, pki, database_dsn)
    await expire_everything(service)
    async with client(target, pki.node("planner")) as planner:
        with pytest.raises(FailedPrecondition) as caught:
            await planner.propose(thread_id, 0, {"target_user_id": OTHER_USER})
    assert caught.value.reason == "REVIEW_CLOSED"
    assert "already expired" in caught.value.message


async def test_attacker_chosen_names_never_reach_errors_or_the_ledger(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    """Review finding 5: duplicate and extra member names were echoed verbatim."""
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    duplicate = (
        b'{"requested_action": {"action": "none", "'
        + SECRET_NAME.encode()
        + b'": 1, "'
        + SECRET_NAME.encode()
        + b'": 2}}'
    )
    extra = {"requested_action": {"action": "none", SECRET_NAME: 1}}
    async with client(target, pki.node("input-parser")) as parser:
        for patch in (duplicate, extra):
            with pytest.raises(InvalidRequest) as caught:
                await parser.propose(thread_id, 0, patch)
            assert SECRET_NAME not in caught.value.message
            assert shown_name(SECRET_NAME) in caught.value.message
    for row in await ledger.rejections(thread_id):
        assert SECRET_NAME not in row["message"]
        assert all(SECRET_NAME not in key for key in row["keys"])
    expected = "sha256:" + hashlib.sha256(SECRET_NAME.encode()).hexdigest()[:16]
    assert shown_name(SECRET_NAME) == expected
