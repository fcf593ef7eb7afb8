"""Nothing a node may not read reaches it, not even as a digest.

A record digest, a head digest and a record's ``state_digest`` each commit to the whole
state, keys outside the node's projection included: a node holding one can confirm
guesses of those keys offline (for its own commit it knows every other member of the
record). So a node whose policy does not mark it ``read_records`` is answered with
versions, outcomes and its own projection only. This walks every RPC such a node can
call, over real mTLS, collects every byte it receives (messages, status details and
trailers), and checks that no digest of any kind and no value outside its projection is
among them; then it tries the attacker's offline guessing against what was received.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
import pytest_asyncio

from tests.harness import (
    INITIAL,
    TRUST_DOMAIN,
    Pki,
    client,
    deliver_approval,
    fresh_database,
    secure_channel,
)
from ztate.contract.canonical import canonical_bytes
from ztate.contract.keyring import Keyring, generate_signing_key
from ztate.services.runtime.config import Settings
from ztate.transition_service.app import RunningService, start
from ztate.v1 import transition_pb2, transition_pb2_grpc

HEX64 = re.compile(rb"[0-9a-f]{64}")
OTHER_USER = "9b2f5d0e-1c3a-4e6b-8d7f-0a1b2c3d4e5f"
# the value of a key the planner may not read (docs/policy.md): raw_text is the input
# parser's; the planner reads authority, target_user_id and requested_action
HIDDEN = (INITIAL["raw_text"],)


class Received:
    """Every byte a node was sent: reply messages, status messages and trailers."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def add(self, data: bytes | str) -> None:
        self.chunks.append(data if isinstance(data, bytes) else data.encode())

    def metadata(self, pairs: Any) -> None:
        for key, value in pairs or ():
            self.add(key)
            self.add(value)

    async def unary(self, call: Any) -> Any:
        """The reply of a unary call (or None if refused), everything recorded."""
        try:
            reply = await call
        except grpc.aio.AioRpcError as refused:
            self.add(refused.details() or "")
            self.metadata(refused.trailing_metadata())
            self.metadata(refused.initial_metadata())
            return None
        self.add(reply.SerializeToString())
        self.metadata(await call.initial_metadata())
        self.metadata(await call.trailing_metadata())
        return reply

    @property
    def everything(self) -> bytes:
        return b"\n".join(self.chunks)


@pytest_asyncio.fixture(scope="module")
async def served(
    postgres_server_dsn: str,
    pki: Pki,
    keyring_file: Path,
    policy_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[RunningService, str, Path]]:
    """A transition service that accepts receipts signed by a key this test holds."""
    root = tmp_path_factory.mktemp("confidential")
    dsn = await fresh_database(postgres_server_dsn)
    generate_signing_key(root / "signing-key.pem", root / "approval-public.json", "approval-k1")
    settings = Settings(
        home=root / "home",
        listen="127.0.0.1:0",
        trust_domain=TRUST_DOMAIN,
        tls_cert=pki.certs / "service-transition.crt",
        tls_key=pki.certs / "service-transition.key",
        tls_ca=pki.certs / "ca.crt",
        policy_path=policy_dir,
        hmac_keyring_file=keyring_file,
        approval_public_keys_file=root / "approval-public.json",
        db_pool_size=4,
    )
    service = await start(settings, dsn=dsn)
    yield service, dsn, root / "signing-key.pem"
    await service.stop(grace=1.0)


async def approve(target: str, pki: Pki, key: Path, pending: asyncpg.Record) -> None:
    """ApplyDecision as the approval service would, with a genuine signed receipt."""
    applied = await deliver_approval(
        target, pki, key, pending["digest"], pending["thread_id"], pending["base_version"]
    )
    assert applied.outcome == transition_pb2.OUTCOME_COMMITTED


