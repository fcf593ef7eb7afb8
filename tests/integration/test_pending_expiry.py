"""Parked transitions nobody decides on are closed as expired, and the proposer
waiting on one learns it."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import asyncpg
import pytest

from tests.harness import INITIAL, Pki, as_operator_sees_it, client, new_thread_id
from ztate.services.store.approvals import ApprovalStore
from ztate.transition_service.app import RunningService
from ztate.transition_service.outbox import ApprovalOutbox
from ztate.worker_sdk import AwaitingApproval

OTHER_USER = "9b2f5d0e-1c3a-4e6b-8d7f-0a1b2c3d4e5f"


async def test_an_overdue_parked_transition_expires_and_its_waiter_wakes(
    target: str, pki: Pki, service: RunningService, database_dsn: str
) -> None:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(target, pki.node("planner")) as planner:
        with pytest.raises(AwaitingApproval) as parked:
            await planner.propose(thread_id, 0, {"target_user_id": OTHER_USER})
        waiting = asyncio.create_task(planner.wait_for_outcome(parked.value, within=30))
        # An outbox whose time-to-live has passed for everything parked before now.
        outbox = ApprovalOutbox(
            approvals=ApprovalStore(service.store.pool),
            channel=None,
            wake=asyncio.Event(),
            interval=60,
            pending_ttl=timedelta(0),
        )
        await outbox.run_once()
        outcome = await waiting
    assert (outcome.status, outcome.transition) == ("expired", None)
    conn = await asyncpg.connect(database_dsn)
    try:
        row = await conn.fetchrow(
            "SELECT status, decided_at FROM ztate.pending_transitions WHERE digest = $1",
            (await as_operator_sees_it(database_dsn, parked.value)).digest,
        )
        head = await conn.fetchval(
            "SELECT version FROM ztate.threads WHERE thread_id = $1", thread_id
        )
    finally:
        await conn.close()
    assert row["status"] == "expired"
    assert row["decided_at"] is not None  # recorded
    assert head == 0
