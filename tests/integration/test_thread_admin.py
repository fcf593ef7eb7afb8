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
from typing import Any

import asyncpg
import grpc
import pytest
import pytest_asyncio
from google.protobuf.timestamp_pb2 import Timestamp

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
    created = json.loads(out)
    assert (created["thread_id"], created["replayed"]) == (thread_id, False)
    # the same creation again (a retry whose answer was lost): its genesis, said so
    code, out, err = await run_ztate(
        target, pki, "threads", "create", thread_id, "--policy", "pipeline",
        "--state", json.dumps(INITIAL),
    )  # fmt: skip
    assert code == 0, err
    assert out == (
        f"{thread_id} already exists with this initial state "
        f"(digest {created['digest']}): nothing written\n"
    )
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


def tail_argv(target: str, pki: Pki, *argv: str) -> list[str]:
    creds = pki.operator()
    return [
        "ledger",
        "tail",
        *argv,
        "--json",
        "--target",
        target,
        "--cert",
        str(creds.cert),
        "--key",
        str(creds.key),
        "--ca",
        str(creds.ca),
    ]


async def next_entry_of(stream: asyncio.StreamReader, thread_id: str) -> dict[str, Any]:
    """The next entry ``ledger tail`` prints for ``thread_id`` (others are skipped: the
    session's other tests commit too), within a deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        try:
            line = await asyncio.wait_for(stream.readline(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            pytest.fail(f"ledger tail printed nothing of {thread_id} in 30 s")
        assert line, "ledger tail ended"
        entry: dict[str, Any] = json.loads(line)
        if entry["thread_id"] == thread_id:
            return entry


async def test_tail_prints_a_commit_that_became_visible_after_a_later_one(
    target: str, pki: Pki, database_dsn: str
) -> None:
    """A commit time is taken before the commit's transaction commits, so commits become
    visible out of commit-time order. Here thread A's commit waits on its head row (a
    transaction holds it, as a slow or contended commit would) while thread B commits
    and tail prints B; released, A commits with the EARLIER time, and tail prints it."""
    late, early = f"late-{new_thread_id()[:12]}", f"early-{new_thread_id()[:12]}"
    async with client(target, pki.operator()) as operator:
        for thread_id in (late, early):
            await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    since = datetime.now(UTC).isoformat()
    tail = await asyncio.create_subprocess_exec(
        ZTATE,
        *tail_argv(target, pki, "--since", since, "--interval", "0.2"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    # pg_stat_activity is read once per transaction: the watcher is not in one
    holder, watcher = await asyncpg.connect(database_dsn), await asyncpg.connect(database_dsn)
    try:
        held = holder.transaction()
        await held.start()
        await holder.execute("SELECT 1 FROM ztate.threads WHERE thread_id = $1 FOR UPDATE", late)
        async with (
            client(target, pki.node("input-parser"), timeout=60) as slow,
            client(target, pki.node("input-parser")) as parser,
        ):
            blocked = asyncio.create_task(slow.propose(late, 0, {"requested_action": act("a")}))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while not await watcher.fetchval(  # the commit, its time taken, waits on the row
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE '%commit_transition%'"
            ):
                assert loop.time() < deadline, "the commit never waited on the held row"
                assert not blocked.done(), blocked
                await asyncio.sleep(0.05)  # polling the condition, with a deadline
            await parser.propose(early, 0, {"requested_action": act("b")})
            assert tail.stdout is not None
            shown_early = await next_entry_of(tail.stdout, early)
            await held.rollback()  # the row is free: A's commit goes through now
            committed = await asyncio.wait_for(blocked, 30)
            shown_late = await next_entry_of(tail.stdout, late)
    finally:
        await holder.close()
        await watcher.close()
        if tail.returncode is None:
            tail.terminate()
        await asyncio.wait_for(tail.wait(), 30)
    assert (shown_late["version"], committed.version) == (1, 1)
    # visible after the other, with the earlier commit time
    assert datetime.fromisoformat(shown_late["at"]) < datetime.fromisoformat(shown_early["at"])


@pytest.mark.parametrize(
    ("count_pages", "said"),
    [
        (
            10,
            "4 transitions committed from {since} to before {kept} were skipped: more "
            "than 4 new ones in one look",
        ),
        (1, "at least 2 transitions committed from {since} to before {kept} were skipped"),
        (
            0,
            "transitions committed from {since} to before {kept} were not checked: more "
            "than 4 in one look",
        ),
    ],
)
async def test_tail_says_how_many_it_skipped_when_one_look_overflows(
    target: str, pki: Pki, count_pages: int, said: str
) -> None:
    """More new transitions in one look than it keeps (4, in pages of 2: the limits are
    made small in the ``ztate`` process itself): the newest are shown, and stderr says
    how many older ones were skipped (all 4 counted; "at least" 2 when it stopped
    counting after a page), or, when it stopped reading before ``--since``, that the
    rest was not checked: never silently."""
    thread_id = f"ovf-{new_thread_id()[:12]}"
    since = datetime.now(UTC).isoformat()
    async with (
        client(target, pki.operator()) as operator,
        client(target, pki.node("input-parser")) as parser,
    ):
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
        for version in range(7):
            await parser.propose(thread_id, version, {"requested_action": act(f"o{version}")})
    argv = tail_argv(target, pki, "--thread", thread_id, "--since", since, "--count", "4")
    small = (
        "import sys, ztate.services.cli.threads as t; "
        f"t.TAIL_PAGE, t.TAIL_PAGES, t.TAIL_KEPT, t.TAIL_COUNT_PAGES = 2, 2, 4, {count_pages}; "
        "from ztate.services.cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        small,
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode()
    shown = [json.loads(line) for line in stdout.decode().splitlines()]
    assert [entry["version"] for entry in shown] == [4, 5, 6, 7]  # the newest, oldest first
    stamp = Timestamp()
    stamp.FromDatetime(datetime.fromisoformat(since))
    expected = said.format(since=stamp.ToJsonString(), kept=shown[0]["at"])
    assert f"ztate ledger tail: {expected}" in stderr.decode(), stderr.decode()


@pytest.mark.parametrize("lookback", ["-1", "3601", "nan", "inf", "soon"])
async def test_tail_refuses_a_lookback_out_of_bounds(target: str, pki: Pki, lookback: str) -> None:
    code, out, err = await run_ztate(target, pki, "ledger", "tail", f"--lookback={lookback}")
    assert (code, out) == (2, "")  # a usage error, before any call
    expected = f"{lookback!r} is not a number" if lookback == "soon" else "must be 0 to 3600"
    assert f"argument --lookback: {expected}" in err, err
