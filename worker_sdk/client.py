"""The asynchronous client an agent worker uses to talk to ztate."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from ztate.v1 import transition_pb2, transition_pb2_grpc
from ztate.worker_sdk._credentials import CertificateFiles, Pems
from ztate.worker_sdk._handshake import check_own_certificate, diagnose
from ztate.worker_sdk._tracing import client_interceptors
from ztate.worker_sdk.errors import (
    DETAILS_KEY,
    AwaitingApproval,
    HandshakeFailed,
    ProtocolError,
    RecordWithheld,
    StaleVersion,
    Unavailable,
    ZtateError,
    from_rpc_error,
)

DEFAULT_TIMEOUT_SECONDS = 10.0
DEFAULT_RETRIES = 3
# Transport failures whose outcome is unknown or that never reached the service.
# Retried only for calls that are safe to repeat (a proposal keeps its
# idempotency key, so a retry returns the original outcome).
# A watch stream that ends normally after at least this long served its purpose.
NORMAL_END_SECONDS = 1.0
# The largest reply a ztate server can be configured to send (a revert's detail: 64 MiB
# of state, and its record and patch each holding a whole state of up to 64 MiB, and the
# other fields); the server's own limits are docs/api.md's "Limits".
MAX_REPLY_BYTES = 3 * 64 * 1024 * 1024 + 64 * 1024
# wait_for_outcome asks again after a "pending" answer while more than this is left
ASK_AGAIN_SECONDS = 0.5
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# the outcomes WaitForOutcome may answer (UNSPECIFIED is the enum's zero, never sent)
_OUTCOMES = frozenset(transition_pb2.Outcome.values()) - {transition_pb2.OUTCOME_UNSPECIFIED}
Reply = TypeVar("Reply")


def _bad_reply(kind: str, fault: str) -> ProtocolError:
    """The ``ProtocolError`` (BAD_REPLY) for a reply of the service, or a part of one,
    of message type ``kind`` that the protocol does not allow; ``fault`` says what is
    wrong with it, never with the reply's bytes (they may hold state values)."""
    answered = (
        f"answered {kind.removesuffix('Response')}"
        if kind.endswith("Response")
        else f"sent a {kind}"
    )
    return ProtocolError(f"the service {answered} {fault}")


def _require(message: Message, *fields: str) -> None:
    """Raise ``ProtocolError`` (BAD_REPLY) unless each of ``fields`` (a sub-message or a
    oneof) is set in ``message``, a reply of the service or a part of one. proto3 cannot
    mark them required, and an unset one reads as an empty message (a Transition of
    empty fields, a time of 1970), which a worker would take for the service's answer."""
    missing = [name for name in fields if not message.HasField(name)]
    if missing:
        raise _bad_reply(message.DESCRIPTOR.name, f"without the {', '.join(missing)}")


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _json_object(data: bytes, kind: str, field: str) -> dict[str, Any]:
    """The JSON object that ``field`` of a reply (or a part of one) of message type
    ``kind`` carries; ``ProtocolError`` (BAD_REPLY) when it is empty, not UTF-8 JSON or
    not an object. A worker is not to crash with a decoding traceback on what a
    misbehaving service or proxy sent, nor to be told its bytes (they may hold state
    values): the error names the field and the fault only."""
    if not data:
        raise _bad_reply(kind, f"with an empty {field}")
    try:  # UTF-8 only (json.loads would guess UTF-16 or 32), no NaN or Infinity
        parsed = json.loads(data.decode("utf-8"), parse_constant=_not_json)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _bad_reply(kind, f"with a {field} that is not JSON") from None
    if not isinstance(parsed, dict):
        raise _bad_reply(kind, f"with a {field} that is not a JSON object")
    return parsed


