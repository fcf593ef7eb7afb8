"""The LangGraph isolation worker (``python -m ztate.langgraph.worker``, a real separate
process, against the real service over mTLS), spoken to over its protocol: a request line
that is not a request is answered with a precise ``BAD_REQUEST`` and the worker reads the
next line, nothing committed for it (a malformed line used to kill the worker:
``json.loads`` raised out of its loop); a parked update found stale when approved is
re-run on the new head and parked again (docs/langgraph.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from tests.harness import (
    INITIAL,
    Credentials,
    Ledger,
    Pki,
    act,
    as_operator_sees_it,
    client,
    new_thread_id,
)
from tests.integration.workers.langgraph_node import OTHER_USER
from ztate.contract.keyring import generate_signing_key
from ztate.services.runtime.config import Settings
from ztate.testing._approval import deliver_approval
from ztate.transition_service.app import start
from ztate.v1 import transition_pb2
from ztate.worker_sdk import AwaitingApproval

REPO = Path(__file__).resolve().parents[2]
LONG = 64 * 1024 + 1


@contextlib.asynccontextmanager
async def worker(
    target: str, creds: Credentials, node: str, function: str
) -> AsyncIterator[asyncio.subprocess.Process]:
    """The node's worker process, ready; killed afterwards if it has not exited."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ztate.langgraph.worker",
        node,
        f"tests.integration.workers.langgraph_node:{function}",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            "ZTATE_WORKER_TARGET": target,
            "ZTATE_WORKER_CERT": str(creds.cert),
            "ZTATE_WORKER_KEY": str(creds.key),
            "ZTATE_WORKER_CA": str(creds.ca),
        },
    )
    try:
        assert await answer(process) == {"event": "ready", "node": node}
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def send(process: asyncio.subprocess.Process, line: bytes) -> None:
    assert process.stdin is not None
    process.stdin.write(line)
    await process.stdin.drain()


async def answer(process: asyncio.subprocess.Process) -> dict[str, Any]:
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 20)
    assert line, f"the worker exited ({await process.wait()})"
    message: dict[str, Any] = json.loads(line)
    return message


async def test_a_malformed_request_line_is_answered_and_the_worker_goes_on(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    before = await ledger.snapshot(thread_id)
    async with worker(target, pki.node("input-parser"), "input-parser", "parse") as process:
        bad: list[tuple[bytes, object, str]] = [
            (b"not json\n", None, "the request line is not JSON: Expecting value at character 0"),
            (b"\n", None, "the request line is not JSON: Expecting value at character 1"),
            (b"[1, 2]\n", None, "a request is a JSON object, not an array"),
            (b"\xff\xfe{}\n", None, "the request line is not UTF-8 (byte 0)"),
            (
                b"[" * 60_000 + b"\n",
                None,
                "the request line is not JSON this worker reads: it nests too deeply",
            ),
            (b'{"id": 7}\n', 7, "thread_id must be a non-empty string"),
            (b'{"id": "s", "thread_id": 5}\n', "s", "thread_id must be a non-empty string"),
            (
                json.dumps({"id": 8, "thread_id": thread_id, "approval_wait": "soon"}).encode()
                + b"\n",
                8,
                "approval_wait must be a number of seconds",
            ),
            (
                b'{"id": 9, "thread_id": "%s", "approval_wait": NaN}\n' % thread_id.encode(),
                9,
                "approval_wait must be 0 to 2592000 seconds",
            ),
            (
                b'{"id": 10, "thread_id": "%s", "approval_wait": -1}\n' % thread_id.encode(),
                10,
                "approval_wait must be 0 to 2592000 seconds",
            ),
            (
                b'{"thread_id": "' + b"a" * LONG + b'"}\n',
                None,
                "the request line is longer than 65536 bytes",
            ),
        ]
        for line, request_id, message in bad:
            await send(process, line)
            assert await answer(process) == {
                "id": request_id,
                "event": "done",
                "status": "failed",
                "reason": "BAD_REQUEST",
                "message": message,
            }, line[:60]
        assert await ledger.snapshot(thread_id) == before  # nothing committed
        # the same process serves the next, well-formed request
        await send(process, json.dumps({"id": 11, "thread_id": thread_id}).encode() + b"\n")
        done = await answer(process)
        assert done["id"] == 11
        assert done["status"] == "committed", done
        assert done["version"] == 1
        assert done["seen"] == ["raw_text"]
        assert process.stdin is not None
        process.stdin.close()
        assert await asyncio.wait_for(process.wait(), 20) == 0
    assert (await ledger.snapshot(thread_id)).head_version == 1


async def test_an_update_stale_when_approved_is_rerun_on_the_new_head_and_parked_again(
    settings: Settings, database_dsn: str, pki: Pki, ledger: Ledger, tmp_path: Path
) -> None:
    """What docs/langgraph.md says of a parked update that is stale after approval: the
    approval authorises nothing (APPROVAL_STALE, nothing committed); the worker reads
    its view of the new head, runs the node's function again and proposes again, which
    is parked again and needs a decision of its own; approved, it commits."""
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
        async with worker(
            target, pki.node("planner"), "planner", "act_for_another_user"
        ) as process:
            request = {"id": 1, "thread_id": thread_id, "approval_wait": 30}
            await send(process, json.dumps(request).encode() + b"\n")
            first = await answer(process)
            assert (first["id"], first["event"], first["base_version"]) == (1, "parked", 0)
            # the thread moves on before the reviewer decides
            async with client(target, pki.node("input-parser")) as parser:
                await parser.propose(thread_id, 0, {"requested_action": act("moved")})
            stale_digest = await operator_digest(database_dsn, thread_id, first)
            before = await ledger.snapshot(thread_id)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await deliver_approval(target, pki, signing, stale_digest, thread_id, 0)
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "APPROVAL_STALE" in str(refused.value.trailing_metadata())
            assert await ledger.snapshot(thread_id) == before  # the approval wrote nothing
            # the worker re-ran the function on the new head: parked again, on version 1
            second = await answer(process)
            assert (second["id"], second["event"], second["base_version"]) == (1, "parked", 1)
            digest = await operator_digest(database_dsn, thread_id, second)
            assert digest != stale_digest
            applied = await deliver_approval(target, pki, signing, digest, thread_id, 1)
            assert applied.outcome == transition_pb2.OUTCOME_COMMITTED
            done = await answer(process)
            assert (done["id"], done["event"], done["status"], done["version"]) == (
                1,
                "done",
                "committed",
                2,
            )
        async with client(target, pki.operator()) as operator:
            record = (await operator.get_transition(thread_id=thread_id, version=2)).record
    finally:
        await running.stop(grace=1.0)
    assert record["patch"] == {"target_user_id": OTHER_USER}
    assert await statuses(database_dsn, thread_id) == {stale_digest: "stale", digest: "committed"}


async def statuses(dsn: str, thread_id: str) -> dict[str, str]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT digest, status FROM ztate.pending_transitions WHERE thread_id = $1",
            thread_id,
        )
    finally:
        await conn.close()
    return {row["digest"]: row["status"] for row in rows}


async def operator_digest(dsn: str, thread_id: str, parked: dict[str, Any]) -> str:
    """The digest of the proposal a "parked" event announced (a node not marked
    read_records is told its handle only)."""
    announced = AwaitingApproval("", thread_id, int(parked["base_version"]), (), parked["handle"])
    return (await as_operator_sees_it(dsn, announced)).digest
