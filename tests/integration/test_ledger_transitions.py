"""Operators list transitions by thread, node, changed key, status and time, open
one record with its patch and state, and follow one key across a thread; only
operators may, over real mTLS, and the queries run on a role that can only read."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import grpc
import pytest
import pytest_asyncio
from google.protobuf import timestamp_pb2

from tests.harness import (
    INITIAL,
    Credentials,
    Ledger,
    Pki,
    act,
    as_operator_sees_it,
    client,
    new_thread_id,
    secure_channel,
)
from ztate.v1 import ledger_pb2, ledger_pb2_grpc
from ztate.worker_sdk import AwaitingApproval
from ztate.worker_sdk.errors import from_rpc_error

PARSER = "spiffe://ztate.test/node/input-parser"
PLANNER = "spiffe://ztate.test/node/planner"
PLAN = {"action": "refund", "order_id": "A-42", "amount_cents": 500}


@dataclass(frozen=True)
class History:
    thread_id: str
    # digests by version, 0..4
    digests: list[str]
    parked_digest: str


@pytest_asyncio.fixture(scope="module")
async def history(target: str, pki: Pki, ledger: Ledger) -> History:
    """Genesis, parser sets requested_action twice, planner plans, parser removes
    requested_action; then the planner's change of target_user_id is parked."""
    thread_id = new_thread_id()
    digests: list[str] = []
    async with client(target, pki.operator()) as operator:
        digests.append((await operator.create_thread(thread_id, INITIAL, policy="pipeline")).digest)
    async with client(target, pki.node("input-parser")) as parser:
        digests.append((await parser.propose(thread_id, 0, {"requested_action": act("a")})).digest)
        digests.append((await parser.propose(thread_id, 1, {"requested_action": act("b")})).digest)
    async with client(target, pki.node("planner")) as planner:
        digests.append((await planner.propose(thread_id, 2, {"pending_transition": PLAN})).digest)
    async with client(target, pki.node("input-parser")) as parser:
        digests.append((await parser.propose(thread_id, 3, {"requested_action": None})).digest)
    async with client(target, pki.node("planner")) as planner:
        with pytest.raises(AwaitingApproval) as parked:
            await planner.propose(
                thread_id, 4, {"target_user_id": "00000000-0000-4000-8000-000000000001"}
            )
    # the nodes were told versions only (digests commit to keys they may not read):
    # the digests are the operator's, from the ledger
    digests[1:] = [row["digest"] for row in await ledger.rows(thread_id)][1:]
    told = await as_operator_sees_it(ledger.dsn, parked.value)
    return History(thread_id, digests, told.digest)


@pytest_asyncio.fixture
async def stub(target: str, pki: Pki) -> AsyncIterator[ledger_pb2_grpc.LedgerServiceStub]:
    async with secure_channel(target, pki.operator()) as open_channel:
        yield ledger_pb2_grpc.LedgerServiceStub(open_channel)


async def entries(
    stub: ledger_pb2_grpc.LedgerServiceStub, **filters: Any
) -> list[ledger_pb2.LedgerEntry]:
    response = await stub.ListTransitions(ledger_pb2.ListTransitionsRequest(**filters))
    return list(response.entries)


def stamp(moment: datetime) -> timestamp_pb2.Timestamp:
    found = timestamp_pb2.Timestamp()
    found.FromDatetime(moment)
    return found


async def test_lists_a_thread_newest_first(
    stub: ledger_pb2_grpc.LedgerServiceStub, history: History
) -> None:
    listed = await entries(stub, thread_id=history.thread_id)
    assert [e.version for e in listed] == [4, 3, 2, 1, 0]
    assert [e.digest for e in listed] == history.digests[::-1]
    assert [e.kind for e in listed] == ["transition"] * 4 + ["genesis"]
    assert {e.status for e in listed} == {"committed"}
    assert list(listed[0].changed_keys) == ["requested_action"]
    assert list(listed[-1].changed_keys) == sorted(INITIAL)
    assert [e.parent_digest for e in listed[:-1]] == history.digests[:-1][::-1]
    assert not any(e.has_receipt for e in listed)


async def test_filters_by_node_and_changed_key(
    stub: ledger_pb2_grpc.LedgerServiceStub, history: History
) -> None:
    thread = history.thread_id
    by_parser = await entries(stub, thread_id=thread, node_id=PARSER)
    assert [e.version for e in by_parser] == [4, 2, 1]
    touching = await entries(stub, thread_id=thread, changed_key="requested_action")
    assert [e.version for e in touching] == [4, 2, 1]
    assert [e.version for e in await entries(stub, thread_id=thread, changed_key="raw_text")] == [0]
    planned = await entries(
        stub, thread_id=thread, node_id=PLANNER, changed_key="pending_transition"
    )
    assert [e.version for e in planned] == [3]
    assert await entries(stub, thread_id=thread, node_id=PLANNER, changed_key="raw_text") == []
    # across every thread: each entry matches, and this thread's are among them
    everywhere = await entries(
        stub, node_id=PLANNER, changed_key="pending_transition", page_size=1000
    )
    assert {e.node_id for e in everywhere} == {PLANNER}
    assert all("pending_transition" in e.changed_keys for e in everywhere)
    assert history.digests[3] in {e.digest for e in everywhere}


