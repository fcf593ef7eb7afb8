"""WatchThread over real gRPC, mTLS and Postgres LISTEN/NOTIFY; and what a node may
read of records and checkpoints (GetTransition, GetCheckpoint)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.harness import INITIAL, USER, Ledger, Pki, act, client, new_thread_id
from ztate.contract.checkpoints import SignedCheckpoint, verify_checkpoint
from ztate.contract.keyring import Keyring
from ztate.services.runtime.config import Settings
from ztate.services.store.retention import Limits, prune
from ztate.transition_service import watch as watch_module
from ztate.transition_service.app import RunningService, start
from ztate.transition_service.checkpointer import Checkpointer
from ztate.transition_service.journal import CheckpointJournal
from ztate.v1 import transition_pb2
from ztate.worker_sdk import (
    AwaitingApproval,
    NotFound,
    PermissionDenied,
    SyncZtateClient,
    TooManyStreams,
    Unavailable,
    WatchEvent,
)

BILLING_INITIAL = {"invoice_total_cents": 100, "invoice_note": "n"}


async def new_thread(
    target: str, pki: Pki, policy: str = "pipeline", initial: dict[str, Any] = INITIAL
) -> str:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, initial, policy=policy)
    return thread_id


async def take(
    stream: AsyncIterator[WatchEvent], count: int, within: float = 10.0
) -> list[WatchEvent]:
    async def collect() -> list[WatchEvent]:
        return [await anext(stream) for _ in range(count)]

    return await asyncio.wait_for(collect(), within)


async def test_versions_arrive_in_order_first_the_past_then_live(target: str, pki: Pki) -> None:
    thread_id = await new_thread(target, pki)
    async with (
        client(target, pki.node("input-parser")) as parser,
        client(target, pki.operator()) as operator,
    ):
        await parser.propose(thread_id, 0, {"requested_action": act("one")})
        await parser.propose(thread_id, 1, {"requested_action": act("two")})
        stream = operator.watch(thread_id, from_version=-1)
        past = await take(stream, 3)
        assert [e.version for e in past] == [0, 1, 2]
        assert past[2].state is not None
        assert past[2].state["requested_action"] == act("two")
        # live: a commit after the stream caught up arrives, and only it
        await parser.propose(thread_id, 2, {"requested_action": act("three")})
        (live,) = await take(stream, 1)
        assert live.version == 3
        assert live.state is not None
        assert live.state["requested_action"] == act("three")
        view = await operator.get_view(thread_id)
        assert live.digest == view.head_digest
        await stream.aclose()


async def test_watching_from_a_version_sends_only_newer_ones(target: str, pki: Pki) -> None:
    thread_id = await new_thread(target, pki)
    async with client(target, pki.node("input-parser")) as parser:
        for version in range(3):
            await parser.propose(thread_id, version, {"requested_action": act(f"v{version}")})
        stream = parser.watch(thread_id, from_version=2)
        (first,) = await take(stream, 1)
        assert first.version == 3
        await stream.aclose()


async def test_a_node_never_sees_keys_it_may_not_read(target: str, pki: Pki) -> None:
    thread_id = await new_thread(target, pki)
    async with (
        client(target, pki.node("input-parser")) as parser,
        client(target, pki.node("planner")) as planner,
    ):
        parser_stream = parser.watch(thread_id)
        planner_stream = planner.watch(thread_id)
        await parser.propose(thread_id, 0, {"requested_action": act("secretive")})
        await planner.propose(thread_id, 1, {"pending_transition": act("plan")})
        seen_by_parser = await take(parser_stream, 3)
        seen_by_planner = await take(planner_stream, 3)
        await parser_stream.aclose()
        await planner_stream.aclose()
    # the parser reads raw_text only: not even what it wrote itself
    assert [e.state for e in seen_by_parser] == [{"raw_text": INITIAL["raw_text"]}] * 3
    for event in seen_by_planner:
        assert event.state is not None
        assert event.state.keys() <= {"requested_action", "authority", "target_user_id"}
    assert seen_by_planner[1].state == {
        "requested_action": act("secretive"),
        "authority": INITIAL["authority"],
        "target_user_id": USER,
    }


async def test_another_workflows_thread_and_an_unknown_one_are_not_found(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    billing = await new_thread(target, pki, "billing", BILLING_INITIAL)
    before = await ledger.snapshot(billing)
    async with client(target, pki.node("input-parser")) as parser:
        for thread_id in (billing, new_thread_id()):
            with pytest.raises(NotFound) as refused:
                await anext(parser.watch(thread_id))
            assert refused.value.reason == "THREAD_NOT_FOUND"
            assert refused.value.code is grpc.StatusCode.NOT_FOUND
            with pytest.raises(NotFound) as view_refused:
                await parser.get_view(thread_id)
            assert view_refused.value.message == refused.value.message  # exactly as GetView
    assert await ledger.snapshot(billing) == before


@pytest_asyncio.fixture
async def limited(settings: Settings, database_dsn: str) -> AsyncIterator[RunningService]:
    running = await start(settings.model_copy(update={"watch_max_streams": 2}), dsn=database_dsn)
    yield running
    await running.stop(grace=1.0)


async def test_streams_beyond_the_limit_are_refused_and_slots_come_back(
    limited: RunningService, pki: Pki, ledger: Ledger
) -> None:
    target = f"localhost:{limited.port}"
    thread_id = await new_thread(target, pki)
    before = await ledger.snapshot(thread_id)
    async with client(target, pki.node("planner")) as planner:
        first, second = planner.watch(thread_id), planner.watch(thread_id)
        await take(first, 1)
        await take(second, 1)
        with pytest.raises(TooManyStreams) as refused:
            await anext(planner.watch(thread_id))
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.reason == "TOO_MANY_STREAMS"
        assert refused.value.limit == 2
        await first.aclose()

        async def slot_freed() -> WatchEvent:
            while True:
                try:
                    return await anext(planner.watch(thread_id))
                except TooManyStreams:
                    await asyncio.sleep(0.05)  # the server sees the cancel shortly

        again = await asyncio.wait_for(slot_freed(), 10)
        assert again.version == 0
        await second.aclose()
    assert await ledger.snapshot(thread_id) == before


# --- what a node may read of records and checkpoints -----------------------------------


async def test_only_a_node_marked_read_records_reads_records_and_checkpoints(
    target: str, pki: Pki, service: RunningService, ledger: Ledger, tmp_path: Path
) -> None:
    thread_id = await new_thread(target, pki)
    async with (
        client(target, pki.node("approval-gate")) as gate,
        client(target, pki.node("planner")) as planner,
        client(target, pki.node("db-writer")) as writer,
    ):
        committed = await gate.propose(thread_id, 0, {"approval_receipt": "r-1"})
        signed = await Checkpointer(
            service.store,
            Ed25519PrivateKey.generate(),
            "ck-test",
            60,
            keyring=ledger.keyring,
            journal=CheckpointJournal(tmp_path / "journal.jsonl"),
        ).run_once()
        assert signed >= 1
        before = await ledger.snapshot(thread_id)
        # db-writer is marked read_records: true and may read approval_receipt
        found = await writer.get_record(thread_id)
        head = (await ledger.rows(thread_id))[-1]
        assert found.transition.version == committed.version
        assert found.transition.digest == head["digest"]
        assert found.transition.record_json == bytes(head["record"])
        assert found.receipt is None
        assert await writer.get_checkpoint(thread_id) is not None
        # the approval gate reads every key of that patch, but is not marked: the
        # record's state_digest would let it confirm guesses of raw_text
        for refused_call in (
            gate.get_record(thread_id),
            gate.get_record(thread_id, version=1),
            gate.get_transition(digest=head["digest"]),
            gate.get_checkpoint(thread_id),
            planner.get_record(thread_id),
            planner.get_checkpoint(thread_id),
        ):
            with pytest.raises(PermissionDenied) as refused:
                await refused_call
            assert refused.value.reason == "ROLE_FORBIDDEN"
            assert refused.value.message == ("this node may not read ledger records or checkpoints")
            assert refused.value.keys == ()
            assert head["digest"] not in str(refused.value)
    assert await ledger.snapshot(thread_id) == before


async def test_a_marked_node_reads_no_record_changing_keys_it_may_not_read(
    target: str, pki: Pki
) -> None:
    thread_id = await new_thread(target, pki)
    async with (
        client(target, pki.node("input-parser")) as parser,
        client(target, pki.node("db-writer")) as writer,
    ):
        await parser.propose(thread_id, 0, {"requested_action": act("r")})
        with pytest.raises(PermissionDenied) as refused:
            await writer.get_record(thread_id)
        assert refused.value.reason == "ROLE_FORBIDDEN"
        assert refused.value.keys == ()
        assert "requested_action" not in refused.value.message


async def test_a_node_reads_no_record_of_another_workflow(target: str, pki: Pki) -> None:
    billing = await new_thread(target, pki, "billing", BILLING_INITIAL)
    async with client(target, pki.operator()) as operator:
        genesis = await operator.get_record(billing, version=0)
    async with client(target, pki.node("db-writer")) as writer:
        with pytest.raises(NotFound) as by_thread:
            await writer.get_record(billing)
        assert by_thread.value.reason == "THREAD_NOT_FOUND"
        with pytest.raises(NotFound) as by_digest:
            await writer.get_transition(digest=genesis.transition.digest)
        assert by_digest.value.reason == "TRANSITION_NOT_FOUND"


async def test_checkpoints_are_served_to_the_threads_nodes_and_verify(
    target: str, pki: Pki, service: RunningService, keyring: Keyring, tmp_path: Path
) -> None:
    thread_id = await new_thread(target, pki)
    key = Ed25519PrivateKey.generate()
    async with client(target, pki.node("db-writer")) as writer:
        assert await writer.get_checkpoint(thread_id) is None
        journal = CheckpointJournal(tmp_path / "journal.jsonl")
        signer = Checkpointer(service.store, key, "ck-test", 60, keyring=keyring, journal=journal)
        signed = await signer.run_once()
        assert signed >= 1
        checkpoint = await writer.get_checkpoint(thread_id)
        view = await writer.get_view(thread_id)
    assert checkpoint is not None
    body = verify_checkpoint(
        SignedCheckpoint(checkpoint.checkpoint_json, checkpoint.signature, checkpoint.key_id),
        {"ck-test": key.public_key()},
    )
    assert (body["thread_id"], body["version"], body["head_digest"]) == (
        thread_id,
        view.version,
        view.head_digest,
    )
    assert datetime.fromisoformat(body["signed_at"].replace("Z", "+00:00")) <= datetime.now(UTC)


async def test_a_parked_proposal_is_not_a_version(target: str, pki: Pki, ledger: Ledger) -> None:
    thread_id = await new_thread(target, pki)
    async with (
        client(target, pki.node("planner")) as planner,
        client(target, pki.operator()) as operator,
    ):
        stream = operator.watch(thread_id, from_version=0)
        with pytest.raises(AwaitingApproval):
            await planner.propose(thread_id, 0, {"target_user_id": USER.replace("1", "2")})
        await planner.propose(thread_id, 0, {"pending_transition": act("p")})
        (event,) = await take(stream, 1)
        await stream.aclose()
    assert event.version == 1
    assert event.state is not None
    assert event.state["target_user_id"] == USER  # the parked change is not state
    assert (await ledger.snapshot(thread_id)).head_version == 1


async def test_commits_of_a_watched_thread_are_announced_and_the_watch_unregistered(
    target: str, pki: Pki, database_dsn: str
) -> None:
    thread_id = await new_thread(target, pki)
    conn = await asyncpg.connect(database_dsn)
    announced: asyncio.Queue[str] = asyncio.Queue()
    await conn.add_listener("ztate_commits", lambda *args: announced.put_nowait(args[3]))

    async def registered() -> int:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM ztate.watched_threads WHERE thread_id = $1", thread_id
        )
        return count

    try:
        async with client(target, pki.node("input-parser")) as parser:
            stream = parser.watch(thread_id)
            await take(stream, 1)  # the stream is open, so the thread is registered
            assert await registered() == 1
            await parser.propose(thread_id, 0, {"requested_action": act("heard")})
            assert await asyncio.wait_for(announced.get(), 10) == thread_id
            await stream.aclose()

            async def unregistered() -> None:
                while True:
                    if await registered() == 0:
                        return
                    await asyncio.sleep(0.05)  # the server ends the stream on the cancel

            await asyncio.wait_for(unregistered(), 10)
    finally:
        await conn.close()


async def test_the_blocking_client_watches_too(target: str, pki: Pki) -> None:
    thread_id = await new_thread(target, pki)
    creds = pki.node("input-parser")

    def work() -> list[int]:
        with SyncZtateClient.from_files(
            target, cert=creds.cert, key=creds.key, ca=creds.ca
        ) as worker:
            worker.propose(thread_id, 0, {"requested_action": act("sync")})
            versions = []
            for change in worker.watch(thread_id):
                versions.append(change.version)
                if change.version == 1:
                    break
            return versions

    assert await asyncio.to_thread(work) == [0, 1]


async def test_stopping_the_server_ends_open_streams_instead_of_waiting_on_them(
    settings: Settings, database_dsn: str, pki: Pki
) -> None:
    running = await start(settings, dsn=database_dsn)
    target = f"localhost:{running.port}"
    thread_id = await new_thread(target, pki)
    async with client(target, pki.node("planner")) as planner:
        stream = planner.watch(thread_id, reconnects=0)
        await take(stream, 1)
        # the grace period is a minute; the open stream must not hold the stop that long
        await asyncio.wait_for(running.stop(grace=60), 15)
        with pytest.raises(Unavailable):
            await asyncio.wait_for(anext(stream), 15)


async def test_a_version_whose_state_was_pruned_says_so(
    target: str, pki: Pki, database_dsn: str
) -> None:
    thread_id = await new_thread(target, pki)
    async with (
        client(target, pki.node("input-parser")) as parser,
        client(target, pki.node("planner")) as planner,
    ):
        await parser.propose(thread_id, 0, {"requested_action": act("old")})
        await parser.propose(thread_id, 1, {"requested_action": act("new")})
        assert await prune(database_dsn, Limits(keep_versions=1), thread_id=thread_id) == 2
        events = await take(planner.watch(thread_id), 3)
    assert [(e.version, e.state is None) for e in events] == [(0, True), (1, True), (2, False)]
    assert events[2].state is not None
    assert events[2].state["requested_action"] == act("new")
    assert events[0].as_view() is None


async def test_an_unexpected_failure_mid_stream_is_internal_and_discloses_nothing(
    target: str, pki: Pki, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    sentinel = "SENTINEL-state-value-7f3a"
    thread_id = await new_thread(target, pki)
    async with client(target, pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 0, {"requested_action": act("one")})
    before = await ledger.snapshot(thread_id)
    projected = watch_module.project

    def project_then_fail(*args: Any) -> Any:
        found = args[1]
        if found.version >= 1:
            raise RuntimeError(sentinel)
        return projected(*args)

    monkeypatch.setattr(watch_module, "project", project_then_fail)
    async with client(target, pki.operator()) as operator:
        call = operator._stub.WatchThread(
            transition_pb2.WatchThreadRequest(thread_id=thread_id, from_version=-1)
        )
        received: list[int] = []

        async def drain() -> None:
            async for message in call:
                received.append(message.version)

        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await drain()
    assert received == [0]  # the stream was open when it failed
    assert failed.value.code() is grpc.StatusCode.INTERNAL
    assert failed.value.details() == "internal error"
    trailers = repr(failed.value.trailing_metadata())
    assert sentinel not in (failed.value.details() or "")
    assert sentinel not in trailers
    assert "RuntimeError" not in trailers
    assert await ledger.snapshot(thread_id) == before
