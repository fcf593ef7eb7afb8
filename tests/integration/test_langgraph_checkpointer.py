"""The LangGraph checkpointer on ztate: LangGraph's own conformance suite for savers,
and a checkpoint altered in storage refused on load, never deserialised."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import asyncpg
import ormsgpack
import pytest
import pytest_asyncio
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.serde.jsonplus import EXT_CONSTRUCTOR_SINGLE_ARG, JsonPlusSerializer

from tests.harness import secure_channel
from ztate.contract.canonical import canonical_bytes, sha256_hex
from ztate.langgraph import (
    CHECKPOINTER_NODE,
    CheckpointNotVerified,
    ZtateCheckpointSaver,
    checkpoint_policy,
    ledger_thread_id,
)
from ztate.langgraph import checkpointer as checkpointer_module
from ztate.testing import ZtateEnvironment
from ztate.v1 import transition_pb2, transition_pb2_grpc


@pytest_asyncio.fixture(scope="module")
async def env(postgres_server_dsn: str) -> AsyncIterator[ZtateEnvironment]:
    async with ZtateEnvironment.start(
        checkpoint_policy(), postgres_dsn=postgres_server_dsn, max_patch_bytes=1024 * 1024
    ) as started:
        yield started


def saver_of(env: ZtateEnvironment, **kwargs: object) -> ZtateCheckpointSaver:
    return ZtateCheckpointSaver(env.client(CHECKPOINTER_NODE), env.operator(), **kwargs)  # type: ignore[arg-type]


async def test_langgraph_conformance_suite_passes(env: ZtateEnvironment) -> None:
    @checkpointer_test(name="ZtateCheckpointSaver")
    async def factory() -> AsyncGenerator[ZtateCheckpointSaver, None]:
        yield saver_of(env)

    report = await validate(factory)
    failures = {
        name: result.failures for name, result in report.results.items() if result.passed is False
    }
    assert failures == {}
    for base in ("put", "put_writes", "get_tuple", "list", "delete_thread"):
        assert report.results[base].passed is True, base


class Refused(JsonPlusSerializer):
    """A serialiser that records what it was asked to deserialise."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[bytes] = []

    def loads_typed(self, data: tuple[str, bytes]) -> object:
        self.loaded.append(data[1])
        return super().loads_typed(data)


async def one_checkpoint(env: ZtateEnvironment) -> tuple[dict[str, Any], str]:
    """A new thread holding one checkpoint: its config and its ledger thread."""
    thread = str(uuid4())
    config: dict[str, Any] = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"] = {"answer": "refund 12.99"}
    await saver_of(env).aput(config, checkpoint, {"step": 0}, {})  # type: ignore[arg-type]
    return config, ledger_thread_id(thread)


async def first_record(conn: asyncpg.Connection, ledger_id: str) -> bytes:
    """The stored bytes of the checkpoint's record (version 1)."""
    return bytes(
        await conn.fetchval(
            "SELECT record FROM ztate.transitions WHERE thread_id = $1 AND version = 1",
            ledger_id,
        )
    )


async def test_a_checkpoint_altered_in_storage_is_refused_before_deserialising(
    env: ZtateEnvironment,
) -> None:
    config, ledger_id = await one_checkpoint(env)

    # an attacker with write access to the database edits the stored record
    conn = await asyncpg.connect(env.database_dsn)
    try:
        await conn.execute("SET session_replication_role = replica")  # past the triggers
        body = await first_record(conn, ledger_id)
        # flip one character of the serialised checkpoint inside the entry
        at = body.index(b'\\"checkpoint\\":[\\"') + 40
        forged = body[:at] + (b"A" if body[at : at + 1] != b"A" else b"B") + body[at + 1 :]
        await conn.execute(
            "UPDATE ztate.transitions SET record = $2 WHERE thread_id = $1 AND version = 1",
            ledger_id,
            forged,
        )
    finally:
        await conn.close()

    serde = Refused()
    fresh = saver_of(env, serde=serde)
    with pytest.raises(CheckpointNotVerified) as refused:
        await fresh.aget_tuple(config)  # type: ignore[arg-type]
    assert refused.value.check == "record.digest"
    assert (refused.value.thread_id, refused.value.version) == (ledger_id, 1)
    assert serde.loaded == []  # nothing of the altered record reached the serialiser


