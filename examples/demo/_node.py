"""What the four demo nodes share: connecting with the node's own certificate,
taking thread ids from the orchestrator, and reporting each step as JSON.

A node process reads ``watch <thread id>`` lines on stdin and runs a
``worker_sdk.NodeRunner`` on each thread; it prints one JSON object per line on
stdout for every proposal it makes and every check it runs. It connects as
``spiffe://<trust domain>/node/<name>`` with ``$ZTATE_HOME/certs/node-<name>.crt``
and nothing else: no database, no server code, no other node's key.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ztate.worker_sdk import Handler, NodeRunner, Step, ZtateClient

HandlerFactory = Callable[[ZtateClient, str, Callable[..., None]], Handler]


def emit(node: str, thread_id: str, event: str, **fields: Any) -> None:
    """One line for the orchestrator."""
    print(json.dumps({"node": node, "thread": thread_id, "event": event, **fields}), flush=True)


def connect(name: str) -> ZtateClient:
    home = Path(os.environ["ZTATE_HOME"])
    certs = home / "certs"
    return ZtateClient.from_files(
        os.environ["ZTATE_DEMO_TARGET"],
        cert=certs / f"node-{name}.crt",
        key=certs / f"node-{name}.key",
        ca=certs / "ca.crt",
    )


def step_fields(step: Step) -> dict[str, Any]:
    fields: dict[str, Any] = {"status": step.status, "base": step.view_version}
    fields["patch_keys"] = sorted(step.patch)
    if step.transition is not None:
        fields["version"] = step.transition.version
        fields["digest"] = step.transition.digest
    if step.digest is not None:
        fields["transition_digest"] = step.digest
    if step.error is not None:
        fields["reason"] = step.error.reason
        fields["keys"] = list(step.error.keys)
        fields["message"] = step.error.message
    return fields


async def serve(name: str, make_handler: HandlerFactory) -> None:
    """Run ``name``'s handler on every thread the orchestrator names, until SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[Any]] = set()
    async with connect(name) as client:

        async def run(thread_id: str) -> None:
            def report(event: str, **fields: Any) -> None:
                emit(name, thread_id, event, **fields)

            runner = NodeRunner(
                client,
                thread_id,
                make_handler(client, thread_id, report),
                node_name=name,
                approval_wait=120.0,
                on_step=lambda step: report("step", **step_fields(step)),
                on_parked=lambda parked: report("parked", handle=parked.handle),
            )
            try:
                await runner.run()
            except Exception as failure:  # report, and keep serving the other threads
                report("failed", error=f"{type(failure).__name__}: {failure}")

        async def commands() -> None:
            while line := (await reader.readline()).decode().strip():
                verb, _, thread_id = line.partition(" ")
                if verb == "watch":
                    task = asyncio.create_task(run(thread_id))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    emit(name, thread_id, "watching")
            stop.set()  # stdin closed: the orchestrator is gone

        reading = asyncio.create_task(commands())
        emit(name, "", "ready")
        await stop.wait()
        reading.cancel()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(reading, *tasks, return_exceptions=True)


def main(name: str, make_handler: HandlerFactory) -> None:
    asyncio.run(serve(name, make_handler))
