"""WaitForOutcome honours a short client deadline (real gRPC, mTLS, Postgres)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.harness import INITIAL, USER, Ledger, Pki, as_operator_sees_it, client, new_thread_id
from ztate.contract.keyring import generate_signing_key
from ztate.services.runtime.config import Settings
from ztate.testing._approval import deliver_approval
from ztate.transition_service import decisions
from ztate.transition_service.app import start
from ztate.v1 import transition_pb2
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


async def test_a_wait_longer_than_the_servers_cap_asks_again_until_decided(
    settings: Settings,
    database_dsn: str,
    pki: Pki,
    ledger: Ledger,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The service holds one WaitForOutcome call at most MAX_WAIT_SECONDS (60 s; 0.5 s
    in this service of its own): ``wait_for_outcome(within=...)`` asks again until
    ``within`` has passed, so a decision after the cap is still seen (it answered
    "pending" at the cap: a LangGraph run with approval_wait=300 gave up after 60 s)."""
    monkeypatch.setattr(decisions, "MAX_WAIT_SECONDS", 0.5)
    signing, public = tmp_path / "approval-signing.pem", tmp_path / "approval-public.json"
    generate_signing_key(signing, public, "approval-k1")
    running = await start(
        settings.model_copy(update={"listen": "127.0.0.1:0", "approval_public_keys_file": public}),
        dsn=database_dsn,
    )
    try:
        target = f"localhost:{running.port}"
        thread_id = new_thread_id()
        async with client(target, pki.operator()) as operator:
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        async with client(target, pki.node("planner")) as planner:
            with pytest.raises(AwaitingApproval) as parked:
                await planner.propose(thread_id, 0, {"target_user_id": USER.replace("1", "2")})
            loop = asyncio.get_running_loop()
            began = loop.time()
            outcome = await planner.wait_for_outcome(parked.value, within=2.0)
            assert outcome.status == "pending"
            assert loop.time() - began >= 1.5  # not the 0.5 s of one call
            waiting = asyncio.create_task(planner.wait_for_outcome(parked.value, within=20))
            done, _ = await asyncio.wait({waiting}, timeout=1.5)
            assert not done, waiting.result()  # past the cap of a call: still waiting
            digest = (await as_operator_sees_it(database_dsn, parked.value)).digest
            applied = await deliver_approval(target, pki, signing, digest, thread_id, 0)
            assert applied.outcome == transition_pb2.OUTCOME_COMMITTED
            outcome = await asyncio.wait_for(waiting, 10)
        assert outcome.status == "committed"
        assert outcome.transition is not None
        assert outcome.transition.version == 1
    finally:
        await running.stop(grace=1.0)
    assert (await ledger.snapshot(thread_id)).head_version == 1
