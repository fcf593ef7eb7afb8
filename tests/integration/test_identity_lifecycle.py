"""Identity lifecycle over real gRPC, real mTLS and a real Postgres: certificates, keys
and CA bundles rotate under running services and a proposing worker without a restart,
and a revoked certificate or identity is refused at its next call, on a connection that
is already open too, with IDENTITY_REVOKED (and a rejection row for a proposal).

Nothing sleeps: every step waits for the worker's proposals to move on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import grpc
import pytest
from cryptography import x509

from tests.harness import (
    INITIAL,
    TRUST_DOMAIN,
    USER,
    Credentials,
    Ledger,
    Pki,
    act,
    as_operator_sees_it,
    client,
    fresh_database,
    new_thread_id,
)
from ztate.contract.keyring import generate_signing_key
from ztate.services.cli import ca
from ztate.services.cli.main import main as ztate
from ztate.services.runtime import tls
from ztate.services.runtime.config import Settings
from ztate.services.runtime.identity import Identity, Role
from ztate.services.runtime.reloading import write_atomically
from ztate.testing._approval import deliver_approval
from ztate.transition_service.app import RunningService, start
from ztate.v1 import ledger_pb2, ledger_pb2_grpc, transition_pb2, transition_pb2_grpc
from ztate.worker_sdk import AwaitingApproval, CertificateExpired, IdentityRevoked, ZtateClient
from ztate.worker_sdk.errors import from_rpc_error

PROPOSER = "input-parser"


@contextlib.asynccontextmanager
async def serving(settings: Settings, dsn: str, **update: object) -> AsyncIterator[str]:
    """A transition service of its own (its own files), on the session's database."""
    running: RunningService = await start(
        settings.model_copy(update={"listen": "127.0.0.1:0", **update}), dsn=dsn
    )
    try:
        yield f"localhost:{running.port}"
    finally:
        await running.stop(grace=1.0)


def issue(ca_dir: Path, role: Role, name: str, out: Path) -> Credentials:
    paths = ca.issue(ca_dir, Identity(TRUST_DOMAIN, role, name), out)
    return Credentials(paths.cert, paths.key, paths.ca_cert)


def issue_until(ca_dir: Path, name: str, out: Path, not_after: datetime) -> Credentials:
    paths = ca.issue(ca_dir, Identity(TRUST_DOMAIN, Role.NODE, name), out, not_after=not_after)
    return Credentials(paths.cert, paths.key, paths.ca_cert)


def serial_of(cert: Path) -> int:
    return x509.load_pem_x509_certificate(cert.read_bytes()).serial_number


async def new_thread(target: str, operator: Credentials) -> str:
    thread_id = new_thread_id()
    async with client(target, operator) as admin:
        await admin.create_thread(thread_id, INITIAL, policy="pipeline")
    return thread_id


# --- revocation -------------------------------------------------------------------------


async def test_a_revoked_node_certificate_is_refused_on_its_open_connection(
    settings: Settings, database_dsn: str, pki: Pki, ledger: Ledger, tmp_path: Path
) -> None:
    revocations = tmp_path / "revocations.json"
    async with serving(settings, database_dsn, revocation_list_file=revocations) as target:
        thread_id = await new_thread(target, pki.operator())
        # a certificate of its own, so that revoking its serial leaves the others alone
        own = issue(pki.ca_dir, Role.NODE, PROPOSER, tmp_path / "worker")
        async with client(target, own) as worker:
            committed = await worker.propose(thread_id, 0, {"requested_action": act("one")})
            assert ztate(["ca", "revoke", "--cert", str(own.cert), "--list", str(revocations)]) == 0
            before = await ledger.snapshot(thread_id)
            with pytest.raises(IdentityRevoked) as caught:  # the same channel, already open
                await worker.propose(thread_id, committed.version, {"requested_action": act("two")})
        assert caught.value.code is grpc.StatusCode.UNAUTHENTICATED
        assert caught.value.reason == "IDENTITY_REVOKED"
        serial = format(serial_of(own.cert), "x")
        assert caught.value.message == (
            f"certificate {serial} of spiffe://{TRUST_DOMAIN}/node/{PROPOSER} is revoked"
        )
        assert await ledger.snapshot(thread_id) == before  # nothing committed
        rows = await ledger.rejections(thread_id)
        assert [(r["reason"], r["node_id"], r["base_version"]) for r in rows] == [
            ("IDENTITY_REVOKED", f"spiffe://{TRUST_DOMAIN}/node/{PROPOSER}", 1)
        ]
        # the serial names one certificate: another of the same identity still proposes
        async with client(target, pki.node(PROPOSER)) as other:
            assert (
                await other.propose(thread_id, 1, {"requested_action": act("three")})
            ).version == 2


