"""Typed errors raised by the worker SDK, one per server reason."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.rpc import status_pb2

from ztate.v1 import errors_pb2

DETAILS_KEY = "grpc-status-details-bin"


class ZtateError(Exception):
    """A call the control plane refused, with the server's reason and details."""

    # what to check, for the refusals a worker's operator can act on ("" otherwise)
    hint: str = ""

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: str,
        message: str,
        *,
        keys: tuple[str, ...] = (),
        current_version: int | None = None,
        limit: int | None = None,
        rules: tuple[str, ...] = (),
        keys_total: int | None = None,
    ) -> None:
        super().__init__(f"{reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message
        self.keys = keys
        self.current_version = current_version
        self.limit = limit
        self.rules = rules
        # a refusal names at most 32 keys; this counts them all
        self.keys_total = len(keys) if keys_total is None else keys_total


class Unauthenticated(ZtateError):
    """Our certificate carries no identity the server accepts."""


class CertificateExpired(Unauthenticated):
    """Our certificate's validity period ended on a connection opened while it was valid
    (CERTIFICATE_EXPIRED): a renewed certificate on disk is used from the next
    connection; no retry with this one succeeds."""

    hint = (
        "the service refused our certificate: it has expired (or is not valid yet); "
        "renew it (ztate ca renew, or your PKI's tooling) and the client uses the new "
        "files on its next connection"
    )


class IdentityRevoked(Unauthenticated):
    """Our certificate, or our whole identity, is in the service's revocation list
    (IDENTITY_REVOKED): no retry with this certificate will succeed. A revoked
    certificate needs a new one (``ztate ca renew``); a revoked identity, an operator."""

    hint = (
        "the service refused our certificate: it is revoked (the service's revocation "
        "list names its serial or its identity); a revoked certificate needs a new one "
        "(ztate ca renew), a revoked identity needs an operator"
    )


class PermissionDenied(ZtateError):
    """Our identity may not do this; ``keys`` names refused state keys, if any."""


class InvalidRequest(ZtateError):
    """The request or its patch is malformed, out of range, of the wrong type, or holds
    what looks like a credential; ``keys`` names the state keys at fault."""


class FailedPrecondition(ZtateError):
    """The request cannot apply to the current state (see the reason)."""


class InvariantViolated(FailedPrecondition):
    """The resulting state would break a policy invariant; ``rules`` names it."""


class ResourceExhausted(ZtateError):
    """A limit was reached (RESOURCE_EXHAUSTED); the subclasses say which."""


class PatchTooLarge(ResourceExhausted):
    """The patch is over the server's limit (``limit``, in bytes)."""


class StateTooLarge(ResourceExhausted):
    """The state the patch would make is over the server's ``ZTATE_MAX_STATE_BYTES``
    (``limit``): refused, so that the thread stays readable."""


class MessageTooLarge(ResourceExhausted):
    """gRPC itself refused a message over a channel's size limit (no ztate reason):
    this client's receive limit, or the server's request limit."""


class StaleVersion(ZtateError):
    """The thread moved on; ``current_version`` is its head. Re-read and retry."""


class TooManyStreams(ResourceExhausted):
    """The server already serves as many watch streams as it allows; ``limit`` is that
    number. Retry later, or on another replica."""


class QueryTooCostly(ResourceExhausted):
    """A ledger query ran longer than the server's limit (``limit``, in milliseconds:
    ``ZTATE_LEDGER_QUERY_TIMEOUT_SECONDS``) and was cancelled. Narrow it (a thread, a
    node, a shorter time window) before asking again."""


class LeaseLost(FailedPrecondition):
    """The lease this worker held on a thread lapsed (whether or not another process of
    the node took it since) or was released: its proposal was refused, nothing
    committed."""


class NotFound(ZtateError):
    """No such thread or transition."""


class AlreadyExists(ZtateError):
    """A thread with this id exists."""


class Unavailable(ZtateError):
    """The control plane could not be reached or could not reach its database."""


class Unreachable(Unavailable):
    """Nothing answers at the service's address (reason ``UNREACHABLE``, set by this
    client, not the server): the service is down, or the address is wrong."""


class HandshakeFailed(Unavailable):
    """The TLS handshake with the service failed for a certificate reason, which gRPC
    alone reports as UNAVAILABLE, like a service that is down. ``reason`` says which
    (set by this client, not the server) and ``hint`` what to check:

    - ``KEY_UNUSABLE``, ``CERTIFICATE_UNUSABLE``, ``CA_UNUSABLE`` (a file that is not
      PEM, a key encrypted with a password, a key or certificate key of a curve
      cryptography does not support), ``KEY_MISMATCH``, ``CERTIFICATE_EXPIRED``,
      ``CERTIFICATE_NOT_YET_VALID``: our own files, checked before any call;
    - ``CERTIFICATE_REFUSED``: the service refused our certificate (another CA, or
      unknown to the service);
    - ``SERVER_NOT_TRUSTED``: our CA file does not verify the service's certificate;
    - ``SERVER_NAME_MISMATCH``: the service's certificate does not name the host dialed.

    Not retried: the same files fail the same way.
    """

    def __init__(self, code: grpc.StatusCode, reason: str, hint: str) -> None:
        super().__init__(code, reason, hint)
        self.hint = hint


_BY_CODE: dict[grpc.StatusCode, type[ZtateError]] = {
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MessageTooLarge,
    grpc.StatusCode.ABORTED: StaleVersion,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
}


_BY_REASON: dict[str, type[ZtateError]] = {
    "IDENTITY_REVOKED": IdentityRevoked,
    "CERTIFICATE_EXPIRED": CertificateExpired,
    "INVARIANT_VIOLATED": InvariantViolated,
    "TOO_MANY_STREAMS": TooManyStreams,
    "LEASE_LOST": LeaseLost,
    "PATCH_TOO_LARGE": PatchTooLarge,
    "STATE_TOO_LARGE": StateTooLarge,
    "QUERY_TOO_COSTLY": QueryTooCostly,
}


def from_rpc_error(error: grpc.aio.AioRpcError) -> ZtateError:
    """Turn a failed call into the typed error its status details describe."""
    code = error.code()
    cls = _BY_CODE.get(code, ZtateError)
    detail = errors_pb2.ErrorDetail()
    found = False
    metadata: Iterable[tuple[str, str | bytes]] = error.trailing_metadata() or ()  # type: ignore[assignment]
    for key, value in metadata:
        if key == DETAILS_KEY and isinstance(value, bytes):
            status = status_pb2.Status.FromString(value)
            for packed in status.details:
                if packed.Is(errors_pb2.ErrorDetail.DESCRIPTOR):
                    packed.Unpack(detail)
                    found = True
    reason = (
        errors_pb2.ErrorReason.Name(detail.reason).removeprefix("ERROR_REASON_")
        if found
        else code.name
    )
    cls = _BY_REASON.get(reason, cls)
    return cls(
        code,
        reason,
        error.details() or "",
        keys=tuple(detail.keys),
        current_version=detail.current_version if reason == "STALE_VERSION" else None,
        limit=detail.limit or None,
        rules=tuple(detail.rules),
        keys_total=detail.keys_total or len(detail.keys),
    )


class ProtocolError(ZtateError):
    """The service answered, but not as the protocol says: a reply without a field it
    must carry (CreateThread's genesis, GetTransition's transition, a transition's commit
    time, a lease's expiry, ProposeTransition's outcome, WaitForOutcome's outcome and its
    transition once committed). A service of another version, or not a ztate service;
    not retried. ``reason`` is ``BAD_REPLY`` (set by this client, not the
    server) and ``code`` INTERNAL, as gRPC names a reply its client cannot use."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INTERNAL, "BAD_REPLY", message)


class RecordWithheld(LookupError):
    """The service answered without the ledger record: this node's policy does not mark
    it ``read_records``, and a record (or any digest) commits to state it may not read."""


class AwaitingApproval(Exception):
    """The patch matched a risk rule: it was parked, not committed.

    ``handle`` names it for ``wait_for_outcome``. ``digest`` is the transition digest
    a reviewer's decision binds to and ``risk_rules`` the rules it matched; both are
    empty for a node whose policy does not mark it ``read_records`` (a digest commits
    to state the node may not read, and a rule may test such state).
    """

    def __init__(
        self,
        digest: str,
        thread_id: str,
        base_version: int,
        risk_rules: tuple[str, ...],
        handle: str = "",
    ):
        named = f"transition {digest}" if digest else f"proposal {handle}"
        rules = f" ({', '.join(risk_rules)})" if risk_rules else ""
        super().__init__(f"{named} on {thread_id}@{base_version} awaits approval{rules}")
        self.digest = digest
        self.thread_id = thread_id
        self.base_version = base_version
        self.risk_rules = risk_rules
        self.handle = handle