async def test_a_record_rewritten_consistently_in_storage_runs_no_code_on_load(
    env: ZtateEnvironment, tmp_path: Path
) -> None:
    """An attacker who can write the database rewrites a head record whole (its bytes,
    digest and the thread's head digest), which the saver's keyless checks cannot tell,
    with a metadata payload naming a function to call. LangGraph's default serialiser
    would import and call it on load; the saver's default constructs only safe types."""
    config, ledger_id = await one_checkpoint(env)
    planted = tmp_path / "made-by-the-payload"
    payload = ormsgpack.packb(
        ormsgpack.Ext(EXT_CONSTRUCTOR_SINGLE_ARG, ormsgpack.packb(["os", "makedirs", str(planted)]))
    )
    conn = await asyncpg.connect(env.database_dsn)
    try:
        await conn.execute("SET session_replication_role = replica")  # past the triggers
        record = json.loads(await first_record(conn, ledger_id))
        entry = json.loads(record["patch"]["entry"])
        entry["metadata"] = ["msgpack", base64.b64encode(payload).decode()]
        record["patch"]["entry"] = json.dumps(entry, separators=(",", ":"))
        forged = canonical_bytes(record)
        await conn.execute(
            "UPDATE ztate.transitions SET record = $2, digest = $3 "
            "WHERE thread_id = $1 AND version = 1",
            ledger_id,
            forged,
            sha256_hex(forged),
        )
        await conn.execute(
            "UPDATE ztate.threads SET head_digest = $2 WHERE thread_id = $1",
            ledger_id,
            sha256_hex(forged),
        )
    finally:
        await conn.close()
    found = await saver_of(env).aget_tuple(config)  # type: ignore[arg-type]
    assert found is not None  # the keyless checks pass: the rewrite is whole
    assert not planted.exists()  # and no code named by the payload ran


async def test_every_checkpoint_is_a_signed_chained_record_and_sync_calls_work(
    env: ZtateEnvironment,
) -> None:
    thread = str(uuid4())
    saver = saver_of(env)
    config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    first = empty_checkpoint()
    stored = await asyncio.to_thread(saver.put, config, first, {"step": 0}, {})  # type: ignore[arg-type]
    second = empty_checkpoint()
    await asyncio.to_thread(saver.put, stored, second, {"step": 1}, {})
    found = await asyncio.to_thread(saver.get_tuple, {"configurable": {"thread_id": thread}})
    assert found is not None
    assert found.checkpoint["id"] == second["id"]
    assert found.parent_config is not None
    assert found.parent_config["configurable"]["checkpoint_id"] == first["id"]
    # genesis and one record per checkpoint, each verified with the HMAC keyring
    assert await env.ledger.verify(ledger_thread_id(thread)) == 3
    rows = await env.ledger.rows(ledger_thread_id(thread))
    assert {row["node_id"] for row in rows[1:]} == {f"spiffe://ztate.test/node/{CHECKPOINTER_NODE}"}

    await saver.adelete_thread(thread)
    assert await saver.aget_tuple({"configurable": {"thread_id": thread}}) is None  # type: ignore[arg-type]
    assert await env.ledger.verify(ledger_thread_id(thread)) == 4  # the deletion is a record