@dataclass(frozen=True, slots=True)
class Transition:
    """A committed ledger record, as the transition service returned it."""

    thread_id: str
    version: int
    digest: str
    parent_digest: str
    signature: str
    key_id: str
    node_id: str
    committed_at: datetime
    record_json: bytes
    replayed: bool = False

    @property
    def record(self) -> dict[str, Any]:
        """The parsed ledger record (see docs/ledger-format.md).

        Raises ``RecordWithheld`` for a node whose policy does not mark it
        ``read_records``: it receives versions and outcomes, no record and no digest;
        ``ProtocolError`` for record bytes that are not a JSON object.
        """
        if not self.record_json:
            raise RecordWithheld(
                "records and digests are disclosed only to operators and to nodes whose "
                "policy marks them read_records"
            )
        return _json_object(self.record_json, "Transition", "record_json")

    @classmethod
    def from_message(cls, msg: transition_pb2.Transition, *, replayed: bool = False) -> Transition:
        """From the wire message (``ProtocolError`` without its commit time)."""
        _require(msg, "committed_at")
        return cls(
            thread_id=msg.thread_id,
            version=msg.version,
            digest=msg.digest,
            parent_digest=msg.parent_digest,
            signature=msg.signature,
            key_id=msg.key_id,
            node_id=msg.node_id,
            committed_at=msg.committed_at.ToDatetime(),
            record_json=msg.record_json,
            replayed=replayed,
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of a parked transition: ``status`` is one of "pending",
    "committed", "rejected", "expired", "stale" or "refused" (approved, but the policy
    in force when it came to commit no longer allowed it: ``reason`` says why);
    ``transition`` is set once committed."""

    status: str
    transition: Transition | None = None
    reason: str | None = None  # why, when "refused" (approved, but no longer allowed)


@dataclass(frozen=True, slots=True)
class View:
    """The keys of a thread's head this worker may read, at one version."""

    thread_id: str
    version: int
    head_digest: str
    state: dict[str, Any]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One new version of a watched thread, as this worker may see it.

    ``state`` holds only the keys this worker may read, at ``version``; it is
    ``None`` when retention pruned that version's state (``get_view`` reads the
    head instead).
    """

    thread_id: str
    version: int
    digest: str
    state: dict[str, Any] | None

    def as_view(self) -> View | None:
        """This version as a ``View`` (None when its state was pruned)."""
        if self.state is None:
            return None
        return View(self.thread_id, self.version, self.digest, self.state)


@dataclass(frozen=True, slots=True)
class WorkItem:
    """A thread on which this node has work, leased to this process (SubscribeWork).

    ``state`` is the node's projection at ``version``, the head to build on.
    Propose with ``lease_epoch`` (a committed or parked proposal releases the
    lease), or ``release_lease``; ``renew_lease`` before ``lease_expires_at`` while
    working. ``NodeRunner.serve`` does all of this."""

    thread_id: str
    version: int
    state: dict[str, Any]
    lease_epoch: int
    lease_expires_at: datetime
    lease_ttl: float
    head_digest: str = ""  # empty unless the node's policy marks it read_records

    def as_view(self) -> View:
        return View(self.thread_id, self.version, self.head_digest, self.state)


@dataclass(frozen=True, slots=True)
class Receipt:
    """An approval receipt as the approval service signed it (docs/approvals.md)."""

    receipt_json: bytes
    signature: str
    key_id: str


@dataclass(frozen=True, slots=True)
class HeadRecord:
    """A ledger record with the approval receipt it was committed under (if any) and
    the risk rules the approved proposal matched."""

    transition: Transition
    receipt: Receipt | None
    risk_rules: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A thread head signed with the transition service's Ed25519 checkpoint key."""

    checkpoint_json: bytes
    signature: str
    key_id: str