async def ledger_secrets(dsn: str, thread_id: str) -> set[bytes]:
    """Every digest the database holds for the thread: record digests, parents,
    signatures, state digests inside records, parked proposals' digests and state."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT digest, parent_digest, signature, record FROM ztate.transitions "
            "WHERE thread_id = $1",
            thread_id,
        )
        pending = await conn.fetch(
            "SELECT digest, proposal, state FROM ztate.pending_transitions WHERE thread_id = $1",
            thread_id,
        )
    finally:
        await conn.close()
    found: set[bytes] = set()
    for row in rows:
        record = json.loads(bytes(row["record"]))
        found |= {row["digest"].encode(), row["parent_digest"].encode(), row["signature"].encode()}
        found.add(record["state_digest"].encode())
    for row in pending:
        found.add(row["digest"].encode())
        found.add(hashlib.sha256(bytes(row["state"])).hexdigest().encode())
        found |= set(HEX64.findall(bytes(row["proposal"])))
    return found


async def test_an_unmarked_node_receives_no_digest_and_no_hidden_value_from_any_rpc(
    served: tuple[RunningService, str, Path], pki: Pki, keyring: Keyring
) -> None:
    service, dsn, signing_key = served
    target = f"localhost:{service.port}"
    thread_id = f"conf-{uuid.uuid4().hex[:12]}"
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    received = Received()
    request = transition_pb2.ProposeTransitionRequest
    async with secure_channel(target, pki.node("planner")) as opened:
        stub = transition_pb2_grpc.TransitionServiceStub(opened)
        view = await received.unary(
            stub.GetView(transition_pb2.GetViewRequest(thread_id=thread_id))
        )
        assert view.head_digest == ""
        plan = {"action": "refund", "order_id": "A-42", "amount_cents": 1200}
        commit = request(
            thread_id=thread_id,
            expected_version=0,
            patch_json=canonical_bytes({"pending_transition": plan}),
            idempotency_key="c-1",
        )
        committed = await received.unary(stub.ProposeTransition(commit))
        replayed = await received.unary(stub.ProposeTransition(commit))
        assert committed.transition.version == replayed.transition.version == 1
        assert replayed.replayed
        told = committed.transition
        assert (told.digest, told.parent_digest, told.signature, told.record_json) == (
            "",
            "",
            "",
            b"",
        )
        assert told.node_id == f"spiffe://{TRUST_DOMAIN}/node/planner"
        # refusals of every kind, with their details in the trailers
        for refused in (
            request(
                thread_id=thread_id,
                expected_version=1,
                patch_json=b'{"raw_text": "x"}',
                idempotency_key="r-1",
            ),
            request(
                thread_id=thread_id,
                expected_version=0,
                patch_json=canonical_bytes({"pending_transition": None}),
                idempotency_key="r-2",
            ),
            request(
                thread_id=thread_id, expected_version=1, patch_json=b"{", idempotency_key="r-3"
            ),
        ):
            assert await received.unary(stub.ProposeTransition(refused)) is None
        # a risky change is parked: told how to wait, not what it is
        risky = request(
            thread_id=thread_id,
            expected_version=1,
            patch_json=canonical_bytes({"target_user_id": OTHER_USER}),
            idempotency_key="p-1",
        )
        parked = await received.unary(stub.ProposeTransition(risky))
        parked_again = await received.unary(stub.ProposeTransition(risky))
        assert parked.WhichOneof("outcome") == "pending"
        pending = parked.pending
        assert (pending.digest, pending.proposal_json, list(pending.risk_rules)) == ("", b"", [])
        assert pending.handle == f"{thread_id}/p-1" == parked_again.pending.handle
        waiting = await received.unary(
            stub.WaitForOutcome(
                transition_pb2.WaitForOutcomeRequest(handle=pending.handle), timeout=1.0
            )
        )
        assert waiting.outcome == transition_pb2.OUTCOME_PENDING
        # ... and may not probe digests to confirm a guess
        conn = await asyncpg.connect(dsn)
        try:
            row = await conn.fetchrow(
                "SELECT digest, thread_id, base_version FROM ztate.pending_transitions "
                "WHERE thread_id = $1",
                thread_id,
            )
        finally:
            await conn.close()
        assert row is not None
        probe = transition_pb2.WaitForOutcomeRequest(digest=row["digest"])
        assert await received.unary(stub.WaitForOutcome(probe, timeout=5)) is None
        # approved, then committed: the waiter learns the version
        await approve(target, pki, signing_key, row)
        decided = await received.unary(
            stub.WaitForOutcome(
                transition_pb2.WaitForOutcomeRequest(handle=pending.handle), timeout=10
            )
        )
        assert decided.outcome == transition_pb2.OUTCOME_COMMITTED
        assert decided.transition.version == 2
        assert (decided.transition.digest, decided.transition.record_json) == ("", b"")
        # records and checkpoints are refused outright, in every lookup form
        for lookup in (
            transition_pb2.GetTransitionRequest(head_of_thread=thread_id),
            transition_pb2.GetTransitionRequest(
                thread_version=transition_pb2.ThreadVersion(thread_id=thread_id, version=1)
            ),
            transition_pb2.GetTransitionRequest(digest=row["digest"]),
        ):
            assert await received.unary(stub.GetTransition(lookup)) is None
        checkpoint = transition_pb2.GetCheckpointRequest(thread_id=thread_id)
        assert await received.unary(stub.GetCheckpoint(checkpoint)) is None
        # the stream of versions, from genesis
        watch = stub.WatchThread(
            transition_pb2.WatchThreadRequest(thread_id=thread_id, from_version=-1), timeout=10
        )
        versions = []
        async for version in watch:
            received.add(version.SerializeToString())
            versions.append(version.version)
            assert version.digest == ""
            if version.version == 2:
                break
        watch.cancel()
        assert versions == [0, 1, 2]

    everything = received.everything
    # no digest of any kind: nothing 64-hex long, in particular none of the ledger's
    assert HEX64.findall(everything) == []
    assert not any(secret in everything for secret in await ledger_secrets(dsn, thread_id))
    # no value the planner may not read
    for hidden in HIDDEN:
        assert hidden.encode() not in everything
        assert json.dumps(hidden).encode() not in everything
    # the attacker's offline test: a guessed state hashed as the ledger hashes it, and
    # the record rebuilt around it, match nothing received (the guess here is the truth,
    # the strongest case)
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT state, record FROM ztate.transitions WHERE thread_id = $1", thread_id
        )
    finally:
        await conn.close()
    for row in rows:
        assert hashlib.sha256(bytes(row["state"])).hexdigest().encode() not in everything
        assert hashlib.sha256(bytes(row["record"])).hexdigest().encode() not in everything


async def test_a_node_marked_read_records_still_receives_digests_and_records(
    served: tuple[RunningService, str, Path], pki: Pki
) -> None:
    """The db-writer verifies approvals before it acts: it needs them (docs/api.md)."""
    service, _dsn, _key = served
    target = f"localhost:{service.port}"
    thread_id = f"conf-{uuid.uuid4().hex[:12]}"
    async with client(target, pki.operator()) as operator:
        await operator.create_thread(thread_id, INITIAL, policy="pipeline")
    async with client(target, pki.node("db-writer")) as writer:
        view = await writer.get_view(thread_id)
        committed = await writer.propose(thread_id, view.version, {"result_ref": "db://orders/r-1"})
    assert HEX64.fullmatch(view.head_digest.encode())
    assert HEX64.fullmatch(committed.digest.encode())
    assert committed.record["patch"] == {"result_ref": "db://orders/r-1"}
