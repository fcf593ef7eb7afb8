"""The real ``ztate`` binary against a hostile server (the threat model's "a context
pointing to a hostile server"): a real gRPC server over real mTLS (the test PKI's
service certificate, client certificates required) whose replies carry terminal
escapes, pages that never end, and JSON or timestamps no ztate service sends.

Each view escapes what the server sent (no ESC, BEL, CR, bidi override or line
separator reaches the terminal raw), paging stops, and a malformed reply is one line,
``ztate: malformed reply: ...``, exit 1, with nothing on stdout."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from tests.harness import Pki
from tests.integration.test_cli import ZTATE, clean_env
from ztate.services.runtime.identity import Role
from ztate.v1 import approval_pb2, approval_pb2_grpc, ledger_pb2, ledger_pb2_grpc

# the window title, red, a carriage return that erases the line, a bidi override and a
# line separator: what a terminal acts on or reorders
EVIL = "t1\x1b]0;PWNED\x07\x1b[31mRED\x1b[0m\r\x1b[2KFAKE\u202eLINE\u2028x"
CLIPBOARD = "k\x1b]52;c;cHduZWQ=\x07"  # OSC 52: writes the clipboard
RAW = ("\x1b", "\x07", "\r", "\u202e", "\u2028")
DIGEST = "ab" * 32


def now() -> Timestamp:
    stamp = Timestamp()
    stamp.FromSeconds(1_780_000_000)
    return stamp


def entry(version: int = 1) -> ledger_pb2.LedgerEntry:
    return ledger_pb2.LedgerEntry(
        thread_id=EVIL,
        version=version,
        digest=DIGEST,
        parent_digest="cd" * 32,
        node_id="spiffe://x/node/\x1b[5mblink",
        kind="transition\x1b[8m",
        status="committed",
        at=now(),
        changed_keys=[CLIPBOARD],
    )


class Hostile(ledger_pb2_grpc.LedgerServiceServicer, approval_pb2_grpc.ApprovalServiceServicer):
    """Answers as ``mode`` says; ``calls`` counts the pages asked of KeyHistory."""

    def __init__(self) -> None:
        self.mode = "esc"
        self.calls = 0

    def ListTransitions(self, request: Any, context: Any) -> Any:
        found = entry()
        if self.mode == "badts":
            found.at.seconds = 2**62
        return ledger_pb2.ListTransitionsResponse(entries=[found])

    def GetTransitionDetail(self, request: Any, context: Any) -> Any:
        patch = {
            "badjson": "{not json",
            "nan": '{"a":NaN}',
            "bigint": '{"a":' + "9" * 5000 + "}",
            "deep": "[" * 100_000 + "]" * 100_000,
            "two": '1,"b":2',
        }.get(self.mode, '{"a":"\\u001b]0;x\\u0007"}')
        return ledger_pb2.GetTransitionDetailResponse(
            entry=entry(),
            record_json="{}",
            patch_json=patch,
            state_json='{"a":1}',
            state_kept=True,
            key_id="k1\x1b[31m\u202e",
            signature="s",
        )

    def KeyHistory(self, request: Any, context: Any) -> Any:
        self.calls += 1
        page = int(request.page_token or "0")
        change = ledger_pb2.KeyChange(version=page + 1, digest=DIGEST, value_json='"v"')
        if self.mode == "history-empty":  # no rows, and always a new token
            return ledger_pb2.KeyHistoryResponse(next_page_token=str(page + 1))
        if self.mode == "history-repeat":  # the same token again and again
            return ledger_pb2.KeyHistoryResponse(changes=[change], next_page_token="7")
        return ledger_pb2.KeyHistoryResponse(changes=[change], next_page_token=str(page + 1))

    def DescribeThread(self, request: Any, context: Any) -> Any:
        return ledger_pb2.DescribeThreadResponse(
            thread=ledger_pb2.ThreadHead(
                thread_id=EVIL,
                policy="p\x1b[31m",
                version=1,
                head_digest=DIGEST,
                created_at=now(),
                updated_at=now(),
            ),
            work=[ledger_pb2.NodeWork(node="n\x1b]0;x\x07", holder="h\x1b[2J\u2028")],
        )

    def GetReview(self, request: Any, context: Any) -> Any:
        receipt = b'{"decision":"approve\\u001b[31m","reviewers":["r\\u202e"],"nonce":"n"}'
        return approval_pb2.GetReviewResponse(
            review=approval_pb2.Review(
                digest=DIGEST,
                thread_id=EVIL,
                node_id="spiffe://x/node/\x1b[5mblink",
                risk_rules=["rule\x1b]0;t\x07"],
                required_approvals=2,
                approvers=["spiffe://x/reviewer/\u202eevil"],
                redacted_diff_json=b'{"changes":{"k\\u001b[31m":{"old":1,"new":2}}}',
                status=approval_pb2.REVIEW_STATUS_APPROVED,
                opened_at=now(),
                expires_at=now(),
                receipt=approval_pb2.SignedReceipt(receipt_json=receipt, key_id="k"),
                outcome="committed\r\x1b[2K",
            )
        )


@pytest.fixture(scope="module")
def hostile(pki: Pki) -> Iterator[tuple[Hostile, str]]:
    service = pki.identity(Role.SERVICE, "transition")
    credentials = grpc.ssl_server_credentials(
        [(service.key.read_bytes(), service.cert.read_bytes())],
        root_certificates=service.ca.read_bytes(),
        require_client_auth=True,
    )
    servicer = Hostile()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    ledger_pb2_grpc.add_LedgerServiceServicer_to_server(servicer, server)
    approval_pb2_grpc.add_ApprovalServiceServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def run(hostile: tuple[Hostile, str], pki: Pki, tmp: Path, mode: str, *args: str) -> Any:
    """``ztate *args`` against the hostile server answering as ``mode``."""
    servicer, address = hostile
    servicer.mode, servicer.calls = mode, 0
    operator = pki.operator()
    connect = (
        *("--address", address, "--client-cert", str(operator.cert)),
        *("--client-key", str(operator.key), "--ca-cert", str(operator.ca)),
    )
    return subprocess.run(
        [str(ZTATE), *args, *connect],
        env=clean_env(ZTATE_CONFIG=str(tmp / "none.yaml"), ZTATE_HOME=str(tmp)),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_escaped(out: str) -> None:
    for raw in RAW:
        assert raw not in out, (raw, out)


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(("ledger", "tail", "--count", "1", "--since", "1h"), id="ledger tail"),
        pytest.param(("threads", "show", "t1"), id="threads show"),
        pytest.param(("ledger", "show", DIGEST), id="ledger show"),
        pytest.param(("approvals", "show", DIGEST), id="approvals show"),
    ],
)
def test_every_human_view_escapes_what_the_server_sent(
    hostile: tuple[Hostile, str], pki: Pki, tmp_path: Path, command: tuple[str, ...]
) -> None:
    done = run(hostile, pki, tmp_path, "esc", *command)
    assert (done.returncode, done.stderr) == (0, "")
    assert_escaped(done.stdout)
    # escaped, not dropped: the reader sees what was sent
    assert "t1\\x1b]0;PWNED\\x07\\x1b[31mRED\\x1b[0m\\r\\x1b[2KFAKE\\u202eLINE\\u2028x" in (
        done.stdout
    )


def test_ledger_tail_line_shows_every_field_escaped(
    hostile: tuple[Hostile, str], pki: Pki, tmp_path: Path
) -> None:
    done = run(hostile, pki, tmp_path, "esc", "ledger", "tail", "--count", "1", "--since", "1h")
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    assert line.endswith(
        "@1  transition\\x1b[8m spiffe://x/node/\\x1b[5mblink  keys=k\\x1b]52;c;cHduZWQ=\\x07"
    )


@pytest.mark.parametrize(
    ("mode", "limit", "versions", "pages"),
    [
        pytest.param(
            "history-endless", "5", [1, 2, 3, 4, 5], 5, id="a new token on every page: the limit"
        ),
        pytest.param("history-repeat", "100", [1, 8], 2, id="a token given before"),
        pytest.param("history-empty", "100", [], 1, id="an empty page with a token"),
    ],
)
def test_ledger_history_stops_paging(
    hostile: tuple[Hostile, str],
    pki: Pki,
    tmp_path: Path,
    mode: str,
    limit: str,
    versions: list[int],
    pages: int,
) -> None:
    """A server that always gives a next page token kept ``ledger history`` asking
    forever, buffering every page. It stops at ``--limit``, at a token it was given
    before, and at a page with no rows."""
    done = run(
        hostile, pki, tmp_path, mode, "ledger", "history", "t1", "k", "--limit", limit, "-o", "json"
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert [c["version"] for c in json.loads(done.stdout)] == versions
    assert hostile[0].calls == pages


def test_ledger_history_limit_is_bounded(
    hostile: tuple[Hostile, str], pki: Pki, tmp_path: Path
) -> None:
    for limit in ("0", "100001", "x"):
        done = run(hostile, pki, tmp_path, "esc", "ledger", "history", "t1", "k", "--limit", limit)
        assert (done.returncode, done.stdout) == (2, ""), limit
        assert "Traceback" not in done.stderr
        assert hostile[0].calls == 0


@pytest.mark.parametrize(
    ("mode", "command", "said"),
    [
        (
            "badjson",
            ("ledger", "show", DIGEST, "-o", "json"),
            "patch_json is not valid JSON: Expecting property name enclosed in double quotes "
            "(line 1, column 11)",
        ),
        (
            "nan",
            ("ledger", "show", DIGEST, "-o", "json"),
            "patch_json holds NaN, which is not a JSON number",
        ),
        (
            "bigint",
            ("ledger", "show", DIGEST, "-o", "json"),
            "patch_json holds an integer outside the I-JSON range +/-(2^53 - 1)",
        ),
        ("deep", ("ledger", "show", DIGEST), "patch_json nests deeper than 161 levels"),
        ("two", ("ledger", "show", DIGEST), "patch_json is not valid JSON: more than one value"),
        ("badts", ("ledger", "list", "-o", "json"), "at is not a valid timestamp"),
        ("badts", ("ledger", "tail", "--count", "1"), "at is not a valid timestamp"),
    ],
)
def test_a_malformed_reply_is_one_line_and_nothing_printed(
    hostile: tuple[Hostile, str],
    pki: Pki,
    tmp_path: Path,
    mode: str,
    command: tuple[str, ...],
    said: str,
) -> None:
    done = run(hostile, pki, tmp_path, mode, *command)
    assert (done.returncode, done.stdout, done.stderr) == (
        1,
        "",
        f"ztate: malformed reply: {said}\n",
    )