async def test_a_revoked_operator_identity_is_refused_by_every_service_of_the_port(
    settings: Settings, database_dsn: str, pki: Pki, ledger: Ledger, tmp_path: Path
) -> None:
    revocations = tmp_path / "revocations.json"
    auditor = pki.operator("auditor")
    async with serving(settings, database_dsn, revocation_list_file=revocations) as target:
        credentials = grpc.ssl_channel_credentials(
            auditor.ca.read_bytes(), auditor.key.read_bytes(), auditor.cert.read_bytes()
        )
        async with grpc.aio.secure_channel(target, credentials) as channel:
            transitions = transition_pb2_grpc.TransitionServiceStub(channel)
            ledger_stub = ledger_pb2_grpc.LedgerServiceStub(channel)
            await ledger_stub.ListRejections(ledger_pb2.ListRejectionsRequest(page_size=1))
            spiffe_id = f"spiffe://{TRUST_DOMAIN}/operator/auditor"
            assert (
                ztate(["ca", "revoke", "--spiffe-id", spiffe_id, "--list", str(revocations)]) == 0
            )
            thread_id = new_thread_id()
            rejections = await ledger.rejection_count()
            for call in (
                transitions.CreateThread(
                    transition_pb2.CreateThreadRequest(
                        thread_id=thread_id, initial_state_json=b'{"raw_text": "x"}'
                    )
                ),
                ledger_stub.ListRejections(ledger_pb2.ListRejectionsRequest(page_size=1)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert caught.value.details() == f"identity {spiffe_id} is revoked"
        assert (await ledger.snapshot(thread_id)).head_version is None  # never created
        assert await ledger.rejection_count() == rejections  # only proposals leave rows
        # a new certificate of a revoked identity is refused as well
        renewed = issue(pki.ca_dir, Role.OPERATOR, "auditor", tmp_path / "renewed")
        async with client(target, renewed) as again:
            with pytest.raises(IdentityRevoked):
                await again.create_thread(new_thread_id(), INITIAL, policy="pipeline")


async def test_an_approval_by_a_reviewer_revoked_since_is_refused_not_committed(
    settings: Settings, database_dsn: str, pki: Pki, ledger: Ledger, tmp_path: Path
) -> None:
    """A receipt approved by a reviewer whose identity the transition service's list
    revokes by the time it is delivered (the service was out of reach, or the two
    services' lists are out of step) does not commit: the parked transition is refused
    IDENTITY_REVOKED, with a rejection row, and the thread's head stays."""
    revocations = tmp_path / "revocations.json"
    signing, public = tmp_path / "approval-signing.pem", tmp_path / "approval-public.json"
    generate_signing_key(signing, public, "approval-k1")
    update = {"revocation_list_file": revocations, "approval_public_keys_file": public}
    async with serving(settings, database_dsn, **update) as target:
        thread_id = await new_thread(target, pki.operator())
        async with client(target, pki.node("planner")) as planner:
            with pytest.raises(AwaitingApproval) as parked:
                await planner.propose(thread_id, 0, {"target_user_id": USER.replace("1", "2")})
        digest = (await as_operator_sees_it(database_dsn, parked.value)).digest
        reviewer = f"spiffe://{TRUST_DOMAIN}/reviewer/alice"  # deliver_approval's reviewer
        assert ztate(["ca", "revoke", "--spiffe-id", reviewer, "--list", str(revocations)]) == 0
        before = await ledger.snapshot(thread_id)
        applied = await deliver_approval(target, pki, signing, digest, thread_id, 0)
        assert applied.outcome == transition_pb2.OUTCOME_REFUSED
        assert applied.reason == "IDENTITY_REVOKED"
        assert await ledger.snapshot(thread_id) == before  # nothing committed
        rows = await ledger.rejections(thread_id)
        assert [(r["method"], r["reason"], r["base_version"]) for r in rows] == [
            ("ApplyDecision", "IDENTITY_REVOKED", 0)
        ]
        assert rows[0]["message"] == (
            "approved, but refused at commit: the approval of "
            f"{reviewer} no longer counts: the identity is revoked"
        )
        async with client(target, pki.node("planner")) as planner:
            outcome = await planner.wait_for_outcome(parked.value, within=5.0)
        assert (outcome.status, outcome.reason) == ("refused", "IDENTITY_REVOKED")


def raw_channel(target: str, creds: Credentials) -> grpc.aio.Channel:
    """A channel of the certificate as it is on disk now (no SDK: no reload, no retry)."""
    return grpc.aio.secure_channel(
        target,
        grpc.ssl_channel_credentials(
            creds.ca.read_bytes(), creds.key.read_bytes(), creds.cert.read_bytes()
        ),
    )


async def test_a_certificate_that_expires_on_an_open_connection_is_refused_there(
    settings: Settings, database_dsn: str, pki: Pki, ledger: Ledger, tmp_path: Path
) -> None:
    """TLS checks a certificate's dates at the handshake only. A connection made while
    it was valid and kept open past its notAfter is refused CERTIFICATE_EXPIRED at its
    next call (a proposal with a rejection row, nothing committed), and a watch opened
    before ends at its next version instead of sending it."""
    async with serving(settings, database_dsn) as target:
        thread_id = await new_thread(target, pki.operator())
        not_after = (datetime.now(UTC) + timedelta(seconds=3)).replace(microsecond=0)
        short = issue_until(pki.ca_dir, PROPOSER, tmp_path / "short", not_after)
        async with raw_channel(target, short) as channel:
            stub = transition_pb2_grpc.TransitionServiceStub(channel)
            view = await stub.GetView(transition_pb2.GetViewRequest(thread_id=thread_id))
            assert view.version == 0
            watch = stub.WatchThread(
                transition_pb2.WatchThreadRequest(thread_id=thread_id, from_version=-1)
            )
            assert (await watch.read()).version == 0  # the stream is open and serving
            # what is tested is the certificate's own end: wall-clock time must pass it
            await asyncio.sleep((not_after - datetime.now(UTC)).total_seconds() + 1.1)
            before = await ledger.snapshot(thread_id)
            spiffe_id = f"spiffe://{TRUST_DOMAIN}/node/{PROPOSER}"
            said = f"the certificate of {spiffe_id} expired at {not_after:%Y-%m-%dT%H:%M:%SZ}"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ProposeTransition(
                    transition_pb2.ProposeTransitionRequest(
                        thread_id=thread_id,
                        expected_version=0,
                        patch_json=b'{"requested_action": {"action": "refund", "order_id": "X"}}',
                        idempotency_key="expired-1",
                    )
                )
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            error = from_rpc_error(refused.value)
            assert isinstance(error, CertificateExpired)
            assert (error.reason, error.message) == ("CERTIFICATE_EXPIRED", f"{said}: renew it")
            assert await ledger.snapshot(thread_id) == before  # nothing committed
            rows = await ledger.rejections(thread_id)
            assert [(r["reason"], r["node_id"]) for r in rows] == [
                ("CERTIFICATE_EXPIRED", spiffe_id)
            ]
            # another node commits: the open watch does not send the new state
            async with client(target, pki.node(PROPOSER)) as fresh:
                await fresh.propose(thread_id, 0, {"requested_action": act("after")})
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(watch.read(), 30)
            assert ended.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert from_rpc_error(ended.value).reason == "CERTIFICATE_EXPIRED"


async def test_a_revoked_node_gets_no_more_work_on_its_open_subscription(
    settings: Settings, postgres_server_dsn: str, pki: Pki, tmp_path: Path
) -> None:
    """A SubscribeWork stream opened before its node was revoked ends IDENTITY_REVOKED at
    its next item: no state, no lease sent to it. (A database of its own: only this
    test's threads wake the node, so the stream has room for the second.)"""
    revocations = tmp_path / "revocations.json"
    update = {"revocation_list_file": revocations, "work_poll_seconds": 0.1}
    dsn = await fresh_database(postgres_server_dsn)
    async with serving(settings, dsn, **update) as target:
        first = await new_thread(target, pki.operator())
        async with client(target, pki.node(PROPOSER)) as parser:
            await parser.propose(first, 0, {"requested_action": act("one")})
        own = issue(pki.ca_dir, Role.NODE, "planner", tmp_path / "planner")
        async with raw_channel(target, own) as channel:
            stub = transition_pb2_grpc.TransitionServiceStub(channel)
            work = stub.SubscribeWork(transition_pb2.SubscribeWorkRequest(max_in_flight=4))
            assert (await asyncio.wait_for(work.read(), 30)).thread_id == first
            spiffe_id = f"spiffe://{TRUST_DOMAIN}/node/planner"
            revoke = ["ca", "revoke", "--spiffe-id", spiffe_id, "--list", str(revocations)]
            assert ztate(revoke) == 0
            second = await new_thread(target, pki.operator())
            async with client(target, pki.node(PROPOSER)) as parser:
                await parser.propose(second, 0, {"requested_action": act("two")})
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(work.read(), 30)
            assert ended.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert ended.value.details() == f"identity {spiffe_id} is revoked"
        # the lease granted for the item it was not sent went back undone, at once (not
        # at its TTL): another process of the node takes the thread
        conn = await asyncpg.connect(dsn)
        try:
            row = await conn.fetchrow(
                "SELECT epoch, holder, handled_version FROM ztate.node_work "
                "WHERE thread_id = $1 AND node = 'planner'",
                second,
            )
        finally:
            await conn.close()
        assert (row["epoch"], row["holder"], row["handled_version"]) == (1, None, -1)


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(b'{"format": "ztate-revocations/1", "revoked": [', id="cut-short"),
        pytest.param(b"[" * 100_000, id="nested-too-deeply"),
        pytest.param(None, id="a-link-to-dev-zero"),  # endless: read to a bound
    ],
)
async def test_a_revocation_list_that_breaks_keeps_the_last_one_read(
    settings: Settings,
    database_dsn: str,
    pki: Pki,
    tmp_path: Path,
    broken: bytes | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A list replaced by one that cannot be read (cut short, nested past the parser's
    depth, endless) keeps the last list read: the revoked stay
    refused, everyone else is served (not INTERNAL), and the log says so once."""
    revocations = tmp_path / "revocations.json"
    spiffe_id = f"spiffe://{TRUST_DOMAIN}/operator/auditor"
    assert ztate(["ca", "revoke", "--spiffe-id", spiffe_id, "--list", str(revocations)]) == 0
    async with serving(settings, database_dsn, revocation_list_file=revocations) as target:
        if broken is None:
            (tmp_path / "zero").symlink_to("/dev/zero")
            (tmp_path / "zero").replace(revocations)
        else:
            write_atomically(revocations, broken, 0o644)
        async with client(target, pki.operator("auditor")) as auditor:
            for _ in range(2):
                with pytest.raises(IdentityRevoked):
                    await auditor.create_thread(new_thread_id(), INITIAL, policy="pipeline")
        async with client(target, pki.operator()) as operator:
            await operator.create_thread(new_thread_id(), INITIAL, policy="pipeline")
        kept = [r.getMessage() for r in caplog.records if "cannot be loaded" in r.getMessage()]
        assert len(kept) == 1, kept
        assert kept[0].startswith(f"revocation list {revocations} changed but cannot be loaded")
        revocations.unlink()  # losing the file forgives nobody either
        async with client(target, pki.operator("auditor")) as auditor:
            with pytest.raises(IdentityRevoked):
                await auditor.create_thread(new_thread_id(), INITIAL, policy="pipeline")


# --- rotation ---------------------------------------------------------------------------


@dataclass
class ProposingWorker:
    """Proposes on one thread, one version after another, until stopped; every refusal
    or transport failure that outlived the SDK's own retries is kept in ``failures``."""

    client: ZtateClient
    thread_id: str
    committed: int = 0
    failures: list[BaseException] = field(default_factory=list)
    moved: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                done = await self.client.propose(
                    self.thread_id, self.committed, {"requested_action": act(f"v{self.committed}")}
                )
            except Exception as failure:  # kept: the test asserts there is none
                self.failures.append(failure)
                async with self.moved:
                    self.moved.notify_all()
                return
            async with self.moved:
                self.committed = done.version
                self.moved.notify_all()

    async def moves_on(self, proposals: int = 3) -> None:
        """Wait until ``proposals`` more proposals committed (or one failed)."""
        target = self.committed + proposals
        async with self.moved:
            await asyncio.wait_for(
                self.moved.wait_for(lambda: self.committed >= target or bool(self.failures)),
                timeout=30,
            )
        assert self.failures == []


def bundle(*ca_dirs: Path) -> bytes:
    return b"".join((d / ca.CA_CERT).read_bytes() for d in ca_dirs)


def trust(files: Credentials, *ca_dirs: Path) -> None:
    write_atomically(files.ca, bundle(*ca_dirs), 0o644)


async def handshake_refused(target: str, creds: Credentials) -> grpc.StatusCode:
    credentials = grpc.ssl_channel_credentials(
        creds.ca.read_bytes(), creds.key.read_bytes(), creds.cert.read_bytes()
    )
    async with grpc.aio.secure_channel(target, credentials) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await transition_pb2_grpc.TransitionServiceStub(channel).GetView(
                transition_pb2.GetViewRequest(thread_id="t-none"), timeout=5
            )
    return caught.value.code()


async def test_a_connection_made_under_a_ca_since_removed_ends_at_its_maximum_age(
    settings: Settings, database_dsn: str, pki: Pki, tmp_path: Path
) -> None:
    """TLS checks a client's chain when it connects. A connection made under a CA that
    the service has since removed from its bundle served on for as long as it lasted;
    it now ends at the service's maximum connection age, and the client's next call
    connects again and is refused in the handshake."""
    other_ca = tmp_path / "other-ca"
    ca.init_ca(other_ca, TRUST_DOMAIN)
    bundle_file = tmp_path / "trusted.crt"
    write_atomically(bundle_file, (pki.ca_dir / ca.CA_CERT).read_bytes() + bundle(other_ca), 0o644)
    worker = issue(other_ca, Role.NODE, PROPOSER, tmp_path / "worker")
    # the client trusts the suite's CA, which signed the service's certificate
    worker = Credentials(worker.cert, worker.key, pki.ca_dir / ca.CA_CERT)
    update = {"tls_ca": bundle_file, "max_connection_age_seconds": 1.0}
    async with serving(settings, database_dsn, **update) as target:
        thread_id = await new_thread(target, pki.operator())
        async with raw_channel(target, worker) as channel:
            stub = transition_pb2_grpc.TransitionServiceStub(channel)
            request = transition_pb2.GetViewRequest(thread_id=thread_id)
            assert (await stub.GetView(request, timeout=5)).version == 0
            write_atomically(bundle_file, (pki.ca_dir / ca.CA_CERT).read_bytes(), 0o644)
            # the same channel: it serves until the service ends the connection (at its
            # age, 1 s here, with gRPC's jitter), then its next handshake is refused
            refused = None
            deadline = asyncio.get_running_loop().time() + 20
            while refused is None and asyncio.get_running_loop().time() < deadline:
                try:
                    await stub.GetView(request, timeout=5)
                except grpc.aio.AioRpcError as error:
                    refused = error
                else:
                    await asyncio.sleep(0.1)  # polling the service's timer, bounded above
            assert refused is not None, "the connection outlived its maximum age"
            assert refused.code() is grpc.StatusCode.UNAVAILABLE


async def test_certificates_and_the_ca_rotate_under_a_proposing_worker(
    settings: Settings, database_dsn: str, ledger: Ledger, tmp_path: Path
) -> None:
    old_ca, new_ca = tmp_path / "old-ca", tmp_path / "new-ca"
    ca.init_ca(old_ca, TRUST_DOMAIN)
    server = ca.issue(
        old_ca,
        Identity(TRUST_DOMAIN, Role.SERVICE, "transition"),
        tmp_path / "server",
        dns_names=("localhost",),
    )
    worker_files = issue(old_ca, Role.NODE, PROPOSER, tmp_path / "worker")
    operator = issue(old_ca, Role.OPERATOR, "admin", tmp_path / "operator")
    revocations = tmp_path / "revocations.json"
    async with serving(
        settings,
        database_dsn,
        tls_cert=server.cert,
        tls_key=server.key,
        tls_ca=server.ca_cert,
        revocation_list_file=revocations,
    ) as target:
        thread_id = await new_thread(target, operator)
        stop = asyncio.Event()
        async with client(target, worker_files) as sdk:
            worker = ProposingWorker(sdk, thread_id)
            task = asyncio.create_task(worker.run(stop))
            try:
                await worker.moves_on()
                # the overlap: both sides trust the old and the new CA
                ca.init_ca(new_ca, TRUST_DOMAIN)
                trust(Credentials(server.cert, server.key, server.ca_cert), old_ca, new_ca)
                trust(worker_files, old_ca, new_ca)
                await worker.moves_on()
                # the server's certificate, from the new CA: new handshakes present it
                old_server_serial = serial_of(server.cert)
                ca.renew(new_ca, server.cert, previous=(old_ca,))
                assert serial_of(server.cert) != old_server_serial
                await worker.moves_on()
                # the worker's certificate, from the new CA: the SDK opens a new channel
                old_worker_serial = serial_of(worker_files.cert)
                ca.renew(new_ca, worker_files.cert, previous=(old_ca,))
                await worker.moves_on()
                # the old certificate is no longer in use: revoking it stops nothing
                assert ztate(
                    ["ca", "revoke", "--serial", format(old_worker_serial, "x"),
                     "--list", str(revocations)]
                ) == 0  # fmt: skip
                await worker.moves_on()
                # the end of the overlap: only the new CA is trusted, on both sides
                trust(Credentials(server.cert, server.key, server.ca_cert), new_ca)
                trust(worker_files, new_ca)
                await worker.moves_on()
            finally:
                stop.set()
                await task
        assert worker.failures == []
        # a certificate of the removed CA is refused at the handshake: no RPC runs
        rejections = await ledger.rejection_count()
        stale = issue(old_ca, Role.NODE, "planner", tmp_path / "stale")
        stale_with_new_trust = Credentials(stale.cert, stale.key, worker_files.ca)
        assert await handshake_refused(target, stale_with_new_trust) is grpc.StatusCode.UNAVAILABLE
        assert await ledger.rejection_count() == rejections
        # every proposal committed, in one unbroken chain
        assert await ledger.verify(thread_id) == worker.committed + 1
        assert worker.committed >= 18


async def test_a_server_keeps_its_files_while_a_new_certificate_lacks_its_key(
    settings: Settings, database_dsn: str, pki: Pki, tmp_path: Path
) -> None:
    server = ca.issue(
        pki.ca_dir,
        Identity(TRUST_DOMAIN, Role.SERVICE, "transition"),
        tmp_path / "server",
        dns_names=("localhost",),
    )
    async with serving(
        settings, database_dsn, tls_cert=server.cert, tls_key=server.key, tls_ca=server.ca_cert
    ) as target:
        # a new certificate whose key has not arrived yet: handshakes go on with the old pair
        other = ca.issue(
            pki.ca_dir,
            Identity(TRUST_DOMAIN, Role.SERVICE, "transition"),
            tmp_path / "other",
            dns_names=("localhost",),
        )
        write_atomically(server.cert, other.cert.read_bytes(), 0o644)
        async with client(target, pki.operator()) as operator:
            await operator.create_thread(new_thread_id(), INITIAL, policy="pipeline")
        # the key arrives: the new pair is taken, and handshakes go on
        write_atomically(server.key, other.key.read_bytes(), 0o600)
        async with client(target, pki.operator()) as operator:
            await operator.create_thread(new_thread_id(), INITIAL, policy="pipeline")


async def test_a_service_calling_another_takes_its_renewed_files(
    target: str, pki: Pki, tmp_path: Path
) -> None:
    files = ca.issue(
        pki.ca_dir, Identity(TRUST_DOMAIN, Role.SERVICE, "approval"), tmp_path / "approval"
    )
    outgoing = tls.ServiceChannel(target, files.cert, files.key, files.ca_cert)
    try:
        first = await outgoing.channel()
        assert await outgoing.channel() is first  # unchanged files: the same channel
        ca.renew(pki.ca_dir, files.cert)
        second = await outgoing.channel()
        assert second is not first
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # a call over mTLS, refused by role
            await transition_pb2_grpc.TransitionServiceStub(second).GetView(
                transition_pb2.GetViewRequest(thread_id=new_thread_id()), timeout=10
            )
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await outgoing.close()
