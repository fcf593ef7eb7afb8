"""Identity comes only from a certificate our CA signed, never from the request.

Callers without a certificate, with one from another CA, or with an expired one
are refused by the TLS handshake itself: the connection never carries an RPC, so
the client sees UNAVAILABLE and no handler runs (nothing is recorded anywhere).
Certificates our CA signed but whose SPIFFE ID we cannot accept get
UNAUTHENTICATED with reason IDENTITY_INVALID.
"""

from __future__ import annotations

import logging

import grpc
import pytest

from tests.harness import INITIAL, Credentials, Ledger, Pki, act, client, new_thread_id
from ztate.v1 import transition_pb2, transition_pb2_grpc
from ztate.worker_sdk import PermissionDenied, Unauthenticated, ZtateError


async def make_thread(target: str, pki: Pki) -> str:
    thread_id = new_thread_id()
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    return thread_id


def propose_request(thread_id: str) -> transition_pb2.ProposeTransitionRequest:
    return transition_pb2.ProposeTransitionRequest(
        thread_id=thread_id,
        expected_version=0,
        patch_json=b'{"requested_action": {"action": "none"}}',
        idempotency_key="k",
    )


async def assert_handshake_refused(
    target: str, credentials: grpc.ChannelCredentials, thread_id: str, ledger: Ledger
) -> None:
    before, rejections = await ledger.snapshot(thread_id), await ledger.rejection_count()
    async with grpc.aio.secure_channel(target, credentials) as channel:
        stub = transition_pb2_grpc.TransitionServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ProposeTransition(propose_request(thread_id), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert await ledger.snapshot(thread_id) == before
    assert await ledger.rejection_count() == rejections  # no handler ran


def channel_credentials(creds: Credentials) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        creds.ca.read_bytes(), creds.key.read_bytes(), creds.cert.read_bytes()
    )


async def test_no_client_certificate(target: str, pki: Pki, ledger: Ledger) -> None:
    thread_id = await make_thread(target, pki)
    anonymous = grpc.ssl_channel_credentials((pki.certs / "ca.crt").read_bytes())
    await assert_handshake_refused(target, anonymous, thread_id, ledger)


async def test_certificate_from_another_ca(target: str, pki: Pki, ledger: Ledger) -> None:
    thread_id = await make_thread(target, pki)
    foreign = channel_credentials(pki.foreign("input-parser"))
    await assert_handshake_refused(target, foreign, thread_id, ledger)


async def test_expired_certificate(target: str, pki: Pki, ledger: Ledger) -> None:
    thread_id = await make_thread(target, pki)
    expired = channel_credentials(pki.expired("input-parser"))
    await assert_handshake_refused(target, expired, thread_id, ledger)


