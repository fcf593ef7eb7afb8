"""The LangGraph isolation worker (``python -m ztate.langgraph.worker``, a real separate
process, against the real service over mTLS): a request line that is not a request is
answered with a precise ``BAD_REQUEST`` and the worker reads the next line; nothing is
committed for it. (A malformed line used to kill the worker: ``json.loads`` raised out
of its loop.)"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.harness import INITIAL, Ledger, Pki, client, new_thread_id

REPO = Path(__file__).resolve().parents[2]
LONG = 64 * 1024 + 1


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
    creds = pki.node("input-parser")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ztate.langgraph.worker",
        "input-parser",
        "tests.integration.workers.langgraph_node:parse",
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
    assert process.stdin is not None
    try:
        assert await answer(process) == {"event": "ready", "node": "input-parser"}
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
            process.stdin.write(line)
            await process.stdin.drain()
            assert await answer(process) == {
                "id": request_id,
                "event": "done",
                "status": "failed",
                "reason": "BAD_REQUEST",
                "message": message,
            }, line[:60]
        assert await ledger.snapshot(thread_id) == before  # nothing committed
        # the same process serves the next, well-formed request
        process.stdin.write(json.dumps({"id": 11, "thread_id": thread_id}).encode() + b"\n")
        await process.stdin.drain()
        done = await answer(process)
        assert done["id"] == 11
        assert done["status"] == "committed", done
        assert done["version"] == 1
        assert done["seen"] == ["raw_text"]
        process.stdin.close()
        assert await asyncio.wait_for(process.wait(), 20) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert (await ledger.snapshot(thread_id)).head_version == 1