async def test_a_state_graph_runs_and_resumes_on_the_ztate_saver(env: ZtateEnvironment) -> None:
    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph

    class State(TypedDict):
        count: int

    def step(state: State) -> State:
        return {"count": state["count"] + 1}

    builder = StateGraph(State)
    builder.add_node("step", step)
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    graph = builder.compile(checkpointer=saver_of(env))
    config = {"configurable": {"thread_id": str(uuid4())}}
    assert await graph.ainvoke({"count": 1}, config) == {"count": 2}  # type: ignore[arg-type]
    # a new saver (another process) resumes from the ledger
    again = builder.compile(checkpointer=saver_of(env))
    snapshot = await again.aget_state(config)  # type: ignore[arg-type]
    assert snapshot.values == {"count": 2}
    assert await env.ledger.verify(ledger_thread_id(config["configurable"]["thread_id"])) > 2


async def test_a_deleted_thread_pruned_keeps_its_bodies_only_in_the_signed_records(
    env: ZtateEnvironment,
) -> None:
    """A deletion is a signed record plus pruned bodies: after ``delete_thread`` and
    ``ztate ledger prune``, no state copy holds a checkpoint, the saver serves none, and
    every record and digest stays and verifies. The records' own patches still hold the
    bodies (the digest covers them): the residual gap stated in docs/langgraph.md."""
    from ztate.services.store.retention import Limits, prune

    thread = str(uuid4())
    ledger_id = ledger_thread_id(thread)
    saver = saver_of(env)
    config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    for step in range(2):
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"answer": f"refund {step}"}
        config = await saver.aput(config, checkpoint, {"step": step}, {})  # type: ignore[arg-type]
    await saver.adelete_thread(thread)

    assert await prune(env.database_dsn, Limits(keep_versions=1), thread_id=ledger_id) == 3
    rows = await env.ledger.rows(ledger_id)
    assert [row["state"] is None for row in rows] == [True, True, True, False]
    head_entry = json.loads(json.loads(rows[-1]["state"])["entry"])
    assert head_entry["kind"] == "delete"
    assert "checkpoint" not in head_entry
    assert await saver_of(env).aget_tuple(config) is None  # type: ignore[arg-type]
    assert await env.ledger.verify(ledger_id) == 4

    # the residual gap: the signed records still carry the bodies in their patches
    record = await env.ledger.record(ledger_id, 1)
    assert json.loads(record["patch"]["entry"])["kind"] == "checkpoint"


async def test_concurrent_reads_and_writes_of_one_thread_raise_no_false_alarm(
    env: ZtateEnvironment,
) -> None:
    """A new saver extends its verified chain from several calls at once. Before, they
    extended it without the thread's lock: a reader checked a record against a parent
    another had just appended and raised CheckpointNotVerified (record.parent), and a
    put racing reads failed the same way."""
    thread = str(uuid4())
    config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    for step in range(4):
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"step": step}
        config = await saver_of(env).aput(config, checkpoint, {"step": step}, {})  # type: ignore[arg-type]
    fresh = saver_of(env)  # nothing verified yet

    async def put() -> object:
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"step": 4}
        return await fresh.aput(config, checkpoint, {"step": 4}, {})  # type: ignore[arg-type]

    found = await asyncio.gather(*(fresh.aget_tuple(config) for _ in range(4)), put())  # type: ignore[arg-type]

    assert all(t is not None for t in found[:4])
    assert [t.checkpoint["channel_values"] for t in found[:4]] == [{"step": 3}] * 4  # type: ignore[union-attr]
    latest = await fresh.aget_tuple({"configurable": {"thread_id": thread, "checkpoint_ns": ""}})  # type: ignore[arg-type]
    assert latest is not None
    assert latest.checkpoint["channel_values"] == {"step": 4}