async def test_filters_by_time(stub: ledger_pb2_grpc.LedgerServiceStub, history: History) -> None:
    thread = history.thread_id
    past, future = datetime.now(UTC) - timedelta(hours=1), datetime.now(UTC) + timedelta(hours=1)
    assert await entries(stub, thread_id=thread, since=stamp(future)) == []
    assert await entries(stub, thread_id=thread, until=stamp(past)) == []
    assert len(await entries(stub, thread_id=thread, since=stamp(past))) == 5
    middle = (await entries(stub, thread_id=thread))[2].at.ToDatetime(tzinfo=UTC)
    assert [e.version for e in await entries(stub, thread_id=thread, until=stamp(middle))] == [
        1,
        0,
    ]
    assert [e.version for e in await entries(stub, thread_id=thread, since=stamp(middle))] == [
        4,
        3,
        2,
    ]


async def test_parked_proposals_are_listed_by_status(
    stub: ledger_pb2_grpc.LedgerServiceStub, history: History
) -> None:
    parked = await entries(stub, thread_id=history.thread_id, status="pending")
    assert [(e.digest, e.version, e.kind, e.status) for e in parked] == [
        (history.parked_digest, 5, "proposal", "pending")
    ]
    assert list(parked[0].changed_keys) == ["target_user_id"]
    assert parked[0].parent_digest == history.digests[4]
    assert await entries(stub, thread_id=history.thread_id, status="expired") == []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await entries(stub, status="approved")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_keyset_pagination_visits_each_transition_once(
    stub: ledger_pb2_grpc.LedgerServiceStub, history: History
) -> None:
    seen: list[str] = []
    token = ""
    while True:
        response = await stub.ListTransitions(
            ledger_pb2.ListTransitionsRequest(
                thread_id=history.thread_id, page_size=2, page_token=token
            )
        )
        seen += [e.digest for e in response.entries]
        token = response.next_page_token
        if not token:
            break
    assert seen == history.digests[::-1]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await entries(stub, page_token="not-a-token")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_detail_by_digest_and_by_version(
    stub: ledger_pb2_grpc.LedgerServiceStub, history: History
) -> None:
    by_digest = await stub.GetTransitionDetail(
        ledger_pb2.GetTransitionDetailRequest(digest=history.digests[3])
    )
    by_version = await stub.GetTransitionDetail(
        ledger_pb2.GetTransitionDetailRequest(thread_id=history.thread_id, version=3)
    )
    assert by_digest == by_version
    assert hashlib.sha256(by_digest.record_json.encode()).hexdigest() == history.digests[3]
    assert json.loads(by_digest.patch_json) == {"pending_transition": PLAN}
    assert by_digest.state_kept
    state = json.loads(by_digest.state_json)
    assert state["pending_transition"] == PLAN
    assert state["raw_text"] == INITIAL["raw_text"]
    assert (by_digest.entry.version, by_digest.entry.node_id) == (3, PLANNER)
    assert len(by_digest.signature) == 64
    assert by_digest.key_id
    assert by_digest.receipt_json == ""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetTransitionDetail(
            ledger_pb2.GetTransitionDetailRequest(thread_id=history.thread_id, version=99)
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetTransitionDetail(ledger_pb2.GetTransitionDetailRequest(digest="xyz"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_key_history_follows_one_key(
    stub: ledger_pb2_grpc.LedgerServiceStub, history: History
) -> None:
    response = await stub.KeyHistory(
        ledger_pb2.KeyHistoryRequest(thread_id=history.thread_id, key="requested_action")
    )
    changes = [(c.version, c.removed, c.value_json) for c in response.changes]
    assert changes == [
        (1, False, json.dumps(act("a"), separators=(",", ":"), sort_keys=True)),
        (2, False, json.dumps(act("b"), separators=(",", ":"), sort_keys=True)),
        (4, True, ""),
    ]
    assert [c.digest for c in response.changes] == [history.digests[v] for v in (1, 2, 4)]
    paged: list[int] = []
    token = ""
    while True:
        page = await stub.KeyHistory(
            ledger_pb2.KeyHistoryRequest(
                thread_id=history.thread_id, key="requested_action", page_size=1, page_token=token
            )
        )
        paged += [c.version for c in page.changes]
        token = page.next_page_token
        if not token:
            break
    assert paged == [1, 2, 4]
    genesis_only = await stub.KeyHistory(
        ledger_pb2.KeyHistoryRequest(thread_id=history.thread_id, key="raw_text")
    )
    assert [(c.version, json.loads(c.value_json)) for c in genesis_only.changes] == [
        (0, INITIAL["raw_text"])
    ]


async def test_nodes_may_not_query_transitions(target: str, pki: Pki, history: History) -> None:
    calls = [
        ("ListTransitions", ledger_pb2.ListTransitionsRequest(thread_id=history.thread_id)),
        ("GetTransitionDetail", ledger_pb2.GetTransitionDetailRequest(digest=history.digests[0])),
        (
            "KeyHistory",
            ledger_pb2.KeyHistoryRequest(thread_id=history.thread_id, key="raw_text"),
        ),
    ]
    async with secure_channel(target, pki.node("input-parser")) as open_channel:
        node_stub = ledger_pb2_grpc.LedgerServiceStub(open_channel)
        for method, request in calls:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await getattr(node_stub, method)(request)
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, method
            assert from_rpc_error(caught.value).reason == "ROLE_FORBIDDEN", method


async def test_the_reader_role_reads_transitions_but_cannot_write(
    database_dsn: str, history: History
) -> None:
    conn = await asyncpg.connect(database_dsn, server_settings={"role": "ztate_reader"})
    try:
        keys = await conn.fetchval(
            "SELECT ztate.patch_keys(record) FROM ztate.transitions WHERE digest = $1",
            history.digests[3],
        )
        assert keys == ["pending_transition"]
        indexed = await conn.fetch(
            "SELECT key FROM ztate.transition_keys WHERE digest = ANY($1::text[]) ORDER BY key",
            history.digests,
        )
        assert [row["key"] for row in indexed] == sorted(
            [*INITIAL, "requested_action", "requested_action", "pending_transition",
             "requested_action"]
        )  # fmt: skip
        for statement in (
            "INSERT INTO ztate.transitions SELECT * FROM ztate.transitions LIMIT 1",
            "UPDATE ztate.transitions SET state = NULL",
            "DELETE FROM ztate.receipts",
            "INSERT INTO ztate.transition_keys SELECT * FROM ztate.transition_keys LIMIT 1",
            "UPDATE ztate.pending_transitions SET status = 'expired'",
            "CREATE INDEX reader_index ON ztate.transitions (key_id)",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(statement)
    finally:
        await conn.close()


async def run_cli(target: str, creds: Credentials, *args: str) -> str:
    ztate = os.path.join(os.path.dirname(sys.executable), "ztate")
    flags = ["--target", target, "--cert", str(creds.cert), "--key", str(creds.key)]
    process = await asyncio.create_subprocess_exec(
        ztate,
        "ledger",
        args[0],
        *flags,
        "--ca",
        str(creds.ca),
        *args[1:],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode()
    return stdout.decode()


async def test_cli_list_show_and_history(target: str, pki: Pki, history: History) -> None:
    creds = pki.operator()
    thread = history.thread_id
    listed, shown, changes, readable = await asyncio.gather(
        run_cli(
            target,
            creds,
            "list",
            "--thread",
            thread,
            "--node",
            PARSER,
            "--changed-key",
            "requested_action",
            "--json",
        ),
        run_cli(target, creds, "show", "--thread", thread, "--version", "3", "--json"),
        run_cli(target, creds, "history", thread, "requested_action", "--json"),
        run_cli(target, creds, "history", thread, "requested_action"),
    )
    rows = [json.loads(line) for line in listed.splitlines()]
    assert [row["version"] for row in rows] == [4, 2, 1]
    assert {row["node_id"] for row in rows} == {PARSER}
    detail = json.loads(shown)
    assert detail["entry"]["digest"] == history.digests[3]
    assert detail["patch"] == {"pending_transition": PLAN}
    assert [json.loads(line)["removed"] for line in changes.splitlines()] == [
        False,
        False,
        True,
    ]
    assert readable.splitlines()[-1].endswith("(removed)")
    shown_text, listed_text = await asyncio.gather(
        run_cli(target, creds, "show", history.digests[3]),
        run_cli(target, creds, "list", "--thread", thread, "--limit", "2"),
    )
    assert f"digest     {history.digests[3]}" in shown_text
    assert "receipt    none" in shown_text
    header, *lines = listed_text.splitlines()
    assert header.split()[:4] == ["AT", "STATUS", "THREAD", "VERSION"]
    assert len(lines) == 2
    assert lines[0].split()[2:4] == [thread, "4"]
    assert lines[0].split()[7] == "requested_action"
