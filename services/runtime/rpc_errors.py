"""The one place where domain errors become gRPC statuses.

A refusal travels as a ``google.rpc.Status`` in the ``grpc-status-details-bin``
trailer with two details: a ``google.rpc.ErrorInfo`` (reason, domain) for generic
clients and a ``ztate.v1.ErrorDetail`` with the typed fields.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from ztate.services.runtime import errors
from ztate.v1 import errors_pb2

ERROR_DOMAIN = "ztate.dev"
# A refusal's message travels twice in the trailers (grpc-message and the status
# detail), which gRPC caps at 16 KiB together: past that the caller would get a bare
# RESOURCE_EXHAUSTED instead of the refusal. A message is cut to this many characters
# (its reason, keys and limits travel whole in the typed detail).
MAX_MESSAGE_CHARS = 2048

STATUS_OF: dict[type[errors.ZtateError], grpc.StatusCode] = {
    errors.IdentityInvalid: grpc.StatusCode.UNAUTHENTICATED,
    # the credential no longer proves an identity (as an expired one would not), rather
    # than a proven identity lacking a right: UNAUTHENTICATED, not PERMISSION_DENIED
    errors.IdentityRevoked: grpc.StatusCode.UNAUTHENTICATED,
    errors.CertificateExpired: grpc.StatusCode.UNAUTHENTICATED,
    errors.RoleForbidden: grpc.StatusCode.PERMISSION_DENIED,
    errors.NodeNotRegistered: grpc.StatusCode.PERMISSION_DENIED,
    errors.KeyNotWritable: grpc.StatusCode.PERMISSION_DENIED,
    errors.PatchTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.StateTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PatchMalformed: grpc.StatusCode.INVALID_ARGUMENT,
    errors.UnsupportedCharacter: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ValueOutOfRange: grpc.StatusCode.INVALID_ARGUMENT,
    errors.StaleVersion: grpc.StatusCode.ABORTED,
    errors.ThreadNotFound: grpc.StatusCode.NOT_FOUND,
    errors.ThreadExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.TransitionNotFound: grpc.StatusCode.NOT_FOUND,
    errors.IdempotencyKeyReused: grpc.StatusCode.INVALID_ARGUMENT,
    errors.RequestInvalid: grpc.StatusCode.INVALID_ARGUMENT,
    errors.KeyUnknown: grpc.StatusCode.INVALID_ARGUMENT,
    errors.StorageUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.SchemaViolation: grpc.StatusCode.INVALID_ARGUMENT,
    errors.LayerViolation: grpc.StatusCode.PERMISSION_DENIED,
    errors.InvariantViolated: grpc.StatusCode.FAILED_PRECONDITION,
    errors.CredentialDetected: grpc.StatusCode.INVALID_ARGUMENT,
    errors.PolicyNotFound: grpc.StatusCode.NOT_FOUND,
    errors.PolicyMismatch: grpc.StatusCode.PERMISSION_DENIED,
    errors.ReceiptInvalid: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ReceiptMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ReceiptExpired: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ReceiptReplayed: grpc.StatusCode.ALREADY_EXISTS,
    errors.ApprovalStale: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ReviewNotFound: grpc.StatusCode.NOT_FOUND,
    errors.ReviewClosed: grpc.StatusCode.FAILED_PRECONDITION,
    errors.SelfApproval: grpc.StatusCode.PERMISSION_DENIED,
    errors.AlreadyDecided: grpc.StatusCode.ALREADY_EXISTS,
    errors.StatePruned: grpc.StatusCode.FAILED_PRECONDITION,
    errors.TooManyStreams: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.LeaseLost: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NoWakeDeclared: grpc.StatusCode.FAILED_PRECONDITION,
    errors.QueryTooCostly: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def _packed(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed


def to_status(error: errors.ZtateError) -> grpc.Status:
    """The rich gRPC status for a domain error."""
    code = STATUS_OF[type(error)]
    reason_value = errors_pb2.ErrorReason.Value(f"ERROR_REASON_{error.reason}")
    detail = errors_pb2.ErrorDetail(
        reason=reason_value,
        keys=list(error.keys),
        keys_total=error.keys_total,
        current_version=error.current_version or 0,
        limit=error.limit or 0,
        rules=list(error.rules),
    )
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN)
    if error.current_version is not None:
        info.metadata["current_version"] = str(error.current_version)
    if error.keys:
        # the first MAX_NAMED_KEYS names, once here and once in the typed detail
        info.metadata["keys"] = ",".join(error.keys)
        info.metadata["keys_total"] = str(error.keys_total)
    if error.rules:
        info.metadata["rules"] = ",".join(error.rules)
    status = status_pb2.Status(
        code=getattr(code_pb2, code.name),
        message=bounded_message(error.message),
        details=[_packed(info), _packed(detail)],
    )
    return rpc_status.to_status(status)


def bounded_message(message: str) -> str:
    """``message``, cut to ``MAX_MESSAGE_CHARS`` characters, saying how many more."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} characters more)"


def internal_status() -> grpc.Status:
    """The status for a failure we did not foresee: no detail leaks to the caller."""
    status = status_pb2.Status(code=code_pb2.INTERNAL, message="internal error")
    return rpc_status.to_status(status)
