"""WaitForOutcome honours a short client deadline (real gRPC, mTLS, Postgres)."""

from __future__ import annotations

import asyncio

import pytest

from tests.harness import INITIAL, USER, Ledger, Pki, client, new_thread_id
from ztate.worker_sdk import AwaitingApproval


async def test_a_deadline_under_the_margin_answers_pending_at_once(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(target, pki.node("planner")) as planner:
        with pytest.raises(AwaitingApproval) as parked:
            await planner.propose(thread_id, 0, {"target_user_id": USER.replace("1", "2")})
        # 0.15 s leaves the server no patience (it answers 0.2 s early): it must answer
        # "pending" now, not wait its 60-second maximum past the caller's deadline.
        loop = asyncio.get_running_loop()
        began = loop.time()
        outcome = await planner.wait_for_outcome(parked.value, within=0.15)
        assert outcome.status == "pending"
        assert outcome.transition is None
        assert loop.time() - began < 0.15
    assert (await ledger.snapshot(thread_id)).head_version == 0