def encode_json(value: dict[str, Any]) -> bytes:
    """JSON for the wire; NaN and infinities are refused here, as the server would."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


@dataclass(eq=False)
class _Connection:
    """One channel and the calls in flight on it; a retired one closes once they end."""

    channel: grpc.aio.Channel
    stub: transition_pb2_grpc.TransitionServiceStub
    pems: Pems
    calls: int = 0
    retired: bool = field(default=False)


class ZtateClient:
    """A connection to the transition service, authenticated by this worker's certificate.

    Use it as an async context manager, or call ``close()``. Every method raises a
    subclass of ``worker_sdk.ZtateError`` when the call is refused.

    Built ``from_files`` (or ``from_env``), the client reads the certificate, key and CA
    files again when they change, and then sends its next calls on a new channel with
    them; the old channel closes once the calls in flight on it have ended. Rotating a
    worker's certificate is replacing its files: no restart.
    """

    def __init__(
        self,
        target: str,
        *,
        cert_pem: bytes,
        key_pem: bytes,
        ca_pem: bytes,
        server_name: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        retries: int = DEFAULT_RETRIES,
        backoff: float = 0.1,
        tracer_provider: Any = None,
        certificate_files: CertificateFiles | None = None,
    ) -> None:
        self._retries = retries
        self._backoff = backoff
        self._target = target
        self._options: list[tuple[str, Any]] = [
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            # every reply the server may send: a view of a state at its largest limit
            ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
        ]
        if server_name:
            self._options.append(("grpc.ssl_target_name_override", server_name))
        self._server_name = server_name
        # files the handshake can only refuse fail here, with what to fix (HandshakeFailed)
        check_own_certificate(Pems(cert_pem, key_pem, ca_pem))
        # Traced when OpenTelemetry is configured (or ``tracer_provider`` is given).
        self._interceptors = client_interceptors(tracer_provider) or None
        self._files = certificate_files
        self._connection = self._connect(Pems(cert_pem, key_pem, ca_pem))
        self._retired: set[_Connection] = set()
        self._timeout = timeout

    def _connect(self, pems: Pems) -> _Connection:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=pems.ca, private_key=pems.key, certificate_chain=pems.cert
        )
        channel = grpc.aio.secure_channel(
            self._target, credentials, options=self._options, interceptors=self._interceptors
        )
        return _Connection(channel, transition_pb2_grpc.TransitionServiceStub(channel), pems)

    async def _diagnosed(self, error: grpc.aio.AioRpcError, pems: Pems) -> ZtateError:
        """The typed error for a failed call; for a transport failure without a ztate
        reason, what a TLS connection of our own shows: a certificate the handshake
        refuses (``HandshakeFailed``), nothing answering (``Unreachable``), or neither."""
        if error.code() is grpc.StatusCode.UNAVAILABLE:
            metadata: Iterable[tuple[str, str | bytes]] = error.trailing_metadata() or ()  # type: ignore[assignment]
            if not any(key == DETAILS_KEY for key, _ in metadata):
                verdict = await asyncio.to_thread(diagnose, self._target, pems, self._server_name)
                if verdict is not None:
                    return verdict
        return from_rpc_error(error)

    @property
    def _stub(self) -> transition_pb2_grpc.TransitionServiceStub:
        """The current channel's stub, for raw calls the SDK does not make (tests)."""
        return self._connection.stub

    @contextlib.asynccontextmanager
    async def _connected(self) -> AsyncIterator[_Connection]:
        """The connection for one call: a new one first if the certificate files changed."""
        if self._files is not None:
            pems = self._files.changed()
            if pems is not None:
                previous, self._connection = self._connection, self._connect(pems)
                previous.retired = True
                if previous.calls:
                    self._retired.add(previous)  # closed by its last call
                else:
                    await previous.channel.close(None)
        connection = self._connection
        connection.calls += 1
        try:
            yield connection
        finally:
            connection.calls -= 1
            if connection.retired and connection.calls == 0 and connection in self._retired:
                self._retired.discard(connection)
                await connection.channel.close(None)

    @classmethod
    def from_env(cls, prefix: str = "ZTATE_WORKER_") -> ZtateClient:
        """Connect from ``<prefix>TARGET``, ``CERT``, ``KEY``, ``CA`` (paths) and the
        optional ``SERVER_NAME``, as a container or a process manager sets them."""
        missing = [n for n in ("TARGET", "CERT", "KEY", "CA") if not os.environ.get(prefix + n)]
        if missing:
            raise ValueError(f"set {', '.join(prefix + n for n in missing)}")
        return cls.from_files(
            os.environ[prefix + "TARGET"],
            cert=os.environ[prefix + "CERT"],
            key=os.environ[prefix + "KEY"],
            ca=os.environ[prefix + "CA"],
            server_name=os.environ.get(prefix + "SERVER_NAME") or None,
        )

    async def _call(
        self,
        method: Callable[
            [transition_pb2_grpc.TransitionServiceStub], Callable[..., Awaitable[Reply]]
        ],
        request: object,
    ) -> Reply:
        """One RPC (``method`` picks it from the stub), retried with exponential backoff on
        transport failures; each attempt on the newest channel."""
        attempt = 0
        while True:
            pems = self._connection.pems
            try:
                async with self._connected() as connection:
                    pems = connection.pems
                    return await method(connection.stub)(request, timeout=self._timeout)
            except grpc.aio.AioRpcError as error:
                if error.code() not in RETRYABLE:
                    raise from_rpc_error(error) from None
                failure = await self._diagnosed(error, pems)
                # the same files fail the same way: a certificate problem is not retried
                if isinstance(failure, HandshakeFailed) or attempt >= self._retries:
                    raise failure from None
            await asyncio.sleep(self._backoff * 2**attempt)
            attempt += 1

    @classmethod
    def from_files(
        cls,
        target: str,
        *,
        cert: str | Path,
        key: str | Path,
        ca: str | Path,
        server_name: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        retries: int = DEFAULT_RETRIES,
        backoff: float = 0.1,
        tracer_provider: Any = None,
    ) -> ZtateClient:
        """Connect with a PEM certificate, its private key and the CA certificate(s),
        read again whenever the files change (a renewed certificate, a new CA bundle).

        Calls that fail in transport (UNAVAILABLE, DEADLINE_EXCEEDED) and are safe
        to repeat are retried ``retries`` times, waiting ``backoff`` seconds, then
        twice that, and so on; a proposal keeps its idempotency key throughout.
        """
        files = CertificateFiles(Path(cert), Path(key), Path(ca))
        return cls(
            target,
            cert_pem=files.pems.cert,
            key_pem=files.pems.key,
            ca_pem=files.pems.ca,
            server_name=server_name,
            timeout=timeout,
            retries=retries,
            backoff=backoff,
            tracer_provider=tracer_provider,
            certificate_files=files,
        )

    async def __aenter__(self) -> ZtateClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channels; calls in flight are cancelled."""
        closing, self._retired = [self._connection, *self._retired], set()
        for connection in closing:
            await connection.channel.close(None)

    async def create_thread(
        self, thread_id: str, initial_state: dict[str, Any], *, policy: str = ""
    ) -> Transition:
        """Create a thread bound to ``policy`` (operator and service identities only).

        ``policy`` may be empty when the service loads a single policy. Returns the
        genesis transition (``ProtocolError`` when the service's answer has none).
        Retried like the other calls: the service answers a caller that creates the
        same thread again with the same state and policy with its genesis
        (``replayed`` True: nothing written), so a retry after a lost reply is not
        ``THREAD_EXISTS`` (another state, policy or caller is).
        """
        request = transition_pb2.CreateThreadRequest(
            thread_id=thread_id, initial_state_json=encode_json(initial_state), policy=policy
        )
        response = await self._call(lambda stub: stub.CreateThread, request)
        _require(response, "genesis")
        return Transition.from_message(response.genesis, replayed=response.replayed)

    async def get_view(self, thread_id: str) -> View:
        """The head of a thread, projected to the keys this worker may read
        (``ProtocolError`` when the service's answer holds no JSON object as the state)."""
        response = await self._call(
            lambda stub: stub.GetView, transition_pb2.GetViewRequest(thread_id=thread_id)
        )
        return View(
            thread_id=response.thread_id,
            version=response.version,
            head_digest=response.head_digest,
            state=_json_object(response.state_json, "GetViewResponse", "state_json"),
        )

    async def propose(
        self,
        thread_id: str,
        expected_version: int,
        patch: dict[str, Any] | bytes,
        *,
        idempotency_key: str | None = None,
        lease_epoch: int = 0,
    ) -> Transition:
        """Propose a patch against ``expected_version``; returns the committed transition.

        Raises ``AwaitingApproval`` when the patch matched a risk rule and was parked
        instead of committed. Pass the same ``idempotency_key`` when retrying a call
        whose outcome is unknown: the server then returns the original outcome.
        ``lease_epoch`` (a ``WorkItem``'s) fences the proposal: ``LeaseLost`` if that
        lease no longer holds the thread; committed or parked, it releases the lease.
        """
        request = transition_pb2.ProposeTransitionRequest(
            thread_id=thread_id,
            expected_version=expected_version,
            patch_json=patch if isinstance(patch, bytes) else encode_json(patch),
            idempotency_key=idempotency_key or uuid.uuid4().hex,
            lease_epoch=lease_epoch,
        )
        response = await self._call(lambda stub: stub.ProposeTransition, request)
        _require(response, "outcome")
        if response.WhichOneof("outcome") == "pending":
            pending = response.pending
            raise AwaitingApproval(
                pending.digest,
                pending.thread_id,
                pending.base_version,
                tuple(pending.risk_rules),
                pending.handle,
            )
        return Transition.from_message(response.transition, replayed=response.replayed)

    async def get_transition(
        self, *, digest: str | None = None, thread_id: str | None = None, version: int | None = None
    ) -> Transition:
        """One ledger record by digest, or by thread and version (operators only)."""
        if digest is not None:
            request = transition_pb2.GetTransitionRequest(digest=digest)
        elif thread_id is not None and version is not None:
            request = transition_pb2.GetTransitionRequest(
                thread_version=transition_pb2.ThreadVersion(thread_id=thread_id, version=version)
            )
        else:
            raise ValueError("give digest, or thread_id and version")
        response = await self._call(lambda stub: stub.GetTransition, request)
        _require(response, "transition")
        return Transition.from_message(response.transition)

    async def get_record(
        self,
        thread_id: str,
        *,
        version: int | None = None,
    ) -> HeadRecord:
        """The head record of ``thread_id`` (or the record at ``version``) with the
        approval receipt it was committed under.

        A node may read a record of its own workflow's thread whose patch changes
        only keys it may read; ``PermissionDenied`` otherwise.
        """
        if version is None:
            request = transition_pb2.GetTransitionRequest(head_of_thread=thread_id)
        else:
            request = transition_pb2.GetTransitionRequest(
                thread_version=transition_pb2.ThreadVersion(thread_id=thread_id, version=version)
            )
        response = await self._call(lambda stub: stub.GetTransition, request)
        _require(response, "transition")
        receipt = (
            Receipt(
                response.receipt.receipt_json, response.receipt.signature, response.receipt.key_id
            )
            if response.HasField("receipt")
            else None
        )
        return HeadRecord(
            Transition.from_message(response.transition), receipt, tuple(response.risk_rules)
        )

    async def get_checkpoint(self, thread_id: str) -> Checkpoint | None:
        """The newest signed checkpoint of a thread, or None if none was signed yet."""
        response = await self._call(
            lambda stub: stub.GetCheckpoint,
            transition_pb2.GetCheckpointRequest(thread_id=thread_id),
        )
        if not response.HasField("checkpoint"):
            return None
        found = response.checkpoint
        return Checkpoint(found.checkpoint_json, found.signature, found.key_id)

    async def watch(
        self, thread_id: str, from_version: int = -1, *, reconnects: int = 10
    ) -> AsyncGenerator[WatchEvent, None]:
        """Each version of ``thread_id`` newer than ``from_version``, in order, forever.

        Versions already committed come first, then each one as it commits. When
        the stream breaks in transport (UNAVAILABLE, DEADLINE_EXCEEDED), it is
        re-opened from the last version received, so no version is skipped or
        repeated; after ``reconnects`` failures in a row without a message, the
        typed error is raised. The server also ends streams normally (after its
        maximum stream lifetime, so that access is checked again, or when it
        stops): the watch then resumes at once from the last version; only a
        normal end that came quickly and brought nothing counts as a failure.
        Refusals (a thread of another workflow, a stream limit:
        ``TooManyStreams``) are raised at once, and so is a certificate the
        handshake refuses (``HandshakeFailed``). A message the protocol does not
        allow (a state that is not a JSON object) ends the watch with
        ``ProtocolError``: it is not skipped. Break out of the loop to stop watching.
        """
        last = from_version

        def open_watch(stub: transition_pb2_grpc.TransitionServiceStub) -> Any:
            # re-opened after the last version received
            return stub.WatchThread(
                transition_pb2.WatchThreadRequest(thread_id=thread_id, from_version=last)
            )

        # closed with this generator, so that its stream ends when the caller stops
        async with contextlib.aclosing(
            self._resumed(open_watch, reconnects, "the watch stream keeps ending")
        ) as messages:
            async for message in messages:
                last = message.version
                yield WatchEvent(
                    thread_id=message.thread_id,
                    version=message.version,
                    digest=message.digest,
                    state=None
                    if message.state_pruned
                    else _json_object(message.state_json, "WatchThreadResponse", "state_json"),
                )

    async def subscribe_work(
        self, *, max_in_flight: int = 1, reconnects: int = 10
    ) -> AsyncGenerator[WorkItem, None]:
        """The threads on which this node has work, each leased to this process, forever.

        The stream is re-opened when it breaks in transport or the server ends it,
        and its failures are raised typed, as ``watch``'s are (a certificate the
        handshake refuses: ``HandshakeFailed`` at once), and a message the protocol does
        not allow (without the lease's expiry, a state that is not a JSON object) ends it
        with ``ProtocolError``, not skipped; leases already received stay this process's
        until they lapse (so does that message's). At most ``max_in_flight`` leases are
        held through the stream at once: release (or propose under) one to receive the
        next."""
        request = transition_pb2.SubscribeWorkRequest(max_in_flight=max_in_flight)
        async with contextlib.aclosing(
            self._resumed(
                lambda stub: stub.SubscribeWork(request), reconnects, "the work stream keeps ending"
            )
        ) as messages:
            async for message in messages:
                _require(message, "lease_expires_at")
                yield WorkItem(
                    thread_id=message.thread_id,
                    version=message.version,
                    state=_json_object(message.state_json, "SubscribeWorkResponse", "state_json"),
                    lease_epoch=message.lease_epoch,
                    lease_expires_at=message.lease_expires_at.ToDatetime(),
                    lease_ttl=message.lease_ttl_seconds,
                    head_digest=message.head_digest,
                )

    async def _resumed(
        self,
        open_stream: Callable[[transition_pb2_grpc.TransitionServiceStub], Any],
        reconnects: int,
        keeps_ending: str,
    ) -> AsyncGenerator[Any, None]:
        """The messages of a server stream (``open_stream`` opens it on a stub), re-opened
        when it breaks in transport or the server ends it, on the newest channel.

        A refusal is raised at once, typed; a transport failure before any message is
        diagnosed (a certificate the handshake refuses is ``HandshakeFailed``, raised at
        once: the same files fail the same way); after ``reconnects`` failures in a row
        without a message, the typed error is raised. A normal end of a stream that
        brought a message or lasted ``NORMAL_END_SECONDS`` is resumed at once; one that
        came quickly and brought nothing counts as a failure (``keeps_ending``)."""
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            opened = loop.time()
            received = False
            async with self._connected() as connection:
                call = open_stream(connection.stub)
                try:
                    async for message in call:
                        failures = 0
                        received = True
                        yield message
                        if connection.retired:
                            break  # new certificate files: resume on the new channel
                except grpc.aio.AioRpcError as error:
                    if error.code() not in RETRYABLE:
                        raise from_rpc_error(error) from None
                    failure = (
                        from_rpc_error(error)
                        if received
                        else await self._diagnosed(error, connection.pems)
                    )
                    if isinstance(failure, HandshakeFailed) or failures >= reconnects:
                        raise failure from None
                else:
                    if received or loop.time() - opened >= NORMAL_END_SECONDS:
                        continue  # a normal end of a stream that served: resume now
                finally:
                    call.cancel()
            # the stream broke, or ended at once: resume after the last message
            failures += 1
            if failures > reconnects:
                raise Unavailable(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE", keeps_ending)
            await asyncio.sleep(min(self._backoff * 2 ** (failures - 1), 5.0))

    async def renew_lease(self, thread_id: str, lease_epoch: int) -> datetime:
        """Extend a lease this node holds; when it now lapses. ``LeaseLost`` if it
        is no longer this grant's."""
        response = await self._call(
            lambda stub: stub.RenewLease,
            transition_pb2.RenewLeaseRequest(thread_id=thread_id, lease_epoch=lease_epoch),
        )
        _require(response, "lease_expires_at")
        expires: datetime = response.lease_expires_at.ToDatetime()
        return expires

    async def release_lease(self, thread_id: str, lease_epoch: int, handled_version: int) -> None:
        """Give a lease back, done with the thread up to ``handled_version`` (-1: give
        the work back undone). ``LeaseLost`` if it is no longer this grant's."""
        await self._call(
            lambda stub: stub.ReleaseLease,
            transition_pb2.ReleaseLeaseRequest(
                thread_id=thread_id, lease_epoch=lease_epoch, handled_version=handled_version
            ),
        )

    async def wait_for_outcome(
        self, parked: AwaitingApproval | str, *, within: float = 60.0
    ) -> Outcome:
        """Wait until a parked transition is decided, or ``within`` seconds pass.

        ``parked`` is the ``AwaitingApproval`` a proposal raised, its ``handle``, or (for
        operators and ``read_records`` nodes) a transition digest. The server answers
        as soon as the outcome is known, without polling on this side; a "pending"
        outcome means the time ran out first. The server holds one call at most 60
        seconds: a longer ``within`` asks again until it has passed.
        """
        request = wait_request(parked)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            pems = self._connection.pems
            try:
                async with self._connected() as connection:
                    pems = connection.pems
                    response = await connection.stub.WaitForOutcome(
                        request, timeout=max(deadline - loop.time(), 0.0)
                    )
            except grpc.aio.AioRpcError as error:
                raise await self._diagnosed(error, pems) from None
            if response.outcome != transition_pb2.OUTCOME_PENDING:
                break
            # the server answers "pending" 0.2 s before a call's deadline, or at its cap
            if deadline - loop.time() <= ASK_AGAIN_SECONDS:
                break
        if response.outcome not in _OUTCOMES:
            # UNSPECIFIED is never sent; an outcome this client does not know, no status
            raise ProtocolError(
                f"the service answered WaitForOutcome with outcome {response.outcome}"
            )
        status = transition_pb2.Outcome.Name(response.outcome).removeprefix("OUTCOME_").lower()
        if response.outcome == transition_pb2.OUTCOME_COMMITTED:
            _require(response, "transition")
        transition = (
            Transition.from_message(response.transition)
            if response.HasField("transition")
            else None
        )
        return Outcome(status, transition, response.reason or None)

    async def update(
        self,
        thread_id: str,
        change: Callable[[View], dict[str, Any] | Awaitable[dict[str, Any]]],
        *,
        attempts: int = 5,
    ) -> Transition:
        """Read the view, compute a patch with ``change(view)`` and propose it; when
        another writer got there first (STALE_VERSION), read again and re-run
        ``change``, up to ``attempts`` times. Any other refusal is raised at once."""
        for attempt in range(attempts):
            view = await self.get_view(thread_id)
            patch = change(view)
            if inspect.isawaitable(patch):
                patch = await patch
            try:
                return await self.propose(thread_id, view.version, patch)
            except StaleVersion:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")


def wait_request(parked: AwaitingApproval | str) -> transition_pb2.WaitForOutcomeRequest:
    """A handle holds a "/" (``<thread_id>/<idempotency_key>``); a digest never does."""
    if isinstance(parked, AwaitingApproval):
        parked = parked.handle or parked.digest
    if "/" in parked:
        return transition_pb2.WaitForOutcomeRequest(handle=parked)
    return transition_pb2.WaitForOutcomeRequest(digest=parked)
