"""A worker process for the SubscribeWork tests: serves all of its node's work with
``NodeRunner.serve`` and logs each handler run as a JSON line (pid, thread, version,
start and end on the monotonic clock of this machine) to a file.

Usage: work_node.py TARGET CERT KEY CA NODE LOG [--concurrency N] [--hang]
(``--hang``: the handler never returns, so this process only holds leases).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from ztate.worker_sdk import NodeRunner, View, ZtateClient

PATCHES: dict[str, Any] = {
    "input-parser": lambda view: {
        "requested_action": {"action": "refund", "order_id": "A-42", "amount_cents": 100}
    },
    "planner": lambda view: {
        "pending_transition": {"action": "refund", "order_id": "A-42", "amount_cents": 100}
    },
    "invoicer": lambda view: {"invoice_total_cents": 1},
}


async def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("target", "cert", "key", "ca", "node", "log"):
        parser.add_argument(name)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--hang", action="store_true")
    args = parser.parse_args()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    log = Path(args.log).open("a", buffering=1)  # noqa: SIM115, ASYNC230 - a line per run

    async def handler(view: View) -> dict[str, Any]:
        started = time.monotonic()
        if args.hang:
            await asyncio.Event().wait()
        await asyncio.sleep(0.01)  # some work, so that overlaps would show
        line = {
            "pid": os.getpid(),
            "node": args.node,
            "thread": view.thread_id,
            "version": view.version,
            "keys": sorted(view.state),
            "start": started,
            "end": time.monotonic(),
        }
        log.write(json.dumps(line) + "\n")
        patch: dict[str, Any] = PATCHES[args.node](view)
        return patch

    client = ZtateClient.from_files(args.target, cert=args.cert, key=args.key, ca=args.ca)
    async with client:
        runner = NodeRunner.for_node(
            client, handler, node_name=args.node, concurrency=args.concurrency, shutdown_grace=2
        )
        await runner.serve(stop)


if __name__ == "__main__":
    asyncio.run(main())
