"""``NodeRunner.serve``: a proposal parked for approval does not hold one of the
runner's ``concurrency`` slots while a reviewer decides (real gRPC, mTLS, Postgres; a
service of its own on a database of its own, so that the planner's work is only this
test's threads). The service released the lease when it parked the proposal; holding
the slot kept a node at concurrency 1 from all other work for ``approval_wait``."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path
from typing import Any

from tests.harness import (
    INITIAL,
    USER,
    Ledger,
    Pki,
    act,
    as_operator_sees_it,
    client,
    new_thread_id,
)
from tests.integration.test_watch_limits import eventually
from ztate import worker_sdk
from ztate.contract.keyring import Keyring, generate_signing_key
from ztate.services.runtime.config import Settings
from ztate.testing._approval import deliver_approval
from ztate.testing._ledger import fresh_database
from ztate.transition_service.app import start
from ztate.v1 import transition_pb2
from ztate.worker_sdk import (
    AwaitingApproval,
    NodeRunner,
    ServeOptions,
    Step,
    SyncZtateClient,
    View,
)

OTHER_USER = USER.replace("1", "2")


async def test_a_parked_proposal_frees_its_slot_and_its_outcome_is_still_recorded(
    settings: Settings, postgres_server_dsn: str, pki: Pki, keyring: Keyring, tmp_path: Path
) -> None:
    dsn = await fresh_database(postgres_server_dsn)
    signing, public = tmp_path / "approval-signing.pem", tmp_path / "approval-public.json"
    generate_signing_key(signing, public, "approval-k1")
    running = await start(
        settings.model_copy(update={"listen": "127.0.0.1:0", "approval_public_keys_file": public}),
        dsn=dsn,
    )
    ledger = Ledger(dsn, keyring)
    target = f"localhost:{running.port}"
    risky, plain = new_thread_id(), new_thread_id()
    handled: list[tuple[str, int]] = []
    parked = asyncio.Event()
    proposals: list[AwaitingApproval] = []
    steps: list[Step] = []

    def plan(view: View) -> dict[str, Any]:
        handled.append((view.thread_id, view.version))
        if view.thread_id == risky:  # acting for another user: parked for a reviewer
            return {"target_user_id": OTHER_USER}
        return {"pending_transition": {"action": "lookup", "order_id": "P-1"}}

    def on_parked(proposal: AwaitingApproval) -> None:
        proposals.append(proposal)
        parked.set()

    try:
        async with client(target, pki.operator()) as operator:
            await operator.create_thread(risky, INITIAL, policy="pipeline")
            await operator.create_thread(plain, INITIAL, policy="pipeline")
        async with (
            client(target, pki.node("input-parser")) as parser,
            client(target, pki.node("planner")) as planner,
        ):
            runner = NodeRunner.for_node(
                planner,
                plan,
                node_name="planner",
                concurrency=1,
                approval_wait=60.0,
                shutdown_grace=1.0,
                on_parked=on_parked,
                on_step=steps.append,
            )
            stop = asyncio.Event()
            serving = asyncio.create_task(runner.serve(stop))
            try:
                await parser.propose(risky, 0, {"requested_action": act("R-1")})
                await asyncio.wait_for(parked.wait(), 15)
                # the one slot is free again: the other thread's work is handled while
                # the risky proposal waits for its reviewer (60 s)
                await parser.propose(plain, 0, {"requested_action": act("P-1")})
                await eventually(lambda: _head_is(ledger, plain, 2), within=10)
                assert (await ledger.snapshot(risky)).head_version == 1  # still parked
                assert [s.status for s in steps] == ["committed"]
                # the decision commits the parked proposal: its wait records it
                digest = (await as_operator_sees_it(dsn, proposals[0])).digest
                applied = await deliver_approval(target, pki, signing, digest, risky, 1)
                assert applied.outcome == transition_pb2.OUTCOME_COMMITTED, applied
                await eventually(lambda: _recorded(steps, 2), within=10)
            finally:
                stop.set()
            await asyncio.wait_for(serving, 15)
    finally:
        await running.stop(grace=1.0)
    assert [(s.thread_id, s.view_version, s.status) for s in steps] == [
        (plain, 1, "committed"),
        (risky, 1, "committed"),
    ]
    assert steps[1].transition is not None
    assert steps[1].transition.version == 2
    # each thread handled once: the approved commit is the planner's own (no wake)
    assert sorted(handled) == sorted([(risky, 1), (plain, 1)])
    assert (await ledger.snapshot(risky)).head_version == 2


async def test_a_parked_wait_cut_short_by_shutdown_is_recorded_pending(
    settings: Settings, postgres_server_dsn: str, pki: Pki, keyring: Keyring
) -> None:
    """Stopping does not wait for a reviewer: the parked wait ends at once, recorded
    "pending", and nothing is committed."""
    dsn = await fresh_database(postgres_server_dsn)
    running = await start(settings.model_copy(update={"listen": "127.0.0.1:0"}), dsn=dsn)
    ledger = Ledger(dsn, keyring)
    target = f"localhost:{running.port}"
    risky = new_thread_id()
    parked = asyncio.Event()
    steps: list[Step] = []
    try:
        async with client(target, pki.operator()) as operator:
            await operator.create_thread(risky, INITIAL, policy="pipeline")
        async with (
            client(target, pki.node("input-parser")) as parser,
            client(target, pki.node("planner")) as planner,
        ):
            runner = NodeRunner.for_node(
                planner,
                lambda _view: {"target_user_id": OTHER_USER},
                node_name="planner",
                approval_wait=60.0,
                shutdown_grace=30.0,
                on_parked=lambda _: parked.set(),
                on_step=steps.append,
            )
            stop = asyncio.Event()
            serving = asyncio.create_task(runner.serve(stop))
            try:
                await parser.propose(risky, 0, {"requested_action": act("R-2")})
                await asyncio.wait_for(parked.wait(), 15)
            finally:
                stop.set()
            # well within the grace and the approval wait: nothing is waited for
            await asyncio.wait_for(serving, 5)
    finally:
        await running.stop(grace=1.0)
    assert [(s.thread_id, s.view_version, s.status, s.transition) for s in steps] == [
        (risky, 1, "pending", None)
    ]
    assert (await ledger.snapshot(risky)).head_version == 1


async def test_parked_outcomes_are_waited_for_at_most_max_outcome_waits_at_once(
    settings: Settings, postgres_server_dsn: str, pki: Pki, keyring: Keyring, tmp_path: Path
) -> None:
    """Each parked proposal's wait is a WaitForOutcome call of up to ``approval_wait``;
    before, ``serve`` started one for every parked proposal, with no bound. With
    ``max_outcome_waits=1`` the first is waited for, the second, parked meanwhile, is
    recorded "pending" at once; the first is still recorded when it is decided."""
    dsn = await fresh_database(postgres_server_dsn)
    signing, public = tmp_path / "approval-signing.pem", tmp_path / "approval-public.json"
    generate_signing_key(signing, public, "approval-k1")
    running = await start(
        settings.model_copy(update={"listen": "127.0.0.1:0", "approval_public_keys_file": public}),
        dsn=dsn,
    )
    ledger = Ledger(dsn, keyring)
    target = f"localhost:{running.port}"
    first, second = new_thread_id(), new_thread_id()
    proposals: list[AwaitingApproval] = []
    steps: list[Step] = []
    try:
        async with client(target, pki.operator()) as operator:
            await operator.create_thread(first, INITIAL, policy="pipeline")
            await operator.create_thread(second, INITIAL, policy="pipeline")
        async with (
            client(target, pki.node("input-parser")) as parser,
            client(target, pki.node("planner")) as planner,
        ):
            runner = NodeRunner.for_node(
                planner,
                lambda _view: {"target_user_id": OTHER_USER},  # parked, every one
                node_name="planner",
                approval_wait=60.0,
                shutdown_grace=1.0,
                max_outcome_waits=1,
                on_parked=proposals.append,
                on_step=steps.append,
            )
            stop = asyncio.Event()
            serving = asyncio.create_task(runner.serve(stop))
            try:
                await parser.propose(first, 0, {"requested_action": act("W-1")})
                await eventually(lambda: _parked(proposals, 1), within=15)
                await parser.propose(second, 0, {"requested_action": act("W-2")})
                # well within approval_wait: the second is not waited for
                await eventually(lambda: _recorded(steps, 1), within=15)
                assert [(s.thread_id, s.status) for s in steps] == [(second, "pending")]
                digest = (await as_operator_sees_it(dsn, proposals[0])).digest
                applied = await deliver_approval(target, pki, signing, digest, first, 1)
                assert applied.outcome == transition_pb2.OUTCOME_COMMITTED, applied
                await eventually(lambda: _recorded(steps, 2), within=10)
            finally:
                stop.set()
            await asyncio.wait_for(serving, 15)
    finally:
        await running.stop(grace=1.0)
    assert [(s.thread_id, s.view_version, s.status) for s in steps] == [
        (second, 1, "pending"),
        (first, 1, "committed"),
    ]
    assert steps[0].digest == (proposals[1].digest or None)
    assert (await ledger.snapshot(second)).head_version == 1  # still parked, undecided


async def test_the_blocking_serve_takes_every_option_of_the_runner(
    settings: Settings, postgres_server_dsn: str, pki: Pki, keyring: Keyring
) -> None:
    """``SyncZtateClient.serve`` took node_name, concurrency and shutdown_grace only: a
    blocking worker could not bound its outcome waits, nor see its parked proposals or
    steps. With ``max_outcome_waits=0`` a parked proposal is recorded "pending" at once
    (well within ``approval_wait``), ``on_parked`` and ``on_step`` are called."""
    dsn = await fresh_database(postgres_server_dsn)
    running = await start(settings.model_copy(update={"listen": "127.0.0.1:0"}), dsn=dsn)
    ledger = Ledger(dsn, keyring)
    target = f"localhost:{running.port}"
    risky = new_thread_id()
    proposals: list[AwaitingApproval] = []
    steps: list[Step] = []
    stepped, stop = threading.Event(), threading.Event()

    def on_step(step: Step) -> None:
        steps.append(step)
        stepped.set()

    try:
        async with client(target, pki.operator()) as operator:
            await operator.create_thread(risky, INITIAL, policy="pipeline")
        creds = pki.node("planner")
        with SyncZtateClient.from_files(
            target, cert=creds.cert, key=creds.key, ca=creds.ca
        ) as planner:
            serving = asyncio.create_task(
                asyncio.to_thread(
                    planner.serve,
                    lambda _view: {"target_user_id": OTHER_USER},  # parked for a reviewer
                    stop=stop,
                    node_name="planner",
                    approval_wait=60.0,
                    shutdown_grace=1.0,
                    max_outcome_waits=0,
                    attempts=1,
                    on_parked=proposals.append,
                    on_step=on_step,
                )
            )
            try:
                async with client(target, pki.node("input-parser")) as parser:
                    await parser.propose(risky, 0, {"requested_action": act("S-1")})
                assert await asyncio.to_thread(stepped.wait, 15)
            finally:
                stop.set()
            returned = await asyncio.wait_for(serving, 15)
    finally:
        await running.stop(grace=1.0)
    assert [(s.thread_id, s.view_version, s.status) for s in steps] == [(risky, 1, "pending")]
    assert returned == steps
    assert [p.thread_id for p in proposals] == [risky]
    assert (await ledger.snapshot(risky)).head_version == 1  # parked, undecided


def test_the_serve_options_are_every_option_of_a_runner_that_serves() -> None:
    """One list (ServeOptions, public: docs/work.md names it) for NodeRunner.for_node and
    SyncZtateClient.serve: every NodeRunner field but those of a one-thread runner and
    its own state."""
    assert "ServeOptions" in worker_sdk.__all__
    own = {"client", "thread_id", "handler", "from_version", "steps"}
    fields = {f.name for f in dataclasses.fields(NodeRunner) if f.init} - own
    assert set(ServeOptions.__annotations__) == fields


async def _parked(proposals: list[AwaitingApproval], count: int) -> bool:
    return len(proposals) >= count


async def _head_is(ledger: Ledger, thread_id: str, version: int) -> bool:
    return (await ledger.snapshot(thread_id)).head_version == version


async def _recorded(steps: list[Step], count: int) -> bool:
    return len(steps) >= count
