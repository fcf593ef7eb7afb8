"""Removing a key (a null member) is a change like any other: invariants written over
the state keep holding, and narrowing permissions needs no approval."""

from __future__ import annotations

import pytest

from tests.harness import INITIAL, Ledger, Pki, client, new_thread_id
from ztate.worker_sdk import AwaitingApproval

PLAN = {"action": "refund", "order_id": "A-42", "amount_cents": 1200}


async def test_an_approval_can_be_withdrawn_and_permissions_dropped(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(
            thread_id,
            {**INITIAL, "execution_permissions": ["read_orders", "refund"]},
            policy="pipeline",
        )
    async with client(target, pki.node("planner")) as planner:
        await planner.propose(thread_id, 0, {"pending_transition": PLAN})
    async with client(target, pki.node("approval-gate")) as gate:
        approved = await gate.propose(thread_id, 1, {"approved_action": PLAN})
        withdrawn = await gate.propose(thread_id, approved.version, {"approved_action": None})
        narrowed = await gate.propose(
            thread_id, withdrawn.version, {"execution_permissions": ["read_orders"]}
        )
        dropped = await gate.propose(thread_id, narrowed.version, {"execution_permissions": None})
    async with client(target, pki.operator()) as operator:
        view = await operator.get_view(thread_id)
    assert dropped.version == 5
    assert "approved_action" not in view.state
    assert "execution_permissions" not in view.state
    assert await ledger.verify(thread_id) == 6


async def test_widening_after_a_drop_still_needs_approval(target: str, pki: Pki) -> None:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(
            thread_id, {**INITIAL, "execution_permissions": ["read_orders"]}, policy="pipeline"
        )
    async with client(target, pki.node("approval-gate")) as gate:
        await gate.propose(thread_id, 0, {"execution_permissions": None})
        with pytest.raises(AwaitingApproval) as parked:
            await gate.propose(thread_id, 1, {"execution_permissions": ["read_orders"]})
    # approval-gate is not marked read_records: the rule it matched is told to reviewers
    assert parked.value.risk_rules == ()
