"""One node of a LangGraph ``StateGraph`` as a ztate worker, in a process of its own.

``python -m ztate.langgraph.worker NODE module:function`` connects with the certificate
named by ``ZTATE_WORKER_TARGET``, ``_CERT``, ``_KEY``, ``_CA`` (``ztate.worker_sdk``),
imports the node's function, says it is ready, then serves steps: for each request
line on its standard input (``{"thread_id": ...}``) it reads its view of the thread
(only the keys its policy lets it read), calls the function with that projection,
proposes the returned update under its own identity, and writes what became of it as
one line on its standard output. A proposal parked for approval is announced at once
(``{"event": "parked", ...}``) and then waited for. A request line that is not one
(not UTF-8, not JSON, not an object, no ``thread_id``, a bad ``approval_wait``, longer
than ``MAX_REQUEST_BYTES``) is answered ``{"event": "done", "status": "failed",
"reason": "BAD_REQUEST", "message": <what is wrong>}`` and the worker reads the next
one. The function's own prints go to
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
from typing import Any, BinaryIO, TextIO

from ztate.worker_sdk import AwaitingApproval, NodeRunner, View, ZtateClient, ZtateError

MESSAGE_MAX = 500  # characters of a failure message sent back
MAX_REQUEST_BYTES = 64 * 1024  # a request line is a thread id and two numbers
BAD_REQUEST = "BAD_REQUEST"
MAX_APPROVAL_WAIT = 30 * 24 * 3600  # seconds: a month
JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number"}
JSON_TYPES |= {bool: "a boolean", type(None): "null"}


class BadRequest(ValueError):
    """A request line that is not a request; the message says what is wrong, and
    ``request_id`` is the line's ``id`` when it had one."""

    def __init__(self, message: str, request_id: int | str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def read_line(stream: BinaryIO, limit: int = MAX_REQUEST_BYTES) -> bytes | None:
    """One line of ``stream``, at most ``limit`` bytes of it kept; None at its end.
    The rest of a longer line is read and dropped, and ``BadRequest`` raised."""
    line = stream.readline(limit + 1)
    if not line:
        return None
    if len(line) <= limit or line.endswith(b"\n"):
        return line
    while line and not line.endswith(b"\n"):
        line = stream.readline(limit)
    raise BadRequest(f"the request line is longer than {limit} bytes")


def parse_request(line: bytes) -> dict[str, Any]:
    """A request: a JSON object with ``thread_id`` (a non-empty string) and optionally
    ``id`` and ``approval_wait`` (seconds, 0 to ``MAX_APPROVAL_WAIT``)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as bad:
        raise BadRequest(f"the request line is not UTF-8 (byte {bad.start})") from None
    try:
        request = json.loads(text)
    except json.JSONDecodeError as bad:
        raise BadRequest(
            f"the request line is not JSON: {bad.msg} at character {bad.pos}"
        ) from None
    except RecursionError:
        raise BadRequest(
            "the request line is not JSON this worker reads: it nests too deeply"
        ) from None
    if not isinstance(request, dict):
        raise BadRequest(f"a request is a JSON object, not {JSON_TYPES[type(request)]}")
    answer = request_id(request)
    thread_id = request.get("thread_id")
    if not isinstance(thread_id, str) or not thread_id:
        raise BadRequest("thread_id must be a non-empty string", answer)
    wait = request.get("approval_wait", 300.0)
    if isinstance(wait, bool) or not isinstance(wait, int | float):
        raise BadRequest("approval_wait must be a number of seconds", answer)
    if not 0 <= wait <= MAX_APPROVAL_WAIT:  # NaN is neither; a huge int is compared exactly
        raise BadRequest(f"approval_wait must be 0 to {MAX_APPROVAL_WAIT} seconds", answer)
    return request


def request_id(request: object) -> int | str | None:
    """The ``id`` to answer with: a request's own, when it is a number or a string."""
    if isinstance(request, dict):
        found = request.get("id")
        if isinstance(found, int | str) and not isinstance(found, bool):
            return found
    return None


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
                "id": request_id(request),
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
            try:
                line = await asyncio.to_thread(read_line, sys.stdin.buffer)
                if line is None:
                    return  # the graph run closed our input: done
                request = parse_request(line)
            except BadRequest as bad:
                # answered, and the next line is read: a bad line is not the end
                protocol.send(
                    {
                        "id": bad.request_id,
                        "event": "done",
                        "status": "failed",
                        "reason": BAD_REQUEST,
                        "message": str(bad)[:MESSAGE_MAX],
                    }
                )
                continue
            reply = await step(client, node, function, request, protocol)
            protocol.send({"id": request_id(request), "event": "done", **reply})


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
