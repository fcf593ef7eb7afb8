"""The one client channel (services/cli/context.py ``connect``): every ``ztate`` client
command and ``ztate console`` open it, and it takes any reply a ztate server may legally
send (``tls.MAX_REPLY_BYTES``: a 64 MiB state, two patches and their framing), far past
gRPC's default 4 MiB receive limit.

The server here is a real gRPC server over real mTLS (the test PKI's service certificate,
client certificates required) that answers the ledger calls the console's timeline and
``ztate ledger show`` make, with a detail whose state is 64.5 MiB.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.harness import Pki
from tests.unsupported_curve import certificate_for, secp112r1_key_pair
from ztate.services.runtime.identity import Role
from ztate.services.runtime.tls import MAX_REPLY_BYTES
from ztate.v1 import ledger_pb2, ledger_pb2_grpc

DIGEST = "cd" * 32
STATE_CHARS = 64 * 1024 * 1024 + 512 * 1024  # past the CLI's old 64 MiB, inside the bound


class BigDetail(ledger_pb2_grpc.LedgerServiceServicer):
    """One thread with one transition, whose kept state is large."""

    def __init__(self) -> None:
        self.state_json = json.dumps({"big": "s" * STATE_CHARS})

    def ListTransitions(self, request: Any, context: Any) -> Any:
        return ledger_pb2.ListTransitionsResponse(
            entries=[
                ledger_pb2.LedgerEntry(
                    thread_id="t-big", version=1, digest=DIGEST, node_id="n", kind="transition"
                )
            ]
        )

    def GetTransitionDetail(self, request: Any, context: Any) -> Any:
        return ledger_pb2.GetTransitionDetailResponse(
            entry=ledger_pb2.LedgerEntry(thread_id="t-big", version=1, digest=DIGEST),
            patch_json='{"k":1}',
            state_json=self.state_json,
            state_kept=True,
        )


@pytest.fixture(scope="module")
def big_server(pki: Pki) -> Iterator[str]:
    service = pki.identity(Role.SERVICE, "transition")
    credentials = grpc.ssl_server_credentials(
        [(service.key.read_bytes(), service.cert.read_bytes())],
        root_certificates=service.ca.read_bytes(),
        require_client_auth=True,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    ledger_pb2_grpc.add_LedgerServiceServicer_to_server(BigDetail(), server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_the_reply_is_a_large_legal_one() -> None:
    reply = ledger_pb2.GetTransitionDetailResponse(state_json=BigDetail().state_json)
    assert 64 * 1024 * 1024 < reply.ByteSize() < MAX_REPLY_BYTES


def test_ztate_ledger_show_receives_a_large_detail(
    big_server: str,
    pki: Pki,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ztate.services.cli.main import main

    operator = pki.operator()
    monkeypatch.setenv("ZTATE_CONFIG", str(tmp_path / "none.yaml"))
    code = main(
        [
            "ledger",
            "show",
            DIGEST,
            "--address",
            big_server,
            "--client-cert",
            str(operator.cert),
            "--client-key",
            str(operator.key),
            "--ca-cert",
            str(operator.ca),
            "-o",
            "json",
        ]
    )
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert len(json.loads(out)["state"]["big"]) == STATE_CHARS


def test_the_console_timeline_receives_a_large_detail(big_server: str, pki: Pki) -> None:
    """The console's ledger pages (the path that had a channel builder of its own)."""
    from ztate.services.console.backend import Backend, Identity

    operator, reviewer = pki.operator(), pki.identity(Role.REVIEWER, "alice")
    backend = Backend(
        Identity(big_server, operator.cert, operator.key, operator.ca),
        Identity(big_server, reviewer.cert, reviewer.key, reviewer.ca),
    )
    [row] = asyncio.run(backend.timeline("t-big"))
    assert (row["digest"], row["changes"]) == (DIGEST, [("k", "1")])


