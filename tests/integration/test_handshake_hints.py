"""A certificate the TLS handshake refuses is named as such by the worker SDK, not
reported as "server down" (issue 14, item 5): the service verifies client certificates
in the handshake, so gRPC alone says UNAVAILABLE for both. Over real mTLS, against the
real service: each wrong file gives its own reason and hint, nothing is committed, and
a service that is truly down is still "unreachable"."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.harness import (
    INITIAL,
    TRUST_DOMAIN,
    Credentials,
    Ledger,
    Pki,
    act,
    client,
    new_thread_id,
)
from ztate.services.cli import ca
from ztate.services.cli.main import main as ztate
from ztate.services.runtime.config import Settings
from ztate.services.runtime.identity import Identity, Role
from ztate.transition_service.app import RunningService, start
from ztate.worker_sdk import (
    HandshakeFailed,
    IdentityRevoked,
    Unavailable,
    Unreachable,
    ZtateClient,
)


async def new_thread(target: str, pki: Pki) -> str:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    return thread_id


async def refused_proposal(
    target: str, creds: Credentials, pki: Pki, ledger: Ledger, **options: object
) -> HandshakeFailed:
    """What a proposal with ``creds`` raises; the ledger is asserted unchanged."""
    thread_id = await new_thread(target, pki)
    before = await ledger.snapshot(thread_id)
    worker = ZtateClient.from_files(
        target, cert=creds.cert, key=creds.key, ca=creds.ca, retries=0, **options
    )  # type: ignore[arg-type]
    async with worker:
        with pytest.raises(HandshakeFailed) as caught:
            await worker.propose(thread_id, 0, {"requested_action": act("hint")})
    assert await ledger.snapshot(thread_id) == before  # nothing committed
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE
    return caught.value


def test_an_expired_certificate_is_named_before_any_call(pki: Pki) -> None:
    creds = pki.expired("input-parser")
    with pytest.raises(HandshakeFailed) as caught:
        ZtateClient.from_files("localhost:1", cert=creds.cert, key=creds.key, ca=creds.ca)
    assert caught.value.reason == "CERTIFICATE_EXPIRED"
    assert caught.value.hint.startswith("the client certificate expired at ")


def test_a_key_of_another_certificate_is_named_before_any_call(pki: Pki) -> None:
    mine, other = pki.node("input-parser"), pki.foreign("input-parser")
    with pytest.raises(HandshakeFailed) as caught:
        ZtateClient.from_files("localhost:1", cert=mine.cert, key=other.key, ca=mine.ca)
    assert caught.value.reason == "KEY_MISMATCH"


async def test_a_certificate_of_another_ca_is_refused_by_the_service(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    refused = await refused_proposal(target, pki.foreign("input-parser"), pki, ledger)
    assert refused.reason == "CERTIFICATE_REFUSED"
    assert refused.hint.startswith("the service refused our certificate (")
    assert "the client certificate is not issued by the CA file's CA" in refused.hint


async def test_creating_a_thread_with_a_refused_certificate_is_named_too(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    """Before: create_thread alone raised the bare UNAVAILABLE ("server down") for a
    certificate the handshake refuses; it is diagnosed as every other call is."""
    creds = pki.foreign("admin")
    thread_id = new_thread_id()
    worker = ZtateClient.from_files(target, cert=creds.cert, key=creds.key, ca=creds.ca)
    async with worker:
        with pytest.raises(HandshakeFailed) as caught:
            await worker.create_thread(thread_id, INITIAL, policy="pipeline")
    assert caught.value.reason == "CERTIFICATE_REFUSED"
    assert "the client certificate is not issued by the CA file's CA" in caught.value.hint
    assert (await ledger.snapshot(thread_id)).head_version is None  # nothing created


async def test_a_ca_that_did_not_sign_the_service_does_not_trust_it(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    mine = pki.node("input-parser")
    wrong_ca = Credentials(mine.cert, mine.key, pki.foreign_ca_dir / ca.CA_CERT)
    refused = await refused_proposal(target, wrong_ca, pki, ledger)
    assert refused.reason == "SERVER_NOT_TRUSTED"
    assert refused.hint.startswith("our CA does not trust the service's certificate (")


async def test_a_server_name_the_certificate_does_not_hold(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    refused = await refused_proposal(
        target, pki.node("input-parser"), pki, ledger, server_name="elsewhere.example"
    )
    assert refused.reason == "SERVER_NAME_MISMATCH"
    assert "does not name 'elsewhere.example'" in refused.hint


async def test_a_revoked_identity_is_named_revoked(
    settings: Settings, database_dsn: str, pki: Pki, ledger: Ledger, tmp_path: Path
) -> None:
    revocations = tmp_path / "revocations.json"
    running: RunningService = await start(
        settings.model_copy(update={"listen": "127.0.0.1:0", "revocation_list_file": revocations}),
        dsn=database_dsn,
    )
    try:
        target = f"localhost:{running.port}"
        thread_id = await new_thread(target, pki)
        paths = ca.issue(
            pki.ca_dir, Identity(TRUST_DOMAIN, Role.NODE, "input-parser"), tmp_path / "own"
        )
        assert ztate(["ca", "revoke", "--cert", str(paths.cert), "--list", str(revocations)]) == 0
        before = await ledger.snapshot(thread_id)
        async with client(target, Credentials(paths.cert, paths.key, paths.ca_cert)) as worker:
            with pytest.raises(IdentityRevoked) as caught:
                await worker.propose(thread_id, 0, {"requested_action": act("revoked")})
        assert await ledger.snapshot(thread_id) == before
    finally:
        await running.stop(grace=1.0)
    assert caught.value.reason == "IDENTITY_REVOKED"
    assert caught.value.hint.startswith("the service refused our certificate: it is revoked")


@contextlib.asynccontextmanager
async def nothing_listening() -> AsyncIterator[str]:
    """A loopback port that was just free: connecting to it is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    yield f"localhost:{port}"