async def test_a_deleted_threads_bodies_leave_the_savers_memory(env: ZtateEnvironment) -> None:
    """After delete_thread, the saver no longer holds the thread's checkpoints in its
    verified cache (they were kept there, decodable, for the saver's lifetime); only the
    digests that chain the next records stay."""
    thread = str(uuid4())
    saver = saver_of(env)
    config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"] = {"ssn": "123-45-6789"}
    config = await saver.aput(config, checkpoint, {"step": 0}, {})  # type: ignore[arg-type]
    await saver.adelete_thread(thread)

    assert await saver.aget_tuple(config) is None  # type: ignore[arg-type]
    chain = saver._chains[ledger_thread_id(thread)]
    assert [e and e["kind"] for e in chain.entries] == [None, None, "delete"]
    assert len(chain.digests) == 3


async def test_an_operators_revert_of_a_checkpoint_thread_is_refused_not_served(
    env: ZtateEnvironment,
) -> None:
    """An operator's revert restores an earlier entry as a new record: the saver read it
    as an append, so a revert after delete_thread served the deleted checkpoint again
    (found by review). A record of any kind but the checkpointer's own transitions is
    refused, naming the check."""
    thread = str(uuid4())
    saver = saver_of(env)
    config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    for secret in ("123-45-6789", "later"):
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"ssn": secret}
        config = await saver.aput(config, checkpoint, {"step": 0}, {})  # type: ignore[arg-type]
    await saver.adelete_thread(thread)
    ledger_id = ledger_thread_id(thread)
    creds = env.credentials("operator", "admin")
    async with secure_channel(env.target, creds) as channel:
        await transition_pb2_grpc.TransitionServiceStub(channel).RevertThread(
            transition_pb2.RevertThreadRequest(
                thread_id=ledger_id, to_version=1, idempotency_key="restore-1"
            )
        )
    root = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    for reader in (saver, saver_of(env)):  # the saver that wrote it, and a fresh one
        with pytest.raises(CheckpointNotVerified) as refused:
            await reader.aget_tuple(root)  # type: ignore[arg-type]
        assert refused.value.check == "record.kind"
        assert (refused.value.thread_id, refused.value.version) == (ledger_id, 4)


