"""The approval service's receipt delivery when things go wrong between the two
services: an answer lost after the transition service applied a receipt, and a
transition service that does not take the approval service's receipts yet (its
approval public keys behind a key rotation). Real transition and approval services,
gRPC with mTLS, Postgres; each delivery round is run by the test."""

from __future__ import annotations

import asyncio
import shutil
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import grpc
import pytest
import pytest_asyncio

from tests.harness import (
    INITIAL,
    TRUST_DOMAIN,
    Pki,
    as_operator_sees_it,
    client,
    new_thread_id,
    secure_channel,
)
from ztate.approval_service.app import RunningApproval
from ztate.approval_service.app import start as start_approval
from ztate.approval_service.delivery import ReceiptDelivery, transition_channel
from ztate.contract.keyring import add_signing_key, generate_signing_key
from ztate.services.cli import ca
from ztate.services.runtime.config import ApprovalSettings, Settings
from ztate.services.runtime.identity import Identity, Role
from ztate.transition_service.app import RunningService
from ztate.transition_service.app import start as start_transition
from ztate.v1 import approval_pb2, approval_pb2_grpc, transition_pb2, transition_pb2_grpc
from ztate.worker_sdk import AwaitingApproval

OTHER_USER = "9b2f5d0e-1c3a-4e6b-8d7f-0a1b2c3d4e5f"  # acting for another user is parked


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Pair:
    """A transition service and an approval service that know each other; the
    approval service's own delivery stopped, so that each round is the test's."""

    pki: Pki
    dsn: str
    settings: Settings
    transition: RunningService
    approval: RunningApproval
    approval_settings: ApprovalSettings
    keys: Path

    @property
    def transition_target(self) -> str:
        return f"localhost:{self.transition.port}"

    @property
    def approval_target(self) -> str:
        return f"localhost:{self.approval.port}"

    async def deliver(self) -> None:
        """One delivery round, as the approval service's loop runs it."""
        delivery = ReceiptDelivery(
            service=self.approval.service,
            store=self.approval.store,
            channel=transition_channel(self.approval_settings),
            wake=asyncio.Event(),
            interval=1.0,
        )
        try:
            await delivery.run_once()
        finally:
            await delivery.stop()


@pytest_asyncio.fixture
async def pair(
    request: pytest.FixtureRequest,
    pki: Pki,
    settings: Settings,
    database_dsn: str,
    tmp_path: Path,
) -> AsyncIterator[Pair]:
    """The approval service signs with ``request.param`` ("k1", or "k2": a key the
    transition service, which trusts k1 alone, has not been given yet)."""
    base_settings = settings  # the suite's, on this pair's ports and approval keys
    signing = getattr(request, "param", "k1")
    keys = tmp_path / "keys"
    generate_signing_key(keys / "k1.pem", keys / "public-k1.json", "k1")
    shutil.copy(keys / "public-k1.json", keys / "public-both.json")
    add_signing_key(keys / "k2.pem", keys / "public-both.json", "k2")
    transition_port, approval_port = free_port(), free_port()
    settings = base_settings.model_copy(
        update={
            "home": tmp_path / "home",
            "listen": f"127.0.0.1:{transition_port}",
            "approval_target": f"localhost:{approval_port}",
            "approval_public_keys_file": keys / "public-k1.json",
            "outbox_interval_seconds": 0.2,
            "db_pool_size": 4,
        }
    )
    transition = await start_transition(settings, dsn=database_dsn)
    issued = ca.issue(
        pki.ca_dir,
        Identity(TRUST_DOMAIN, Role.SERVICE, "approval"),
        tmp_path / "approval-home" / "certs",
        dns_names=("localhost",),
        ip_addresses=("127.0.0.1",),
    )
    approval_settings = ApprovalSettings(
        ZTATE_HOME=tmp_path / "approval-home",
        ZTATE_TRUST_DOMAIN=TRUST_DOMAIN,
        listen=f"127.0.0.1:{approval_port}",
        tls_cert=issued.cert,
        tls_key=issued.key,
        tls_ca=issued.ca_cert,
        signing_key_file=keys / f"{signing}.pem",
        key_id=signing,
        transition_target=f"localhost:{transition_port}",
        transition_server_name="localhost",
        outbox_interval_seconds=60.0,
        db_pool_size=4,
    )
    approval = await start_approval(approval_settings, dsn=database_dsn)
    await approval.delivery.stop()  # every round is the test's
    running = Pair(pki, database_dsn, settings, transition, approval, approval_settings, keys)
    yield running
    await running.approval.stop(grace=1.0)
    await running.transition.stop(grace=1.0)