def test_a_client_key_with_a_password_is_a_usage_error(
    pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client reads its files as the services do (``tls.checked_files``): a key
    encrypted with a password is named, exit 2, before anything is dialled."""
    from cryptography.hazmat.primitives import serialization

    from ztate.services.cli.main import main

    operator = pki.operator()
    key = serialization.load_pem_private_key(operator.key.read_bytes(), password=None)
    locked = tmp_path / "locked.key"
    locked.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw-5ecret-9c1f"),
        )
    )
    monkeypatch.setenv("ZTATE_CONFIG", str(tmp_path / "none.yaml"))
    code = main(
        [
            *("ledger", "list", "--address", "127.0.0.1:1"),
            *("--client-cert", str(operator.cert), "--client-key", str(locked)),
            *("--ca-cert", str(operator.ca)),
        ]
    )
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err == (
        f"ztate: cannot use credentials: {locked} is encrypted with a password: ztate reads "
        "private keys without one (give --client-cert/--client-key/--ca-cert, "
        "ZTATE_CERT/KEY/CA or a context)\n"
    )


def test_a_key_pair_on_an_unsupported_curve_is_a_usage_error(
    pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A private key, or a certificate's key, of an algorithm or curve cryptography does
    not support (its UnsupportedAlgorithm is no ValueError) is refused as any unusable
    key file is: named, exit 2, one line, no traceback, none of the file's content."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    from ztate.services.cli.main import main

    key_pem, spki = secp112r1_key_pair()
    with pytest.raises(UnsupportedAlgorithm):  # the premise: a key cryptography refuses
        serialization.load_pem_private_key(key_pem, password=None)
    operator = pki.operator()
    key = tmp_path / "secp112r1.key"
    key.write_bytes(key_pem)
    cert = tmp_path / "secp112r1.crt"
    cert.write_bytes(certificate_for(spki, pki))
    monkeypatch.setenv("ZTATE_CONFIG", str(tmp_path / "none.yaml"))
    hint = "(give --client-cert/--client-key/--ca-cert, ZTATE_CERT/KEY/CA or a context)"
    for given_cert, given_key, said in (
        (cert, key, f"{key} is a private key of an unsupported algorithm or curve"),
        (
            cert,
            operator.key,
            f"{cert} is a certificate for a key of an unsupported algorithm or curve",
        ),
    ):
        code = main(
            [
                *("ledger", "list", "--address", "127.0.0.1:1"),
                *("--client-cert", str(given_cert), "--client-key", str(given_key)),
                *("--ca-cert", str(operator.ca)),
            ]
        )
        out, err = capsys.readouterr()
        assert (code, out) == (2, "")
        assert err == f"ztate: cannot use credentials: {said} {hint}\n"


class LongThread(ledger_pb2_grpc.LedgerServiceServicer):
    """A thread with more versions than a timeline shows: every listing says there is
    more. Each detail call is held until as many as the console may send at once are
    in flight (or all that remain are): a console sending more than that is seen with
    more in flight, one sending them one by one would never release a call (the
    server's wait then fails the test)."""

    def __init__(self, at_once: int, rows: int) -> None:
        self.at_once, self.rows = at_once, rows
        self.listings = 0
        self.in_flight = 0
        self.answered = 0
        self.most_in_flight = 0
        self.changed = threading.Condition()

    def ListTransitions(self, request: Any, context: Any) -> Any:
        with self.changed:
            self.listings += 1
            start = 1000 - 50 * self.listings
        return ledger_pb2.ListTransitionsResponse(
            entries=[
                ledger_pb2.LedgerEntry(
                    thread_id="t-long", version=v, digest=f"{v:064x}", node_id="n"
                )
                for v in range(start + 49, start - 1, -1)
            ],
            next_page_token="more",
        )

    def GetTransitionDetail(self, request: Any, context: Any) -> Any:
        with self.changed:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.changed.notify_all()
            released = self.changed.wait_for(
                lambda: (
                    self.in_flight >= self.at_once
                    or self.answered + self.in_flight >= self.rows
                    or self.most_in_flight > self.at_once
                ),
                timeout=30,
            )
            assert released, "the console never had enough details in flight"
            self.in_flight -= 1
            self.answered += 1
            self.changed.notify_all()
        return ledger_pb2.GetTransitionDetailResponse(
            entry=ledger_pb2.LedgerEntry(thread_id="t-long", digest=request.digest),
            patch_json='{"k":1}',
            state_json='{"k":1}',
            state_kept=True,
        )


def test_the_console_timeline_lists_once_and_holds_few_details_at_once(pki: Pki) -> None:
    """A timeline shows a thread's 50 newest versions. It followed the listing for ten
    pages (500 entries) to keep 50, then asked for all 50 details at once, each holding
    the whole state after it (3.2 GiB at the 64 MiB state limit). Now one listing, and
    at most ``DETAILS_AT_ONCE`` details in flight."""
    from ztate.services.console.backend import DETAILS_AT_ONCE, Backend, Identity

    servicer = LongThread(DETAILS_AT_ONCE, 50)
    service = pki.identity(Role.SERVICE, "transition")
    credentials = grpc.ssl_server_credentials(
        [(service.key.read_bytes(), service.cert.read_bytes())],
        root_certificates=service.ca.read_bytes(),
        require_client_auth=True,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    ledger_pb2_grpc.add_LedgerServiceServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        operator, reviewer = pki.operator(), pki.identity(Role.REVIEWER, "alice")
        target = f"127.0.0.1:{port}"
        backend = Backend(
            Identity(target, operator.cert, operator.key, operator.ca),
            Identity(target, reviewer.cert, reviewer.key, reviewer.ca),
        )
        rows = asyncio.run(backend.timeline("t-long"))
    finally:
        server.stop(grace=None)
    assert [row["digest"] for row in rows] == [f"{v:064x}" for v in range(999, 949, -1)]
    assert servicer.listings == 1
    assert servicer.most_in_flight == DETAILS_AT_ONCE
