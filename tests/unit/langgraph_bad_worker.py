"""A stand-in for ``python -m ztate.langgraph.worker`` that breaks the protocol on
purpose (the child of test_langgraph_isolation_protocol.py). It says ready (or, with
ZTATE_DOUBLE_MODE=bad-ready, a first message that is not), then answers each request:
a thread id starting "bad-" with the line the rest of the id names, holding a state
value that must not be repeated; any other thread "noop". It keeps reading after a bad
line, as a broken worker would: the parent has to end it. The thread ids that end it
otherwise: "exit-" exits with code 3 mid-step, without a reply; "close-output-" closes its
standard output without a reply and "close-input-" closes its standard input and answers
"noop"; both then wait for a signal, not for their input: SIGUSR1 exits with code 3."""

from __future__ import annotations

import json
import os
import signal
import sys

SECRET = "hunter2-state-value"
LONGEST = 16 * 1024 * 1024  # the parent's limit of a line (without its newline)
BAD_LINES = {
    "json": '{"id": 1, "event": "done", "status": "committed", "value": "' + SECRET + '"\n',
    "array": json.dumps([SECRET]) + "\n",
    "parked": json.dumps({"event": "parked", "handle": SECRET, "base_version": SECRET}),
    "version": json.dumps({"event": "done", "status": "committed", "version": SECRET}),
    "keys": json.dumps({"event": "done", "status": "refused", "reason": "X", "keys": 7}),
    "status": json.dumps({"event": "done", "status": SECRET}),
    "missing": json.dumps({"event": "done", "value": SECRET}),
    "rules": json.dumps(
        {"event": "parked", "handle": "h", "base_version": 1, "risk_rules": [SECRET, 1]}
    ),
    "digest": json.dumps({"event": "parked", "handle": "h", "base_version": 1, "digest": 7}),
    "seen": json.dumps({"event": "done", "status": "noop", "seen": SECRET}),
    "reason": json.dumps({"event": "done", "status": "refused", "reason": [SECRET]}),
    "message": json.dumps(
        {"event": "done", "status": "failed", "reason": "X", "message": {"v": SECRET}}
    ),
    # a reply whose line is one byte over the limit, and one exactly at it (padded)
    "oversized": '{"id": 1, "status": "noop", "v": "' + SECRET.ljust(LONGEST - 35, "x") + '"}',
    "longest": '{"id": 1, "event": "done", "status": "noop"}'.ljust(LONGEST),
}
WELL_FORMED = ("parked", "version", "keys", "status", "missing", "rules", "digest", "seen")
WELL_FORMED += ("reason", "message")


def send(line: str) -> None:
    sys.stdout.write(line if line.endswith("\n") else line + "\n")
    sys.stdout.flush()


def wait_for_a_signal() -> None:
    """Its pipe closed, the worker neither reads nor exits: SIGUSR1 ends it (code 3)."""
    while True:
        signal.pause()


def main() -> None:
    # before any reply: the test may signal as soon as it saw one
    signal.signal(signal.SIGUSR1, lambda *_: os._exit(3))
    if os.environ.get("ZTATE_DOUBLE_MODE") == "bad-ready":
        send(json.dumps({"event": "hello", "state": SECRET}))
    else:
        send(json.dumps({"event": "ready"}))
    for line in sys.stdin:
        request = json.loads(line)
        thread_id = request["thread_id"]
        if thread_id.startswith("exit-"):
            os._exit(3)
        if thread_id.startswith("close-output-"):
            os.close(sys.stdout.fileno())  # sys.stdout.close() leaves the descriptor open
            wait_for_a_signal()
        if thread_id.startswith("close-input-"):
            os.close(sys.stdin.fileno())
            send(json.dumps({"id": request["id"], "event": "done", "status": "noop"}))
            wait_for_a_signal()
        if thread_id.startswith("bad-"):
            kind = thread_id.split("-")[1]
            message = BAD_LINES[kind]
            if kind in WELL_FORMED:  # answer this step
                message = json.dumps({**json.loads(message), "id": request["id"]})
            send(message)
        else:
            send(json.dumps({"id": request["id"], "event": "done", "status": "noop"}))


if __name__ == "__main__":
    main()