async def test_the_savers_memory_is_bounded_in_bytes_too(
    env: ZtateEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At most CACHED_BYTES of verified records are kept (1,024 threads of many large
    checkpoints were kept whole): past it, the least recently used threads' chains go,
    and are read and verified again when next used."""
    monkeypatch.setattr(checkpointer_module, "CACHED_BYTES", 1)
    saver = saver_of(env)
    threads = [str(uuid4()) for _ in range(3)]
    for thread in threads:
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"notes": "x" * 10_000}
        config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
        await saver.aput(config, checkpoint, {"step": 0}, {})  # type: ignore[arg-type]
        assert await saver.aget_tuple(config) is not None  # type: ignore[arg-type]
    # the one in use is always kept; the others went
    assert list(saver._chains) == [ledger_thread_id(threads[-1])]
    assert saver._cached_bytes == saver._chains[ledger_thread_id(threads[-1])].size > 10_000
    first = {"configurable": {"thread_id": threads[0], "checkpoint_ns": ""}}
    found = await saver.aget_tuple(first)  # type: ignore[arg-type]
    assert found is not None
    assert found.checkpoint["channel_values"] == {"notes": "x" * 10_000}
    assert list(saver._chains) == [ledger_thread_id(threads[0])]


async def test_a_sync_call_on_a_saver_whose_loop_is_not_running_is_refused_at_once(
    env: ZtateEnvironment,
) -> None:
    """A saver built for a loop that is not running (run_until_complete, say) waited
    for ever on a sync call from another thread; it is refused at once."""
    idle = asyncio.new_event_loop()
    try:
        saver = saver_of(env, loop=idle)
        config = {"configurable": {"thread_id": str(uuid4()), "checkpoint_ns": ""}}
        with pytest.raises(asyncio.InvalidStateError, match="not running"):
            # a bound, not a synchronisation: before, the call never returned
            await asyncio.wait_for(asyncio.to_thread(saver.get_tuple, config), 10)  # type: ignore[arg-type]
    finally:
        idle.close()


async def test_bad_ids_are_refused_on_the_way_in_and_none_is_the_root_namespace(
    env: ZtateEnvironment,
) -> None:
    """A checkpoint id that is no string was stored, then every later read of the thread
    raised TypeError (in new savers too); it is refused before anything is written. An
    explicit ``checkpoint_ns: None`` is the root namespace, as LangGraph's own savers read
    it (before: a subgraph's checkpoint was returned as the root's). delete_thread takes
    an id of any type as the other methods do (a UUID raised AttributeError)."""
    saver = saver_of(env)
    thread = uuid4()
    config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    good = empty_checkpoint()
    config = await saver.aput(config, good, {"step": 0}, {})  # type: ignore[arg-type]
    bad = empty_checkpoint()
    bad["id"] = 7  # type: ignore[typeddict-item]
    with pytest.raises(TypeError, match=r"^checkpoint id must be a string, not int$"):
        await saver.aput(config, bad, {"step": 1}, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^task_id must be a string, not int$"):
        await saver.aput_writes(config, [("channel", 1)], 7)  # type: ignore[arg-type]
    found = await saver_of(env).aget_tuple(config)  # type: ignore[arg-type]
    assert found is not None
    assert found.checkpoint["id"] == good["id"]
    rows = await env.ledger.rows(ledger_thread_id(str(thread)))
    assert len(rows) == 2  # genesis and the good put: nothing of the refused ones
    lone = {"configurable": {"thread_id": "t-\ud800", "checkpoint_ns": ""}}
    with pytest.raises(ValueError, match="lone surrogate"):  # was a bare UnicodeEncodeError
        await saver.aput(lone, good, {"step": 0}, {})  # type: ignore[arg-type]

    child = empty_checkpoint()
    sub = {"configurable": {"thread_id": str(uuid4()), "checkpoint_ns": "child:1"}}
    await saver.aput(sub, child, {"step": 0}, {})  # type: ignore[arg-type]
    root = {"configurable": {"thread_id": sub["configurable"]["thread_id"], "checkpoint_ns": None}}
    assert await saver.aget_tuple(root) is None  # type: ignore[arg-type]

    await saver.adelete_thread(thread)  # type: ignore[arg-type]
    assert await saver_of(env).aget_tuple(config) is None  # type: ignore[arg-type]


async def test_a_thread_id_another_workflow_holds_is_said_so(
    postgres_server_dsn: str,
) -> None:
    """Two checkpointer policies map the same LangGraph thread id to the same ledger
    thread; the second workflow cannot see the first's. Its put retried 32 rounds and
    failed with 'the head kept moving'; now at once, saying why."""
    first = checkpoint_policy(node="lg-a", name="lg-tenant-a")
    second = checkpoint_policy(node="lg-b", name="lg-tenant-b")
    async with ZtateEnvironment.start(
        [first, second], postgres_dsn=postgres_server_dsn, max_patch_bytes=1024 * 1024
    ) as two:
        a = ZtateCheckpointSaver(two.client("lg-a"), two.operator(), policy="lg-tenant-a")
        b = ZtateCheckpointSaver(two.client("lg-b"), two.operator(), policy="lg-tenant-b")
        config = {"configurable": {"thread_id": "user-42", "checkpoint_ns": ""}}
        await a.aput(config, empty_checkpoint(), {"step": 0}, {})  # type: ignore[arg-type]
        ledger_id = ledger_thread_id("user-42")
        with pytest.raises(LookupError) as refused:
            await b.aput(config, empty_checkpoint(), {"step": 0}, {})  # type: ignore[arg-type]
        assert str(refused.value) == (
            f"ledger thread {ledger_id} exists but not under policy 'lg-tenant-b': another "
            "workflow holds this LangGraph thread id"
        )
        assert len(await two.ledger.rows(ledger_id)) == 2  # genesis and a's put