@pytest.mark.parametrize(
    ("stem", "uris"),
    [
        ("other-domain", ("spiffe://evil.test/node/input-parser",)),
        ("no-spiffe-id", ()),
        ("http-uri", ("https://ztate.test/node/input-parser",)),
        ("two-ids", ("spiffe://ztate.test/node/input-parser", "spiffe://ztate.test/node/planner")),
        ("unknown-role", ("spiffe://ztate.test/root/input-parser",)),
        ("deep-path", ("spiffe://ztate.test/node/input-parser/extra",)),
    ],
)
async def test_unacceptable_spiffe_id_is_unauthenticated(
    target: str,
    pki: Pki,
    ledger: Ledger,
    stem: str,
    uris: tuple[str, ...],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No rejection row (the caller has no identity a row could name: docs/policy.md),
    but the refusal is logged, naming nothing the certificate claims."""
    caplog.set_level(logging.INFO, logger="ztate.rpc")
    thread_id = await make_thread(target, pki)
    before, rejections = await ledger.snapshot(thread_id), await ledger.rejection_count()
    async with client(target, pki.with_uris(stem, *uris)) as impostor:
        with pytest.raises(Unauthenticated) as caught:
            await impostor.propose(thread_id, 0, {"requested_action": act("x")})
        with pytest.raises(Unauthenticated):
            await impostor.get_view(thread_id)
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert caught.value.reason == "IDENTITY_INVALID"
    assert await ledger.snapshot(thread_id) == before
    assert await ledger.rejection_count() == rejections
    logged = [r.getMessage() for r in caplog.records if r.name == "ztate.rpc"]
    assert "refused ProposeTransition: IDENTITY_INVALID" in logged
    assert not any(uri in line for uri in uris for line in logged)


async def test_identity_claimed_in_metadata_is_ignored(
    target: str, pki: Pki, ledger: Ledger
) -> None:
    """A parser that says it is the db-writer still has the parser's allowlist."""
    thread_id = await make_thread(target, pki)
    before = await ledger.snapshot(thread_id)
    creds = channel_credentials(pki.node("input-parser"))
    request = transition_pb2.ProposeTransitionRequest(
        thread_id=thread_id,
        expected_version=0,
        patch_json=b'{"result_ref": "db://row/1"}',
        idempotency_key="claim",
    )
    metadata = (
        ("x-ztate-node", "db-writer"),
        ("x-spiffe-id", "spiffe://ztate.test/node/db-writer"),
        ("authorization", "Bearer db-writer"),
    )
    async with grpc.aio.secure_channel(target, creds) as channel:
        stub = transition_pb2_grpc.TransitionServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ProposeTransition(request, metadata=metadata, timeout=5)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "result_ref" in (caught.value.details() or "")
    assert await ledger.snapshot(thread_id) == before
    [row] = await ledger.rejections(thread_id)
    assert row["node_id"] == "spiffe://ztate.test/node/input-parser"


async def test_unregistered_node(target: str, pki: Pki, ledger: Ledger) -> None:
    thread_id = await make_thread(target, pki)
    before = await ledger.snapshot(thread_id)
    async with client(target, pki.node("intruder")) as intruder:
        with pytest.raises(PermissionDenied) as caught:
            await intruder.propose(thread_id, 0, {"requested_action": act("x")})
        with pytest.raises(PermissionDenied) as viewing:
            await intruder.get_view(thread_id)
    assert caught.value.reason == viewing.value.reason == "NODE_NOT_REGISTERED"
    assert await ledger.snapshot(thread_id) == before
    [row] = await ledger.rejections(thread_id)
    assert (row["reason"], row["node_id"]) == (
        "NODE_NOT_REGISTERED",
        "spiffe://ztate.test/node/intruder",
    )


@pytest.mark.parametrize("method", ["create_thread", "get_transition"])
async def test_nodes_may_not_use_privileged_calls(
    target: str, pki: Pki, ledger: Ledger, method: str
) -> None:
    thread_id = await make_thread(target, pki)
    async with client(target, pki.node("db-writer")) as writer:
        call = (
            writer.create_thread(new_thread_id(), {"raw_text": "x"}, policy="pipeline")
            if method == "create_thread"
            else writer.get_transition(thread_id=thread_id, version=0)
        )
        with pytest.raises(PermissionDenied) as caught:
            await call
    assert caught.value.reason == "ROLE_FORBIDDEN"


@pytest.mark.parametrize("role", ["operator", "reviewer", "service"])
async def test_only_nodes_propose(target: str, pki: Pki, ledger: Ledger, role: str) -> None:
    from ztate.services.runtime.identity import Role

    thread_id = await make_thread(target, pki)
    before = await ledger.snapshot(thread_id)
    async with client(target, pki.identity(Role(role), "someone")) as caller:
        with pytest.raises(ZtateError) as caught:
            await caller.propose(thread_id, 0, {"requested_action": act("x")})
    assert caught.value.reason == "ROLE_FORBIDDEN"
    assert await ledger.snapshot(thread_id) == before


async def test_reviewer_may_not_read_views(target: str, pki: Pki) -> None:
    from ztate.services.runtime.identity import Role

    thread_id = await make_thread(target, pki)
    async with client(target, pki.identity(Role.REVIEWER, "alice")) as reviewer:
        with pytest.raises(PermissionDenied) as caught:
            await reviewer.get_view(thread_id)
    assert caught.value.reason == "ROLE_FORBIDDEN"
