"""What the four demo nodes share: connecting with the node's own certificate,
serving the node's work, and reporting each step as JSON.

A node process serves every thread on which its policy says it has work
(``NodeRunner.for_node(...).serve()``, on ``SubscribeWork``): nobody tells it
thread ids. It prints one JSON object per line on stdout for every proposal it
makes and every check it runs, and stops on SIGTERM or when its standard input
closes (the orchestrator is gone). It connects as
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

from ztate.worker_sdk import Handler, NodeRunner, Step, View, ZtateClient

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
    """Serve ``name``'s work on every thread, until SIGTERM or the end of stdin."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def orchestrator_gone() -> None:
        await reader.read()  # only its end matters: the orchestrator is gone
        stop.set()

    async with connect(name) as client:
        handlers: dict[str, Handler] = {}

        def report_on(thread_id: str) -> Callable[..., None]:
            return lambda event, **fields: emit(name, thread_id, event, **fields)

        def handle(view: View) -> Any:
            # one handler per thread, as the node scripts are written
            if view.thread_id not in handlers:
                handlers[view.thread_id] = make_handler(
                    client, view.thread_id, report_on(view.thread_id)
                )
            return handlers[view.thread_id](view)

        runner = NodeRunner.for_node(
            client,
            handle,
            node_name=name,
            concurrency=4,
            approval_wait=120.0,
            on_step=lambda step: emit(name, step.thread_id, "step", **step_fields(step)),
            on_parked=lambda parked: emit(name, parked.thread_id, "parked", handle=parked.handle),
        )
        watching = asyncio.create_task(orchestrator_gone())
        emit(name, "", "ready")
        try:
            await runner.serve(stop)
        finally:
            watching.cancel()


def main(name: str, make_handler: HandlerFactory) -> None:
    asyncio.run(serve(name, make_handler))
