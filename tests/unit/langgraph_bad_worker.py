"""A stand-in for ``python -m ztate.langgraph.worker`` that breaks the protocol on
purpose (the child of test_langgraph_isolation_protocol.py). It says ready (or, with
ZTATE_DOUBLE_MODE=bad-ready, a first message that is not), then answers each request:
a thread id starting "bad-" with the line the rest of the id names, holding a state
value that must not be repeated; any other thread "noop". It keeps reading after a bad
line, as a broken worker would: the parent has to end it."""

from __future__ import annotations

import json
import os
import sys

SECRET = "hunter2-state-value"
BAD_LINES = {
    "json": '{"id": 1, "event": "done", "status": "committed", "value": "' + SECRET + '"\n',
    "array": json.dumps([SECRET]) + "\n",
    "parked": json.dumps({"event": "parked", "handle": SECRET, "base_version": SECRET}),
    "version": json.dumps({"event": "done", "status": "committed", "version": SECRET}),
    "keys": json.dumps({"event": "done", "status": "refused", "reason": "X", "keys": 7}),
    "status": json.dumps({"event": "done", "status": SECRET}),
}


def send(line: str) -> None:
    sys.stdout.write(line if line.endswith("\n") else line + "\n")
    sys.stdout.flush()


def main() -> None:
    if os.environ.get("ZTATE_DOUBLE_MODE") == "bad-ready":
        send(json.dumps({"event": "hello", "state": SECRET}))
    else:
        send(json.dumps({"event": "ready"}))
    for line in sys.stdin:
        request = json.loads(line)
        thread_id = request["thread_id"]
        if thread_id.startswith("bad-"):
            kind = thread_id.split("-")[1]
            message = BAD_LINES[kind]
            if kind in ("parked", "version", "keys", "status"):  # well-formed: answer this step
                message = json.dumps({**json.loads(message), "id": request["id"]})
            send(message)
        else:
            send(json.dumps({"id": request["id"], "event": "done", "status": "noop"}))


if __name__ == "__main__":
    main()
