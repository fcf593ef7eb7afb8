"""Thread administration for operators: ListThreads and DescribeThread (operator role
only, keyset pages whose tokens are hostile input), and the CLI's `ztate threads
create|list|show` and `ztate ledger tail` (real gRPC, mTLS and Postgres)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import grpc
import pytest
import pytest_asyncio

from tests.harness import INITIAL, Pki, act, client, new_thread_id, secure_channel
from ztate.services.runtime.identity import Role
from ztate.v1 import ledger_pb2, ledger_pb2_grpc

ZTATE = os.path.join(os.path.dirname(sys.executable), "ztate")


@pytest_asyncio.fixture
async def operator_stub(target: str, pki: Pki) -> AsyncIterator[ledger_pb2_grpc.LedgerServiceStub]:
    async with secure_channel(target, pki.operator()) as channel:
        yield ledger_pb2_grpc.LedgerServiceStub(channel)


async def run_ztate(target: str, pki: Pki, *argv: str) -> tuple[int, str, str]:
    creds = pki.operator()
    process = await asyncio.create_subprocess_exec(
        ZTATE,
        *argv,
        "--target",
        target,
        "--cert",
        str(creds.cert),
        "--key",
        str(creds.key),
        "--ca",
        str(creds.ca),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def test_operators_page_through_threads_of_a_policy(
    target: str, pki: Pki, operator_stub: ledger_pb2_grpc.LedgerServiceStub
) -> None:
    prefix = f"adm-{new_thread_id()[:8]}"
    ids = sorted(f"{prefix}-{i}" for i in range(5))
    async with client(target, pki.operator()) as operator:
        for thread_id in ids:
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    request = ledger_pb2.ListThreadsRequest(policy="pipeline", page_size=2)
    seen: list[str] = []
    while True:
        response = await operator_stub.ListThreads(request)
        assert len(response.threads) <= 2
        seen += [t.thread_id for t in response.threads]
        assert {t.policy for t in response.threads} <= {"pipeline"}
        if not response.next_page_token:
            break
        request.page_token = response.next_page_token
    assert [t for t in seen if t.startswith(prefix)] == ids
    assert seen == sorted(seen)
    described = await operator_stub.DescribeThread(
        ledger_pb2.DescribeThreadRequest(thread_id=ids[0])
    )
    assert described.thread.version == 0
    assert described.thread.policy == "pipeline"
    # the genesis woke the input parser (its wake: raw_text), decided by the service
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not any(w.node == "input-parser" and w.due for w in described.work):
        assert loop.time() < deadline, list(described.work)
        await asyncio.sleep(0.1)  # polling for the wake, with a deadline
        described = await operator_stub.DescribeThread(
            ledger_pb2.DescribeThreadRequest(thread_id=ids[0])
        )
    assert [w.node for w in described.work] == ["input-parser"]


@pytest.mark.parametrize(
    "token",
    [
        "not a token",
        "A" * 201,
        base64.urlsafe_b64encode(b"bad id with spaces").decode().rstrip("="),
        base64.urlsafe_b64encode(b"x" * 129).decode().rstrip("="),
        base64.urlsafe_b64encode(b"abc").decode() + "==",  # padding: not what we issue
        "%%%%",
        "\u00e9t\u00e9",
        "12345",
    ],
)
async def test_hostile_page_tokens_are_refused(
    operator_stub: ledger_pb2_grpc.LedgerServiceStub, token: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await operator_stub.ListThreads(ledger_pb2.ListThreadsRequest(page_token=token))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "page_token is not one this service issued"


async def test_only_operators_administer_threads(target: str, pki: Pki) -> None:
    for creds in (pki.node("planner"), pki.identity(Role.SERVICE, "transition")):
        async with secure_channel(target, creds) as channel:
            stub = ledger_pb2_grpc.LedgerServiceStub(channel)
            for call in (
                stub.ListThreads(ledger_pb2.ListThreadsRequest()),
                stub.DescribeThread(ledger_pb2.DescribeThreadRequest(thread_id="t")),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED


async def test_describe_refuses_unknown_and_malformed_threads(
    operator_stub: ledger_pb2_grpc.LedgerServiceStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await operator_stub.DescribeThread(ledger_pb2.DescribeThreadRequest(thread_id="nope-x1"))
    assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as malformed:
        await operator_stub.DescribeThread(ledger_pb2.DescribeThreadRequest(thread_id="a\nb" * 100))
    assert malformed.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_cli_creates_lists_shows_and_tails_threads(target: str, pki: Pki) -> None:
    thread_id = f"cli-{new_thread_id()[:12]}"
    code, out, err = await run_ztate(
        target,
        pki,
        "threads",
        "create",
        thread_id,
        "--policy",
        "pipeline",
        "--state",
        json.dumps(INITIAL),
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["thread_id"] == thread_id
    code, out, err = await run_ztate(
        target, pki, "threads", "list", "--policy", "pipeline", "--limit", "1000", "--json"
    )
    assert code == 0, err
    assert thread_id in {json.loads(line)["thread_id"] for line in out.splitlines()}
    code, out, err = await run_ztate(target, pki, "threads", "show", thread_id, "--json")
    assert code == 0, err
    assert json.loads(out)["thread"]["thread_id"] == thread_id
    code, out, err = await run_ztate(target, pki, "threads", "show", "missing-thread-x")
    assert code == 3  # the CLI's exit code for "not found" (docs/cli.md)
    assert "NOT_FOUND" in err
    code, out, err = await run_ztate(target, pki, "threads", "create", "t-x", "--state", "[1]")
    assert (code, out) == (2, "")  # a usage error, before any call
    assert "must be a JSON object" in err

    # tail follows the transitions committed from --since on, as they commit
    since = datetime.now(UTC).isoformat()
    creds = pki.operator()
    tail = await asyncio.create_subprocess_exec(
        ZTATE,
        "ledger",
        "tail",
        "--thread",
        thread_id,
        "--count",
        "1",
        "--interval",
        "0.2",
        "--since",
        since,
        "--json",
        "--target",
        target,
        "--cert",
        str(creds.cert),
        "--key",
        str(creds.key),
        "--ca",
        str(creds.ca),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with client(target, pki.node("input-parser")) as parser:
        view = await parser.get_view(thread_id)
        committed = await parser.propose(thread_id, view.version, {"requested_action": act("t")})
    stdout, stderr = await asyncio.wait_for(tail.communicate(), 30)
    assert tail.returncode == 0, stderr.decode()
    (line,) = stdout.decode().splitlines()
    entry = json.loads(line)
    assert (entry["thread_id"], int(entry["version"])) == (thread_id, committed.version)
