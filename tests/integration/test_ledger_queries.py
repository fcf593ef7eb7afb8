"""Operators list rejections by thread, node, reason and time; only operators may,
and the queries run on a role that can only read."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import grpc
import pytest
import pytest_asyncio
from google.protobuf import timestamp_pb2

from tests.harness import INITIAL, Pki, act, client, new_thread_id, secure_channel
from ztate.v1 import ledger_pb2, ledger_pb2_grpc
from ztate.worker_sdk import PermissionDenied, StaleVersion

PARSER = "spiffe://ztate.test/node/input-parser"
PLANNER = "spiffe://ztate.test/node/planner"


@pytest_asyncio.fixture(scope="module")
async def refused_thread(target: str, pki: Pki) -> str:
    """A thread with five refusals: 3 by the parser (2 stale, 1 allowlist), 2 by the planner."""
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(target, pki.node("input-parser")) as parser:
        await parser.propose(thread_id, 0, {"requested_action": act("ok")})
        for tag in ("late-1", "late-2"):
            with pytest.raises(StaleVersion):
                await parser.propose(thread_id, 0, {"requested_action": act(tag)})
        with pytest.raises(PermissionDenied):
            await parser.propose(thread_id, 1, {"is_admin": True})
    async with client(target, pki.node("planner")) as planner:
        for _ in range(2):
            with pytest.raises(PermissionDenied):
                await planner.propose(thread_id, 1, {"result_ref": "db://x"})
    return thread_id


@pytest_asyncio.fixture
async def ledger_stub(target: str, pki: Pki) -> AsyncIterator[ledger_pb2_grpc.LedgerServiceStub]:
    async with secure_channel(target, pki.operator()) as open_channel:
        yield ledger_pb2_grpc.LedgerServiceStub(open_channel)


async def listed(
    stub: ledger_pb2_grpc.LedgerServiceStub, **filters: object
) -> list[ledger_pb2.Rejection]:
    response = await stub.ListRejections(ledger_pb2.ListRejectionsRequest(**filters))  # type: ignore[arg-type]
    return list(response.rejections)


async def test_filters_by_thread_node_and_reason(
    ledger_stub: ledger_pb2_grpc.LedgerServiceStub, refused_thread: str
) -> None:
    everything = await listed(ledger_stub, thread_id=refused_thread)
    assert len(everything) == 5
    assert [r.id for r in everything] == sorted((r.id for r in everything), reverse=True)
    by_parser = await listed(ledger_stub, thread_id=refused_thread, node_id=PARSER)
    assert sorted(r.reason for r in by_parser) == [
        "KEY_NOT_WRITABLE",
        "STALE_VERSION",
        "STALE_VERSION",
    ]
    stale = await listed(ledger_stub, thread_id=refused_thread, reason="STALE_VERSION")
    assert {(r.node_id, r.base_version) for r in stale} == {(PARSER, 0)}
    planner = await listed(ledger_stub, thread_id=refused_thread, node_id=PLANNER)
    assert [list(r.keys) for r in planner] == [["result_ref"], ["result_ref"]]
    assert all(len(r.patch_digest) == 64 and r.patch_bytes > 0 for r in everything)


async def test_filters_by_time(
    ledger_stub: ledger_pb2_grpc.LedgerServiceStub, refused_thread: str
) -> None:
    future, past = timestamp_pb2.Timestamp(), timestamp_pb2.Timestamp()
    future.FromDatetime(datetime.now(UTC) + timedelta(hours=1))
    past.FromDatetime(datetime.now(UTC) - timedelta(hours=1))
    assert await listed(ledger_stub, thread_id=refused_thread, since=future) == []
    assert len(await listed(ledger_stub, thread_id=refused_thread, since=past)) == 5
    assert await listed(ledger_stub, thread_id=refused_thread, until=past) == []


async def test_keyset_pagination_visits_each_rejection_once(
    ledger_stub: ledger_pb2_grpc.LedgerServiceStub, refused_thread: str
) -> None:
    seen: list[int] = []
    token = ""
    while True:
        response = await ledger_stub.ListRejections(
            ledger_pb2.ListRejectionsRequest(
                thread_id=refused_thread, page_size=2, page_token=token
            )
        )
        seen += [r.id for r in response.rejections]
        token = response.next_page_token
        if not token:
            break
    assert len(seen) == len(set(seen)) == 5


@pytest.mark.parametrize(
    ("request_fields", "fragment"),
    [({"page_size": 1001}, "page_size"), ({"page_token": "abc"}, "page_token")],
)
async def test_bad_paging_is_refused(
    ledger_stub: ledger_pb2_grpc.LedgerServiceStub,
    request_fields: dict[str, object],
    fragment: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await listed(ledger_stub, **request_fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in (caught.value.details() or "")


async def test_nodes_may_not_read_the_ledger(target: str, pki: Pki) -> None:
    async with secure_channel(target, pki.node("db-writer")) as open_channel:
        stub = ledger_pb2_grpc.LedgerServiceStub(open_channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await listed(stub)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_the_reader_role_can_only_read(database_dsn: str, refused_thread: str) -> None:
    conn = await asyncpg.connect(database_dsn, server_settings={"role": "ztate_reader"})
    try:
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM ztate.rejections WHERE thread_id = $1", refused_thread
            )
            == 5
        )
        for statement in (
            "INSERT INTO ztate.rejections (method, node_id, reason, message) "
            "VALUES ('x', 'y', 'z', 'w')",
            "UPDATE ztate.threads SET version = version + 1",
            "DELETE FROM ztate.pending_transitions",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(statement)
    finally:
        await conn.close()


async def test_cli_lists_rejections_as_json(target: str, pki: Pki, refused_thread: str) -> None:
    creds = pki.operator()
    ztate = os.path.join(os.path.dirname(sys.executable), "ztate")
    process = await asyncio.create_subprocess_exec(
        ztate,
        "ledger",
        "rejections",
        "--target",
        target,
        "--cert",
        str(creds.cert),
        "--key",
        str(creds.key),
        "--ca",
        str(creds.ca),
        "--thread",
        refused_thread,
        "--reason",
        "KEY_NOT_WRITABLE",
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode()
    rows = [json.loads(line) for line in stdout.decode().splitlines()]
    assert len(rows) == 3
    assert {row["reason"] for row in rows} == {"KEY_NOT_WRITABLE"}
    assert {row["node_id"] for row in rows} == {PARSER, PLANNER}
