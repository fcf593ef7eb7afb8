"""One node of a LangGraph ``StateGraph`` as a ztate worker, in a process of its own.

``python -m ztate.langgraph.worker NODE module:function`` connects with the certificate
named by ``ZTATE_WORKER_TARGET``, ``_CERT``, ``_KEY``, ``_CA`` (``ztate.worker_sdk``),
imports the node's function, says it is ready, then serves steps: for each request
line on its standard input (``{"thread_id": ...}``) it reads its view of the thread
(only the keys its policy lets it read), calls the function with that projection,
proposes the returned update under its own identity, and writes what became of it as
one line on its standard output. A proposal parked for approval is announced at once
(``{"event": "parked", ...}``) and then waited for. The function's own prints go to
standard error, so they cannot corrupt the protocol. ``isolation.IsolatedGraph``
starts and drives these processes.

The process holds this node's credentials only: no operator's, no database's, no key.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from ztate.worker_sdk import AwaitingApproval, NodeRunner, View, ZtateClient, ZtateError

MESSAGE_MAX = 500  # characters of a failure message sent back


def load_function(spec: str) -> Callable[..., Any]:
    """``package.module:function`` (a dotted attribute path after the colon)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"a node function is 'module:function', not {spec!r}")
    found: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        found = getattr(found, part)
    if not callable(found):
        raise TypeError(f"{spec} is not callable")
    return found  # type: ignore[no-any-return]


class Protocol:
    """JSON lines out, on a private copy of the original standard output."""

    def __init__(self, out: TextIO) -> None:
        self._out = out

    def send(self, message: dict[str, Any]) -> None:
        self._out.write(json.dumps(message, separators=(",", ":")) + "\n")
        self._out.flush()


async def step(
    client: ZtateClient,
    node: str,
    function: Callable[..., Any],
    request: dict[str, Any],
    protocol: Protocol,
) -> dict[str, Any]:
    """One step of the node on one thread: projection in, proposal out."""
    thread_id = str(request["thread_id"])
    seen: list[list[str]] = []

    async def handler(view: View) -> dict[str, Any] | None:
        seen.append(sorted(view.state))
        produced = function(dict(view.state))
        if inspect.isawaitable(produced):
            produced = await produced
        if produced is None or produced == {}:
            return None
        if not isinstance(produced, dict):
            raise TypeError(f"a node returns a dict of updates, not {type(produced).__name__}")
        return produced

    def parked(awaiting: AwaitingApproval) -> None:
        protocol.send(
            {
                "id": request.get("id"),
                "event": "parked",
                "handle": awaiting.handle,
                "base_version": awaiting.base_version,
                "digest": awaiting.digest,
                "risk_rules": list(awaiting.risk_rules),
            }
        )

    runner = NodeRunner(
        client,
        thread_id,
        handler,
        node_name=node,
        approval_wait=float(request.get("approval_wait", 300.0)),
        on_parked=parked,
    )
    try:
        view = await client.get_view(thread_id)
        done = await runner.handle(view)
    except ZtateError as error:
        return {"status": "failed", "reason": error.reason, "message": error.message[:MESSAGE_MAX]}
    except Exception as error:  # the node's own failure, reported to the graph run
        return {
            "status": "failed",
            "reason": type(error).__name__,
            "message": str(error)[:MESSAGE_MAX],
        }
    reply: dict[str, Any] = {"seen": seen[-1] if seen else []}
    if done is None:
        return reply | {"status": "noop"}
    reply |= {"status": done.status, "patch_keys": sorted(done.patch)}
    if done.transition is not None:
        reply["version"] = done.transition.version
    if done.error is not None:
        reply |= {
            "reason": done.error.reason,
            "keys": list(done.error.keys),
            "message": done.error.message[:MESSAGE_MAX],
        }
    return reply


async def serve(node: str, spec: str, protocol: Protocol) -> None:
    function = load_function(spec)
    async with ZtateClient.from_env() as client:
        protocol.send({"event": "ready", "node": node})
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                return  # the graph run closed our input: done
            request = json.loads(line)
            reply = await step(client, node, function, request, protocol)
            protocol.send({"id": request.get("id"), "event": "done", **reply})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m ztate.langgraph.worker NODE module:function", file=sys.stderr)
        return 2
    # the protocol keeps the real standard output; anything else printed goes to stderr
    protocol = Protocol(os.fdopen(os.dup(1), "w", encoding="utf-8"))
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        asyncio.run(serve(args[0], args[1], protocol))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