async def parked(pair: Pair) -> AwaitingApproval:
    """A proposal parked for one approval, and its review open at the approval service."""
    thread_id = new_thread_id()
    async with client(pair.transition_target, pair.pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(pair.transition_target, pair.pki.node("planner")) as worker:
        with pytest.raises(AwaitingApproval) as caught:
            await worker.propose(thread_id, 0, {"target_user_id": OTHER_USER})
    found = await as_operator_sees_it(pair.dsn, caught.value)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while await review(pair, found.digest) is None:  # the transition service's outbox
        assert loop.time() < deadline, "the review was never opened"
        await asyncio.sleep(0.05)  # polling a condition, with a deadline
    return found


async def review(pair: Pair, digest: str) -> approval_pb2.Review | None:
    reviewer = pair.pki.identity(Role.REVIEWER, "alice")
    async with secure_channel(pair.approval_target, reviewer) as channel:
        try:
            found = await approval_pb2_grpc.ApprovalServiceStub(channel).GetReview(
                approval_pb2.GetReviewRequest(digest=digest)
            )
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.NOT_FOUND:
                return None
            raise
    return found.review


async def approve(pair: Pair, reviewer: str, digest: str) -> approval_pb2.Review:
    async with secure_channel(
        pair.approval_target, pair.pki.identity(Role.REVIEWER, reviewer)
    ) as channel:
        decided = await approval_pb2_grpc.ApprovalServiceStub(channel).Decide(
            approval_pb2.DecideRequest(digest=digest, decision=approval_pb2.DECISION_APPROVE)
        )
    return decided.review


async def row(dsn: str, query: str, digest: str) -> asyncpg.Record | None:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchrow(query, digest)
    finally:
        await conn.close()


PENDING = "SELECT status FROM ztate.pending_transitions WHERE digest = $1"
OUTBOX = "SELECT delivered_at, outcome FROM ztate_approval.receipts WHERE digest = $1"


async def test_a_redelivery_after_a_lost_answer_records_what_the_first_delivery_did(
    pair: Pair,
) -> None:
    """A delivery whose answer was lost (its deadline, a restart mid-call) after the
    transition service committed is delivered again and told RECEIPT_REPLAYED: the
    review records "committed", what the first delivery did, not "not applied"."""
    proposal = await parked(pair)
    decided = await approve(pair, "alice", proposal.digest)
    assert decided.status == approval_pb2.REVIEW_STATUS_APPROVED
    service = pair.pki.identity(Role.SERVICE, "approval")
    async with secure_channel(pair.transition_target, service) as channel:
        # the first delivery: it commits, and its answer never reaches the outbox
        answer = await transition_pb2_grpc.TransitionServiceStub(channel).ApplyDecision(
            transition_pb2.ApplyDecisionRequest(receipt=decided.receipt)
        )
    assert answer.outcome == transition_pb2.OUTCOME_COMMITTED
    await pair.deliver()  # the outbox delivers it again
    found = await review(pair, proposal.digest)
    assert found is not None
    assert found.outcome == "committed"
    delivered = await row(pair.dsn, OUTBOX, proposal.digest)
    assert delivered is not None
    assert delivered["delivered_at"] is not None
    assert await row(pair.dsn, PENDING, proposal.digest) == ("committed",)


@pytest.mark.parametrize("pair", ["k2"], indirect=True)
async def test_a_receipt_the_transition_service_cannot_verify_yet_waits_and_then_applies(
    pair: Pair,
) -> None:
    """A receipt signed with a key the transition service has not been given (a key
    rotation done on the approval service first) is a configuration problem, not a
    verdict on the decision: it stays in the outbox, retried, and nothing is committed;
    once the transition service has the key, the next round applies it."""
    proposal = await parked(pair)
    decided = await approve(pair, "alice", proposal.digest)
    assert decided.status == approval_pb2.REVIEW_STATUS_APPROVED
    for _ in range(2):
        await pair.deliver()
    waiting = await row(pair.dsn, OUTBOX, proposal.digest)
    assert waiting is not None
    assert (waiting["delivered_at"], waiting["outcome"]) == (None, None)
    assert await row(pair.dsn, PENDING, proposal.digest) == ("pending",)
    # the operator gives the transition service the new public key and restarts it
    await pair.transition.stop(grace=1.0)
    pair.transition = await start_transition(
        pair.settings.model_copy(
            update={"approval_public_keys_file": pair.keys / "public-both.json"}
        ),
        dsn=pair.dsn,
    )
    await pair.deliver()
    found = await review(pair, proposal.digest)
    assert found is not None
    assert found.outcome == "committed"
    assert await row(pair.dsn, PENDING, proposal.digest) == ("committed",)