async def test_a_service_that_is_down_is_unreachable_not_a_certificate(pki: Pki) -> None:
    creds = pki.node("input-parser")
    async with nothing_listening() as target:
        worker = ZtateClient.from_files(
            target, cert=creds.cert, key=creds.key, ca=creds.ca, retries=0
        )
        async with worker:
            with pytest.raises(Unreachable) as caught:
                await worker.get_view("t-anything")
    assert caught.value.reason == "UNREACHABLE"
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE
    assert f"the service at {target} is unreachable" in caught.value.message
    assert not isinstance(caught.value, HandshakeFailed)


@contextlib.asynccontextmanager
async def accepting_then_closing() -> AsyncIterator[str]:
    """A listener that takes each connection and closes it at once, as a TCP proxy does
    whose backend is down (seen under kill -9 behind a relay)."""

    async def close_at_once(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"localhost:{port}"


async def test_a_proxy_whose_backend_is_down_is_not_a_refused_certificate(pki: Pki) -> None:
    creds = pki.node("input-parser")
    async with accepting_then_closing() as target:
        worker = ZtateClient.from_files(
            target, cert=creds.cert, key=creds.key, ca=creds.ca, retries=0
        )
        async with worker:
            with pytest.raises(Unavailable) as caught:
                await worker.get_view("t-anything")
    assert not isinstance(caught.value, HandshakeFailed), caught.value
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE


async def test_a_refused_certificate_on_the_work_stream_is_named_at_once(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    """SubscribeWork goes through the same diagnosis as the other calls: a certificate
    of another CA is ``HandshakeFailed`` (CERTIFICATE_REFUSED) on the first failure,
    not retried ``reconnects`` times and then raised as a bare UNAVAILABLE."""
    thread_id = await new_thread(target, pki)  # work for input-parser: its raw_text
    before = await ledger.snapshot(thread_id)
    creds = pki.foreign("input-parser")
    worker = ZtateClient.from_files(target, cert=creds.cert, key=creds.key, ca=creds.ca)
    async with worker:
        stream = worker.subscribe_work(reconnects=3)
        with pytest.raises(HandshakeFailed) as caught:
            # the retries of the old code took 0.1 + 0.2 + 0.4 s and more: a diagnosis
            # is one TLS connection
            await asyncio.wait_for(anext(stream), 10)
        await stream.aclose()
    assert caught.value.reason == "CERTIFICATE_REFUSED"
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE
    assert "the client certificate is not issued by the CA file's CA" in caught.value.hint
    assert await ledger.snapshot(thread_id) == before  # nothing committed
